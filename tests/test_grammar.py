"""Constrained decoding on the target (``specsplit.engine.grammar``), on the tiny preset pair
(fp32, its own tokenizer): speculative output under a JSON schema equals greedy decoding of the
target masked to the schema (full re-forwards, the mask computed here with numpy); every tree
node's mask is the one its path's tokens leave; a session rebuilt after its target lost it (a
CACHE_MISS, then a resend) goes on as before; bad grammars are refused, changing nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from schemas import CacheSync, ErrorReply, FlatTree, GrammarSpec, SamplingSpec, TreeSpec, VerifyReply, VerifyRequest
from specsplit.engine.base import EngineLimits
from specsplit.engine.grammar import GrammarBook
from specsplit.engine.target import TargetEngine
from specsplit.local import generate
from specsplit.tree import validate_tree

SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer"}, "name": {"type": "string", "maxLength": 6}},
     "required": ["n", "name"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    {"type": "object"},
]


@pytest.fixture(scope="module")
def pair():
    from specsplit.models import load_model
    from tests.api_fleet import tiny_pair

    target, tok, paths = tiny_pair()
    draft, _ = load_model(paths.draft)
    book = GrammarBook.for_model(tok.tok, paths.target, target.config.vocab_size)
    prompt = tok.encode_chat([{"role": "user", "content": "Answer in JSON: what is it?"}])
    return target, draft, tok, book, prompt


def spec(schema) -> GrammarSpec:
    return GrammarSpec(kind="json_schema", text=json.dumps(schema))


def masked_greedy(model, book: GrammarBook, prompt: list[int], n: int, stops: list[int], schema) -> list[int]:
    """Greedy decoding of ``model`` with every token the ``schema`` (a JSON schema, or a
    GrammarSpec) forbids masked out, one full re-forward a token: the oracle."""
    from llguidance import LLMatcher

    from specsplit.engine.grammar import to_grammar

    grammar = to_grammar(schema if isinstance(schema, GrammarSpec) else spec(schema))
    m = LLMatcher(book._tokenizer(), grammar)
    ids, out = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.zeros(logits.shape[0], dtype=torch.bool)
        allowed[:min(len(bits), logits.shape[0])] = torch.from_numpy(bits[:logits.shape[0]].astype(bool))
        t = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(t)
        ids.append(t)
        if t in stops:
            break
        assert m.consume_token(t)
    return out


@pytest.mark.parametrize("schema", SCHEMAS)
def test_speculative_output_equals_greedy_decoding_masked_to_the_schema(pair, schema):
    target, draft, tok, book, prompt = pair
    want = masked_greedy(target, book, prompt, 48, tok.stop_token_ids, schema)
    got = generate(draft, target, prompt, max_new_tokens=48, tree=TreeSpec(max_nodes=8, max_depth=4, branch=2),
                   sampling=SamplingSpec(), stop_token_ids=tok.stop_token_ids, grammar=spec(schema), grammars=book)
    assert got == want
    unconstrained = generate(draft, target, prompt, max_new_tokens=48, tree=TreeSpec(max_nodes=8, max_depth=4),
                             sampling=SamplingSpec(), stop_token_ids=tok.stop_token_ids)
    assert unconstrained != got  # the random model writes no JSON of its own: the masks did it
    if got[-1] in tok.stop_token_ids:
        json.loads(tok.decode(got[:-1]))


def test_the_tokens_a_grammar_forces_are_proposed_and_change_nothing(pair):
    """With the target's forced tokens hung under each round's root (the ``grammar`` chain), the
    answer is still the masked oracle's, in fewer rounds than without them: the schema's keys
    and punctuation are accepted where an unconstrained draft guesses otherwise (a draft masked
    to the grammar proposes them itself: tests/test_draft_grammar.py)."""
    from specsplit.orchestrator.state import RoundStats

    target, draft, tok, book, prompt = pair
    schema = {**SCHEMAS[0], "x-guidance": {"whitespace_flexible": False}}
    want = masked_greedy(target, book, prompt, 48, tok.stop_token_ids, schema)
    rounds = {}
    for chains in (True, False):
        stats = RoundStats()
        got = generate(draft, target, prompt, max_new_tokens=48, tree=TreeSpec(max_nodes=8, max_depth=4, branch=2),
                       sampling=SamplingSpec(), stop_token_ids=tok.stop_token_ids, grammar=spec(schema),
                       grammars=book, lookup_max_tokens=8, grammar_chains=chains, stats=stats)
        assert got == want, chains
        rounds[chains] = stats.rounds
    assert rounds[True] < rounds[False], rounds


def test_sampled_output_keeps_to_the_schema(pair):
    target, draft, tok, book, prompt = pair
    # llguidance's option for compact JSON (the default lets a random model write whitespace forever)
    schema = {**SCHEMAS[1], "x-guidance": {"whitespace_flexible": False}}
    for seed in range(4):
        got = generate(draft, target, prompt, max_new_tokens=48, tree=TreeSpec(max_nodes=8, max_depth=4, branch=2),
                       sampling=SamplingSpec(temperature=1.0, seed=seed), stop_token_ids=tok.stop_token_ids,
                       grammar=spec(schema), grammars=book)
        assert got[-1] in tok.stop_token_ids, seed  # the array closes within 48 tokens
        value = json.loads(tok.decode(got[:-1]))
        assert 1 <= len(value) <= 4 and set(value) <= {"red", "green", "blue"}


def engine(target, book) -> TargetEngine:
    eng = TargetEngine(target, EngineLimits(max_sessions=4, max_session_tokens=512, max_tree_nodes=16))
    eng.grammars = book
    return eng


def test_each_nodes_mask_is_what_its_paths_tokens_leave(pair):
    """A tree of allowed and forbidden tokens: each reachable node's row keeps exactly the tokens
    a fresh matcher allows after the node's path (the rows of unreachable ones are not read)."""
    from llguidance import LLMatcher

    target, _, tok, book, prompt = pair
    schema = SCHEMAS[0]
    ids = tok.encode
    open_, key = ids('{"'), ids("n")
    tokens = [prompt[-1], *open_, key[0], ids("x")[0], ids("[")[0], ids(" ")[0]]
    parents = [-1, *range(len(open_))]
    # after '{"': "n" (allowed) and "x" (forbidden); at the root, "[" and " " (both forbidden)
    parents += [len(open_), len(open_), 0, 0]
    tree = FlatTree(token_ids=tokens, parents=parents)
    layout = validate_tree(tree, vocab_size=target.config.vocab_size, max_nodes=16, max_depth=8)
    req = VerifyRequest(session_id="s", round=0, sync=CacheSync(base_len=0, append_token_ids=prompt[:-1],
                                                                prompt_len=len(prompt)), tree=tree, grammar=spec(schema))
    eng = engine(target, book)
    session = eng.open_session("s", 0, req.sync, layout.num_nodes)
    logits = torch.randn(len(tokens), target.config.vocab_size)
    rows = book.constrain(session, req, layout, logits)
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
    reachable = {0: []}
    for i in range(1, len(tokens)):
        p = parents[i]
        if p in reachable:
            m = LLMatcher(book._tokenizer(), grammar)
            if m.consume_tokens(reachable[p]) and m.validate_tokens([tokens[i]]) == 1:
                reachable[i] = [*reachable[p], tokens[i]]
    assert set(reachable) == set(range(len(open_) + 2))
    for node, path in reachable.items():
        m = LLMatcher(book._tokenizer(), grammar)
        assert m.consume_tokens(path)
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        want = torch.from_numpy(bits[:logits.shape[1]].astype(bool))
        assert torch.equal(torch.isfinite(rows[node]), want), node
        assert torch.equal(rows[node][want], logits[node][want])


