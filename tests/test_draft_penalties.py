"""The draft proposes with the request's logit bias and penalties (``penalties.DraftProcessing``):
its greedy chain is its own plain greedy decoding with them (the oracle: full re-forwards,
``tests.test_penalties.penalized_greedy``), through growth and re-rooting and in a lockstep batch;
a sampled tree carries the processed distribution; a draft equal to the target then has every
proposal accepted, where an unpenalized one has tokens rejected; and a draft that cannot count
the output (the prompt not named) proposes unpenalized rather than wrong."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from schemas import CacheSync, DraftReply, DraftRequest, GenerateRequest, GrowRequest, SamplingSpec, TokenBias, TreeSpec
from specsplit.engine import penalties
from specsplit.engine import sampling as S
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.orchestrator.actor import ActorPolicy, SessionActor
from tests.conftest import greedy_reference
from tests.test_actor import EngineRpc
from tests.test_penalties import LIMITS, PROMPT, SETTINGS, penalized_greedy

CHAIN = TreeSpec(max_nodes=6, max_depth=5, branch=1, min_path_prob=0.0)
CASES = [*SETTINGS, {"logit_bias": True}, {"logit_bias": True, "presence_penalty": 1.0}]


def oracle_args(case: dict, model) -> tuple[SamplingSpec, dict]:
    """The request's sampling and ``penalized_greedy``'s keywords for one case; the bias bans the
    model's own first two greedy tokens and favours token 7."""
    kw = {k.split("_")[0]: v for k, v in case.items() if k != "logit_bias"}
    spec = {k: v for k, v in case.items() if k != "logit_bias"}
    if case.get("logit_bias"):
        plain = greedy_reference(model, PROMPT, 2)[0]
        kw["bias"] = {plain[0]: -100.0, plain[1]: -5.0, 7: 3.0}
        spec["logit_bias"] = [TokenBias(token_id=t, bias=b) for t, b in kw["bias"].items()]
    return SamplingSpec(**spec), kw


def chain(reply) -> list[int]:
    assert isinstance(reply, DraftReply), reply
    tree = reply.tree
    assert tree.parents == list(range(-1, len(tree.token_ids) - 1))  # a chain
    return tree.token_ids[1:]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k[:4]}={v}" for k, v in c.items()))
def test_the_drafts_chain_is_its_own_greedy_decoding_with_the_penalties(models, case):
    """Round 0 drafts two tokens before the processing first changes the draft's choice; growth
    extends the kept tree; round 1 re-roots it three tokens on and drafts again: both chains
    continue the oracle's decoding of the draft."""
    _, draft, _ = models["qwen2"]
    sampling, kw = oracle_args(case, draft)
    want = penalized_greedy(draft, PROMPT, 48, **kw)
    # start where the processing changes the choice: a chain drafted without it would differ
    at = next(j for j in changed(draft, want) if j >= 3) - 2
    eng = DraftEngine(draft, LIMITS)
    committed = PROMPT + want[:at]
    r0 = eng.handle(DraftRequest(session_id="d", round=0, root=committed[-1], tree=CHAIN, sampling=sampling,
                                 sync=CacheSync(base_len=0, append_token_ids=committed[:-1], prompt_len=len(PROMPT))))
    assert chain(r0) == want[at:at + 5]
    assert eng.handle(GrowRequest(session_id="d", round=0, budget_ms=60_000.0, width=1)).grown_nodes > 0
    more = want[at:at + 3]  # two accepted, the third the bonus: a path of the kept tree
    r1 = eng.handle(DraftRequest(session_id="d", round=1, root=more[-1], tree=CHAIN, sampling=sampling,
                                 sync=CacheSync(base_len=len(committed), append_token_ids=more[:-1],
                                                prompt_len=len(PROMPT))))
    assert r1.reused_nodes > 0 and chain(r1) == want[at + 3:at + 8]


@torch.no_grad()
def changed(model, out: list[int]) -> list[int]:
    """The positions of ``out`` (a decoding of PROMPT) where the model's raw argmax after
    ``out``'s tokens before it is another token; asserts there is one."""
    logits = model(torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1:-1]  # [len(out), V]
    where = [j for j, t in enumerate(out) if int(logits[j].argmax()) != t]
    assert any(j >= 3 for j in where), "the processing never changes the choice after the third token"
    return where


def test_lockstep_batches_draft_each_sessions_own_processing(models):
    """Four greedy sessions with different penalties drafted in one lockstep batch: each tree is
    the one that session drafts alone."""
    _, draft, _ = models["qwen2"]
    spec = TreeSpec(max_nodes=8, max_depth=4, branch=2)
    reqs = []
    for k, case in enumerate(CASES[:4]):
        prompt = PROMPT[k:] + PROMPT[:k]
        out = greedy_reference(draft, prompt, 5)[0]
        reqs.append(DraftRequest(session_id=f"b{k}", round=0, root=out[-1], tree=spec,
                                 sampling=oracle_args(case, draft)[0],
                                 sync=CacheSync(base_len=0, append_token_ids=prompt + out[:-1], prompt_len=len(prompt))))
    alone = [DraftEngine(draft, LIMITS).handle(r) for r in reqs]
    batched = DraftEngine(draft, LIMITS).draft_batch(reqs)
    plain = [DraftEngine(draft, LIMITS).handle(r.model_copy(update={"sampling": SamplingSpec()})) for r in reqs]
    for a, b in zip(alone, batched):
        assert isinstance(a, DraftReply) and isinstance(b, DraftReply), (a, b)
        assert (a.tree.token_ids, a.tree.parents) == (b.tree.token_ids, b.tree.parents)
    assert any(a.tree.token_ids != p.tree.token_ids for a, p in zip(alone, plain))


