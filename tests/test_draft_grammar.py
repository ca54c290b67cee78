"""The draft proposes only what the session's grammar allows (``grammar.DraftGrammar``), on the
tiny preset pair (fp32, its own tokenizer): its greedy chain is its own greedy decoding masked to
the schema (the oracle: full re-forwards, ``tests.test_grammar.masked_greedy``), through growth
and re-rooting and in a lockstep batch; a sampled tree carries the masked distribution; a row
whose path the grammar forbids is left alone and the matcher ends where it began; a draft that
cannot apply the grammar proposes unconstrained rather than failing; and through the actor the
answer is the target's masked decoding in fewer rounds than with an unconstrained draft."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from schemas import (
    CacheSync,
    DraftReply,
    DraftRequest,
    GenerateRequest,
    GrammarSpec,
    GrowRequest,
    SamplingSpec,
    TreeSpec,
)
from specsplit.engine import penalties
from specsplit.engine import sampling as S
from specsplit.engine.base import EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.grammar import DraftGrammar, to_grammar
from specsplit.engine.store import Session
from specsplit.engine.target import TargetEngine
from specsplit.orchestrator.actor import ActorPolicy, SessionActor
from tests.conftest import greedy_reference
from tests.test_actor import EngineRpc
from tests.test_grammar import SCHEMAS, masked_greedy, pair, spec  # noqa: F401  (pair: the tiny pair's fixture)

LIMITS = EngineLimits(max_sessions=8, max_session_tokens=1024, max_tree_nodes=32, max_tree_depth=8)
CHAIN = TreeSpec(max_nodes=6, max_depth=5, branch=1, min_path_prob=0.0)
# compact JSON (llguidance's default lets a random model write whitespace forever)
COMPACT = [{**s, "x-guidance": {"whitespace_flexible": False}} for s in SCHEMAS]
# answers of 10 or more tokens from the tiny draft (its enum array closes after one item)
LONG = [COMPACT[0], {**COMPACT[1], "minItems": 4}, COMPACT[2]]


def engine(draft, book) -> DraftEngine:
    eng = DraftEngine(draft, LIMITS)
    eng.grammars = book
    return eng


def chain(reply) -> list[int]:
    assert isinstance(reply, DraftReply), reply
    assert reply.tree.parents == list(range(-1, len(reply.tree.token_ids) - 1))  # a chain
    return reply.tree.token_ids[1:]


def request(committed: list[int], prompt_len: int, schema, *, rnd: int = 0, base: int = 0, tree=CHAIN,
            sampling=SamplingSpec(), sid: str = "d") -> DraftRequest:
    return DraftRequest(session_id=sid, round=rnd, root=committed[-1], tree=tree, sampling=sampling,
                        sync=CacheSync(base_len=base, append_token_ids=committed[base:-1], prompt_len=prompt_len),
                        grammar=spec(schema) if schema is not None else None)


@pytest.mark.parametrize("schema", LONG, ids=["object", "enum-array", "any-object"])
def test_the_drafts_chain_is_its_own_greedy_decoding_masked_to_the_grammar(pair, schema):
    """Round 0 drafts from two tokens into the answer; growth extends the kept tree; round 1
    re-roots it three tokens on and drafts again: both chains continue the oracle's masked
    decoding of the draft, where the unconstrained draft proposes otherwise."""
    _, draft, tok, book, prompt = pair
    want = masked_greedy(draft, book, prompt, 48, tok.stop_token_ids, schema)
    assert len(want) >= 10, want
    at, eng = 2, engine(draft, book)
    committed = prompt + want[:at]
    r0 = eng.handle(request(committed, len(prompt), schema))
    assert chain(r0) == want[at:at + 5]
    plain = DraftEngine(draft, LIMITS).handle(request(committed, len(prompt), None))
    assert chain(plain) != chain(r0)  # the random draft writes no JSON of its own: the masks did it
    assert eng.handle(GrowRequest(session_id="d", round=0, budget_ms=60_000.0, width=1)).grown_nodes > 0
    more = want[at:at + 3]  # two accepted, the third the bonus: a path of the kept tree
    r1 = eng.handle(request(committed + more, len(prompt), schema, rnd=1, base=len(committed)))
    assert r1.reused_nodes > 0 and chain(r1) == want[at + 3:at + 8]


def bits_of(mask: bytes, vocab: int) -> torch.Tensor:
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab]
    out = torch.zeros(vocab, dtype=torch.bool)
    out[:len(bits)] = torch.from_numpy(bits.astype(bool))
    return out


def test_each_rows_mask_is_what_its_path_leaves_and_the_matcher_ends_where_it_began(pair):
    """Rows for the root, an allowed path, a path the grammar forbids and a path through an end
    token: the first two keep exactly what a fresh matcher allows after them, the other two are
    left as they were; afterwards the session's matcher allows what it allowed before."""
    from llguidance import LLMatcher

    _, draft, tok, book, prompt = pair
    schema = COMPACT[0]
    session = Session("m", kv=None)
    sync = CacheSync(base_len=len(prompt) - 1, append_token_ids=[], prompt_len=len(prompt))
    st = book.at(session, spec(schema), sync, prompt[-1])
    before = st.matcher.compute_bitmask()
    vocab = draft.config.vocab_size
    fresh = LLMatcher(book._tokenizer(), to_grammar(spec(schema)))
    allowed0 = bits_of(fresh.compute_bitmask(), vocab)
    first = int(allowed0.nonzero()[0])  # "{"
    forbidden = int((~allowed0).nonzero()[0])
    assert fresh.consume_token(first)
    allowed1 = bits_of(fresh.compute_bitmask(), vocab)
    end = tok.stop_token_ids[0]
    logits = torch.randn(4, vocab)
    out = DraftGrammar(book, session, st).mask(logits, [[], [first], [forbidden, first], [first, end, first]])
    assert torch.equal(torch.isfinite(out[0]), allowed0) and torch.equal(out[0][allowed0], logits[0][allowed0])
    assert torch.equal(torch.isfinite(out[1]), allowed1)
    assert torch.equal(out[2], logits[2]) and torch.equal(out[3], logits[3])
    assert session.grammar is st and st.matcher.compute_bitmask() == before