def test_end_tokens_in_several_branches_verify_and_the_session_goes_on(pair):
    """Where the output may end, a tree proposes the end token in several branches (and past
    one). Every round verifies: llguidance's matcher, stepped past an end and rolled back,
    refused the next end, so such trees were a CACHE_MISS at every resend (found on the real
    pair); the masks never step past an end now."""
    from llguidance import LLMatcher

    from specsplit.engine.grammar import to_grammar

    target, _, tok, book, prompt = pair
    end = tok.stop_token_ids[0]
    out = tok.encode('{"a": 1')
    close, space = tok.encode("}")[0], tok.encode(" ")[0]
    committed = [*prompt, *out]
    eng = engine(target, book)
    for rnd in range(3):
        # root -> } -> end -> end; root -> " " -> } -> end; root -> end (forbidden here)
        tree = FlatTree(token_ids=[committed[-1], close, end, end, space, close, end, end],
                        parents=[-1, 0, 1, 2, 0, 4, 5, 0])
        sync = CacheSync(base_len=0, append_token_ids=committed[:-1], prompt_len=len(prompt))
        reply = eng.handle(VerifyRequest(session_id="e", round=rnd, sync=sync, tree=tree, grammar=spec({"type": "object"})))
        assert not isinstance(reply, ErrorReply), reply
        fresh = LLMatcher(book._tokenizer(), to_grammar(spec({"type": "object"})))
        assert fresh.consume_tokens(out + reply.accepted_token_ids)
        assert fresh.validate_tokens([reply.bonus_token_id]) == 1
        held = eng.store.get("e").grammar  # the session's matcher: after exactly the accepted path
        assert held is not None and held.generated == out + reply.accepted_token_ids
        assert held.matcher.compute_bitmask() == fresh.compute_bitmask()
        eng.store.end_session("e")  # the same tree again, from an empty cache (as a resend is)