def test_a_sampled_tree_carries_the_processed_distribution(models):
    """The root's children are drawn from the processed row's distribution, and the tree says so
    (the verifier's rule needs the q they were drawn from)."""
    _, draft, _ = models["qwen2"]
    out = greedy_reference(draft, PROMPT, 6)[0]
    committed = PROMPT + out
    sampling = SamplingSpec(temperature=0.8, seed=3, presence_penalty=2.0, repetition_penalty=1.5,
                            logit_bias=[TokenBias(token_id=out[0], bias=-100.0)])
    eng = DraftEngine(draft, LIMITS)
    reply = eng.handle(DraftRequest(session_id="q", round=0, root=committed[-1], sampling=sampling,
                                    tree=TreeSpec(max_nodes=4, max_depth=1, branch=3),
                                    sync=CacheSync(base_len=0, append_token_ids=committed[:-1], prompt_len=len(PROMPT))))
    assert isinstance(reply, DraftReply), reply
    with torch.no_grad():
        row = draft(torch.tensor([committed])).logits[0, -1:].float()
    process = penalties.for_draft(sampling, committed, len(committed), len(PROMPT))
    q = S.probs_from_logits(process.rows(row, [[]]), sampling, eng.max_support)[0]
    ids, probs = reply.tree.child_dist_ids[0], reply.tree.child_dist_probs[0]
    assert out[0] not in ids
    assert torch.allclose(torch.tensor(probs, dtype=q.dtype), q[ids], atol=1e-6)
    assert abs(float(q[ids].sum()) - 1.0) < 1e-6


def test_without_the_output_known_the_draft_proposes_unpenalized(models):
    """The prompt not named, or a session whose tokens the draft cannot name: no penalties
    (only acceptance depends on them), the bias still applied."""
    assert penalties.for_draft(SamplingSpec(presence_penalty=1.0), [1, 2, 3], 3, 0) is None
    assert penalties.for_draft(SamplingSpec(presence_penalty=1.0), [1, 2], 3, 1) is None
    assert penalties.for_draft(SamplingSpec(), [1, 2, 3], 3, 1) is None
    biased = penalties.for_draft(SamplingSpec(presence_penalty=1.0, logit_bias=[TokenBias(token_id=3, bias=1.0)]),
                                 [1, 2, 3], 3, 0)
    assert biased is not None and biased.seen is None
    _, draft, _ = models["qwen2"]
    want = greedy_reference(draft, PROMPT, 5)[0]
    reply = DraftEngine(draft, LIMITS).handle(DraftRequest(
        session_id="u", round=0, root=PROMPT[-1], tree=CHAIN, sampling=SamplingSpec(presence_penalty=2.0),
        sync=CacheSync(base_len=0, append_token_ids=PROMPT[:-1])))
    assert chain(reply) == want


def run_chain(draft, target, sampling: SamplingSpec, n: int):
    spec = TreeSpec(max_nodes=5, max_depth=4, branch=1, min_path_prob=0.0)
    d_rpc, t_rpc = EngineRpc(DraftEngine(draft, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    req = GenerateRequest(session_id="s", prompt_token_ids=PROMPT, max_new_tokens=n, tree=spec, sampling=sampling)
    done = asyncio.run(SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=spec), lambda _: None).run())
    drafts = [m for m in d_rpc.requests if isinstance(m, DraftRequest)]
    assert drafts and all(d.sync.prompt_len == len(PROMPT) for d in drafts)  # the output's start, named
    return done


def test_a_draft_equal_to_the_target_has_every_proposal_accepted(models, monkeypatch):
    """With the draft's weights equal to the target's, its penalized chain is the target's choice:
    every round accepts the whole chain (40 tokens in 8 rounds of 4 + the bonus). The same
    draft proposing unpenalized has tokens rejected."""
    target, _, _ = models["qwen2"]
    twin = copy.deepcopy(target)
    sampling = SamplingSpec(presence_penalty=1.5, repetition_penalty=1.3)
    want = penalized_greedy(target, PROMPT, 40, presence=1.5, repetition=1.3)
    done = run_chain(twin, target, sampling, 40)
    assert done.token_ids == want
    assert (done.rounds, done.accepted_tokens) == (8, 32), (done.rounds, done.accepted_tokens)
    monkeypatch.setattr(penalties, "for_draft", lambda *a: None)
    plain = run_chain(twin, target, sampling, 40)
    assert plain.token_ids == want and plain.rounds > 8


def test_the_in_process_loop_decodes_with_penalties(models):
    """``specsplit.local.generate`` (the public in-process loop) with penalties and a bias, with
    growth and prompt lookup: plain greedy decoding with them (its target refused every round
    after the first before its syncs named the prompt)."""
    from specsplit.local import generate

    target, often, _ = models["qwen2"]
    sampling, kw = oracle_args({"logit_bias": True, "presence_penalty": 1.0, "repetition_penalty": 1.3}, target)
    want = penalized_greedy(target, PROMPT, 30, **kw)
    got = generate(often, target, PROMPT, max_new_tokens=30, tree=TreeSpec(max_nodes=8, max_depth=4, branch=2),
                   sampling=sampling, grow_budget_ms=50.0, lookup_max_tokens=4)
    assert got == want