def test_lockstep_batches_draft_what_each_session_drafts_alone(pair):
    """Four greedy sessions (three schemas and one without) in one lockstep batch: each tree is
    the one that session drafts alone."""
    _, draft, tok, book, prompt = pair
    tree = TreeSpec(max_nodes=8, max_depth=4, branch=2)
    reqs = []
    for k, schema in enumerate([*COMPACT, None]):
        out = masked_greedy(draft, book, prompt, 3, tok.stop_token_ids, schema) if schema else \
            greedy_reference(draft, prompt, 3)[0]
        reqs.append(request(prompt + out, len(prompt), schema, tree=tree, sid=f"b{k}"))
    alone = [engine(draft, book).handle(r) for r in reqs]
    batched = engine(draft, book).draft_batch(reqs)
    for a, b in zip(alone, batched):
        assert isinstance(a, DraftReply) and isinstance(b, DraftReply), (a, b)
        assert (a.tree.token_ids, a.tree.parents) == (b.tree.token_ids, b.tree.parents)


def test_a_sampled_tree_carries_the_masked_distribution(pair):
    """The root's children are drawn from the masked row's distribution, and the tree says so
    (the verifier's rule needs the q they were drawn from): every id the grammar allows."""
    from llguidance import LLMatcher

    _, draft, _, book, prompt = pair
    schema = COMPACT[1]
    sampling = SamplingSpec(temperature=1.0, seed=5)
    reply = engine(draft, book).handle(request(prompt, len(prompt), schema, sampling=sampling,
                                               tree=TreeSpec(max_nodes=4, max_depth=1, branch=3)))
    assert isinstance(reply, DraftReply), reply
    with torch.no_grad():
        row = draft(torch.tensor([prompt])).logits[0, -1:].float()
    allowed = bits_of(LLMatcher(book._tokenizer(), to_grammar(spec(schema))).compute_bitmask(), row.shape[-1])
    q = S.probs_from_logits(row.masked_fill(~allowed, float("-inf")), sampling, DraftEngine(draft).max_support)[0]
    ids, probs = reply.tree.child_dist_ids[0], reply.tree.child_dist_probs[0]
    assert all(allowed[i] for i in ids) and all(allowed[t] for t in reply.tree.token_ids[1:])
    assert torch.allclose(torch.tensor(probs, dtype=q.dtype), q[ids], atol=1e-6)
    assert abs(float(q[ids].sum()) - 1.0) < 1e-6