def test_a_session_its_target_lost_is_rebuilt_from_the_resend(pair):
    """Rounds of a one-token tree (the root alone): after two, the target drops the session;
    the next request (its cache assumed) is a CACHE_MISS, the resend from an empty cache
    rebuilds the grammar's state; after five, only the grammar's state is lost, and it is
    rebuilt from the tokens the session's cache holds. The output is the oracle's to the end."""
    target, _, tok, book, prompt = pair
    schema = SCHEMAS[0]
    want = masked_greedy(target, book, prompt, 24, tok.stop_token_ids, schema)
    eng = engine(target, book)
    committed, cached, out = list(prompt), 0, []
    for rnd in range(len(want)):
        if rnd == 2:
            eng.store.end_session("s")  # as an eviction would
        if rnd == 5:
            eng.store.get("s").grammar = None
        req = VerifyRequest(session_id="s", round=rnd, grammar=spec(schema),
                            sync=CacheSync(base_len=cached, append_token_ids=committed[cached:-1], prompt_len=len(prompt)),
                            tree=FlatTree(token_ids=[committed[-1]], parents=[-1]))
        reply = eng.handle(req)
        if isinstance(reply, ErrorReply):
            assert reply.code.value == "CACHE_MISS" and rnd == 2
            cached = 0
            reply = eng.handle(req.model_copy(update={"sync": CacheSync(base_len=0, append_token_ids=committed[:-1],
                                                                        prompt_len=len(prompt))}))
        assert not isinstance(reply, ErrorReply), reply
        cached = reply.cache_len
        committed.append(reply.bonus_token_id)
        out.append(reply.bonus_token_id)
    assert out == want


def test_bad_grammars_are_refused_and_change_nothing(pair):
    target, _, _, book, prompt = pair
    eng = engine(target, book)
    sync = CacheSync(base_len=0, append_token_ids=prompt[:-1], prompt_len=len(prompt))
    tree = FlatTree(token_ids=[prompt[-1]], parents=[-1])
    for bad in ('{"type": "objectx"}', "not json", '{"type": "string", "pattern": "("}'):
        reply = eng.handle(VerifyRequest(session_id="b", round=0, sync=sync, tree=tree,
                                         grammar=GrammarSpec(kind="json_schema", text=bad)))
        assert isinstance(reply, ErrorReply) and reply.code.value == "BAD_REQUEST", reply
        assert "grammar" in reply.message
    eng.grammars = None
    reply = eng.handle(VerifyRequest(session_id="b", round=0, sync=sync, tree=tree, grammar=spec(SCHEMAS[2])))
    assert isinstance(reply, ErrorReply) and reply.code.value == "BAD_REQUEST"
    with pytest.raises(ValueError):  # a grammar is verified against the full cache
        VerifyRequest(session_id="b", round=0, sync=sync, tree=tree, grammar=spec(SCHEMAS[2]), confirmed_len=1)


class _Exhausted:
    """An llguidance matcher that hit one of its resource limits after ``after`` masks (as
    ``(a{1000}){1000}`` does over Qwen's 151K tokens: "too many expressions constructed"): in
    its error state for good, its masks allow nothing, as llguidance's do then."""

    def __init__(self, real, after: int) -> None:
        self.real, self.left = real, after

    def is_error(self) -> bool:
        return self.left < 0 or self.real.is_error()

    def get_error(self) -> str:
        return "lexer error: too many expressions constructed"

    def compute_bitmask(self) -> bytes:
        self.left -= 1
        mask = self.real.compute_bitmask()
        return bytes(len(mask)) if self.left < 0 else mask

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("after", [0, 2])
def test_a_grammar_past_its_engines_limits_is_refused_before_a_token_goes_unmasked(pair, monkeypatch, after):
    """A matcher in llguidance's error state computes masks that allow nothing, which the target
    leaves unmasked (a row past an end token): the request is refused instead, naming the
    engine's error, the session's grammar state goes, and the next request is served as before."""
    target, _, _, book, prompt = pair
    eng = engine(target, book)
    sync = CacheSync(base_len=0, append_token_ids=prompt[:-1], prompt_len=len(prompt))
    want = masked_greedy(target, book, prompt, 3, [], SCHEMAS[0])
    tree = FlatTree(token_ids=[prompt[-1], *want], parents=[-1, 0, 1, 2])
    real = book._matcher
    monkeypatch.setattr(book, "_matcher", lambda key: _Exhausted(real(key), after))
    reply = eng.handle(VerifyRequest(session_id="x", round=0, sync=sync, tree=tree, grammar=spec(SCHEMAS[0])))
    assert isinstance(reply, ErrorReply) and reply.code.value == "BAD_REQUEST", reply
    assert "too many expressions" in reply.message
    assert eng.store.get("x") is None or eng.store.get("x").grammar is None
    monkeypatch.setattr(book, "_matcher", real)
    reply = eng.handle(VerifyRequest(session_id="y", round=0, sync=sync, tree=tree, grammar=spec(SCHEMAS[0])))
    assert isinstance(reply, VerifyReply) and reply.accepted_token_ids == want, reply
