"""Log-probabilities of the output (``logprobs``) on the orchestrator and the target: each
output token's is the target's log-softmax at its position, with its most likely tokens there
(the oracle: full re-forwards of prompt + output, fp32 tiny models), greedy and sampled, one
session at a time and batched; misaligned or impossible requests are refused."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import ValidationError

from schemas import (
    CacheSync, FlatTree, GenerateDone, GenerateRequest, Logprobs, SamplingSpec, SpecPVSpec, TokenChunk, TreeSpec,
    VerifyReply, VerifyRequest,
)
from specsplit.engine.base import EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.orchestrator.actor import ActorPolicy, SessionActor
from tests.conftest import greedy_reference
from tests.test_actor import EngineRpc

LIMITS = EngineLimits(max_sessions=8, max_session_tokens=512, max_tree_nodes=64, max_tree_depth=16)
SPEC = TreeSpec(max_nodes=8, max_depth=4, branch=2)
PROMPT = [3, 14, 15, 92, 65, 35]


def reference(target, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The target's log-softmax before each output token: [len(out), V] (one full forward)."""
    with torch.no_grad():
        logits = target(torch.tensor([prompt + out])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(out)], dim=-1)


def assert_matches(lp: Logprobs, want: torch.Tensor, out: list[int], top: int) -> None:
    assert len(lp) == len(out)
    got = torch.tensor(lp.token)
    assert torch.allclose(got, want.gather(1, torch.tensor(out).unsqueeze(1))[:, 0], atol=1e-4)
    values, ids = want.topk(top, dim=-1)
    assert all(len(row) == top for row in lp.top_ids)
    assert torch.allclose(torch.tensor(lp.top).reshape(len(out), top), values, atol=1e-4)
    for row, (i, v) in enumerate(zip(lp.top_ids, ids.tolist())):  # ids agree but where two values tie
        gaps = (values[row, 1:] - values[row, :-1]).abs()
        if top < 2 or bool(gaps.min() > 1e-4):
            assert i == v, row


def run(draft, target, sampling: SamplingSpec, top: int, n: int = 32):
    d_rpc, t_rpc = EngineRpc(DraftEngine(draft, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    emitted: list = []
    req = GenerateRequest(session_id="s", prompt_token_ids=PROMPT, max_new_tokens=n, tree=SPEC, sampling=sampling,
                          logprobs=top, specpv=SpecPVSpec(threshold=0))  # asked for: off with logprobs
    done = asyncio.run(SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=SPEC), emitted.append).run())
    verifies = [m for m in t_rpc.requests if isinstance(m, VerifyRequest)]
    assert verifies and all(v.logprobs == top and v.specpv is None for v in verifies)
    return done, [m for m in emitted if isinstance(m, TokenChunk)]


@pytest.mark.parametrize("sampling", [SamplingSpec(), SamplingSpec(temperature=0.9, top_p=0.9, seed=7)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("which", ["often", "rarely"])
def test_each_output_tokens_logprob_is_the_targets_at_its_position(models, sampling, which):
    target, often, rarely = models["qwen2"]
    done, chunks = run(often if which == "often" else rarely, target, sampling, top=3)
    assert isinstance(done, GenerateDone)
    out = done.token_ids
    assert [t for c in chunks for t in c.token_ids] == out
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)  # each chunk's, of its tokens
    streamed = Logprobs.join([c.logprobs for c in chunks])
    assert_matches(streamed, reference(target, PROMPT, out), out, 3)
    if sampling.greedy:  # the chosen token is the most likely one
        assert [row[0] for row in streamed.top_ids] == out


def test_zero_alternatives_and_no_logprobs(models):
    target, often, _ = models["qwen2"]
    done, chunks = run(often, target, SamplingSpec(), top=0, n=12)
    streamed = Logprobs.join([c.logprobs for c in chunks])
    assert all(row == [] for row in streamed.top_ids) and len(streamed) == len(done.token_ids)
    d_rpc, t_rpc = EngineRpc(DraftEngine(often, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    emitted: list = []
    req = GenerateRequest(session_id="s", prompt_token_ids=PROMPT, max_new_tokens=8, tree=SPEC)
    done = asyncio.run(SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=SPEC), emitted.append).run())
    assert all(m.logprobs is None for m in emitted if isinstance(m, TokenChunk))
    assert all(getattr(m, "logprobs", None) is None for m in t_rpc.requests)


def test_batched_verification_reports_what_one_session_at_a_time_does(models):
    """The same rounds verified one request at a time and as one batch (``verify_batch``):
    equal log-probabilities, which are the target's at each committed token."""
    target, _, _ = models["qwen2"]
    single, batched = TargetEngine(target, LIMITS), TargetEngine(target, LIMITS)
    g = torch.Generator().manual_seed(3)
    reqs = []
    for k in range(4):
        prompt = torch.randint(1, 120, (5 + k,), generator=g).tolist()
        greedy = greedy_reference(target, prompt, 2)[0]  # a branch the target accepts (greedy)
        tokens = [prompt[-1], *greedy, *torch.randint(1, 120, (4,), generator=g).tolist()]
        tree = FlatTree(token_ids=tokens, parents=[-1, 0, 1, 0, 3, 1, 2])
        sampling = SamplingSpec() if k % 2 == 0 else SamplingSpec(temperature=1.0, seed=k)
        reqs.append(VerifyRequest(session_id=f"b{k}", round=0, sync=CacheSync(base_len=0, append_token_ids=prompt[:-1]),
                                  tree=tree, sampling=sampling, logprobs=2))
    one = [single.handle(r) for r in reqs]
    many = batched.verify_batch(reqs)
    for r, a, b in zip(reqs, one, many):
        assert isinstance(a, VerifyReply) and isinstance(b, VerifyReply), (a, b)
        assert a.accepted_token_ids == b.accepted_token_ids and a.bonus_token_id == b.bonus_token_id
        committed = [*a.accepted_token_ids, a.bonus_token_id]
        prompt = [*r.sync.append_token_ids, r.tree.token_ids[0]]
        want = reference(target, prompt, committed)
        assert_matches(a.logprobs, want, committed, 2)
        assert_matches(b.logprobs, want, committed, 2)


def test_impossible_or_misaligned_logprobs_are_refused():
    lp = Logprobs(token=[-0.1], top_ids=[[4]], top=[[-0.1]])
    with pytest.raises(ValidationError):  # one token reported for two committed
        VerifyReply(session_id="s", round=0, accepted_token_ids=[5], bonus_token_id=3, cache_len=4, logprobs=lp)
    with pytest.raises(ValidationError):  # logprobs are verified against the full cache
        VerifyRequest(session_id="s", round=0, sync=CacheSync(base_len=0, append_token_ids=[]),
                      tree=FlatTree(token_ids=[1], parents=[-1]), logprobs=1, specpv=SpecPVSpec())
    for bad in ({"token": [0.5], "top_ids": [[]], "top": [[]]},  # a probability above 1
                {"token": [-1.0], "top_ids": [[1, 2]], "top": [[-1.0]]},  # rows of different lengths
                {"token": [-1.0, -2.0], "top_ids": [[]], "top": [[]]},  # lists of different lengths
                {"token": [-1.0], "top_ids": [list(range(21))], "top": [[-1.0] * 21]}):  # over 20
        with pytest.raises(ValidationError):
            Logprobs(**bad)
    with pytest.raises(ValidationError):
        GenerateRequest(session_id="s", prompt_token_ids=[1], logprobs=21)