def test_a_draft_that_cannot_apply_the_grammar_proposes_unconstrained(pair):
    """No tokenizer for grammars, the prompt not named, a grammar that does not compile, output
    it cannot name: the draft's own greedy chain, never an error (the target holds the answer)."""
    _, draft, _, book, prompt = pair
    want = chain(DraftEngine(draft, LIMITS).handle(request(prompt, len(prompt), None)))
    assert chain(DraftEngine(draft, LIMITS).handle(request(prompt, len(prompt), COMPACT[0]))) == want
    assert chain(engine(draft, book).handle(request(prompt, 0, COMPACT[0]))) == want
    bad = request(prompt, len(prompt), None).model_copy(update={"grammar": GrammarSpec(kind="lark", text="start: (")})
    assert chain(engine(draft, book).handle(bad)) == want
    eng = engine(draft, book)
    held = prompt + want[:2]
    eng.handle(request(held, len(prompt), None))
    eng.store.get("d").tokens = []  # the draft holds the output but cannot name it
    ahead = held + want[2:4]
    expect = chain(DraftEngine(draft, LIMITS).handle(request(ahead, len(prompt), None)))
    assert chain(eng.handle(request(ahead, len(prompt), COMPACT[0], rnd=1, base=len(held)))) == expect


def run(draft, target, book, prompt, n, stops, schema, draft_grammar: bool):
    tree = TreeSpec(max_nodes=8, max_depth=4, branch=2)
    d_eng, t_eng = DraftEngine(draft, LIMITS), TargetEngine(target, LIMITS)
    t_eng.grammars = book
    if draft_grammar:
        d_eng.grammars = book
    d_rpc, t_rpc = EngineRpc(d_eng), EngineRpc(t_eng)
    req = GenerateRequest(session_id="s", prompt_token_ids=prompt, max_new_tokens=n, tree=tree,
                          sampling=SamplingSpec(), stop_token_ids=stops, grammar=spec(schema))
    policy = ActorPolicy(tree=tree, lookup_max_tokens=0, draft_grammar=draft_grammar)
    done = asyncio.run(SessionActor(req, d_rpc, t_rpc, policy, lambda _: None).run())
    drafts = [m for m in d_rpc.requests if isinstance(m, DraftRequest)]
    assert drafts and all(d.grammar == (req.grammar if draft_grammar else None) for d in drafts)
    assert all(d.sync.prompt_len == (len(prompt) if draft_grammar else 0) for d in drafts)
    return done


@pytest.mark.parametrize("schema", COMPACT[:2], ids=["object", "enum-array"])
def test_through_the_actor_the_answer_is_the_targets_in_fewer_rounds(pair, schema):
    """With SPECSPLIT_DRAFT_GRAMMAR the orchestrator's actor sends the grammar and names the prompt
    in every draft request (without, neither);
    the answer is greedy decoding of the target masked to the schema, in fewer rounds than with
    the same draft unconstrained (which the target's masks reject wherever it strays)."""
    target, draft, tok, book, prompt = pair
    want = masked_greedy(target, book, prompt, 48, tok.stop_token_ids, schema)
    masked = run(draft, target, book, prompt, 48, tok.stop_token_ids, schema, True)
    plain = run(draft, target, book, prompt, 48, tok.stop_token_ids, schema, False)
    assert masked.token_ids == want == plain.token_ids
    assert masked.rounds < plain.rounds, (masked.rounds, plain.rounds)
    json.loads(tok.decode(want[:-1] if want[-1] in tok.stop_token_ids else want))


def test_bitmasks_unpack_alike_on_the_host_and_on_a_device():
    """The host's numpy unpacking (CPU logits) and the device's shifts (others) agree, bit order
    included: bit j of byte i is token 8i + j."""
    from specsplit.engine.grammar import unpack_host, unpack_on

    bits = torch.randint(0, 256, (5, 12), dtype=torch.uint8)
    host = unpack_host(bits)
    assert torch.equal(host, unpack_on(bits, torch.device("cpu")))
    assert bool(host[2, 8 * 3 + 5]) == bool(int(bits[2, 3]) >> 5 & 1)


def test_for_draft_keeps_a_grammar_alone():
    """A request with only a grammar is processed (its rows masked), one with nothing is not."""
    assert penalties.for_draft(SamplingSpec(), [1, 2, 3], 3, 1) is None
    marker = object()
    process = penalties.for_draft(SamplingSpec(), [1, 2, 3], 3, 1, marker)
    assert process is not None and process.grammar is marker and process.seen is None
