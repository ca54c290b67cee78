"""The prompt's log-probabilities (``prompt_logprobs``: what ``echo`` with ``logprobs`` returns on
the completions API, and lm-eval's loglikelihood tasks read): each prompt token's after the first
is the target's log-softmax at its position, with its most likely tokens there (the oracle: one
full forward of the prompt, fp32 tiny models). They come from the forwards that prefill the
prompt (kept rows only: the output stays the same), in one chunk or many, past a prefix cache,
alone or beside a batch; impossible requests are refused."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import ValidationError

from schemas import (
    CacheSync,
    FlatTree,
    GenerateDone,
    GenerateRequest,
    Logprobs,
    SamplingSpec,
    SpecPVSpec,
    TokenChunk,
    TreeSpec,
    VerifyReply,
    VerifyRequest,
)
from schemas.base import MAX_PROMPT_LOGPROB_ENTRIES
from specsplit.engine.base import EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.engine.verify import PromptRows
from specsplit.orchestrator.actor import ActorPolicy, SessionActor
from tests.conftest import greedy_reference
from tests.test_actor import EngineRpc
from tests.test_logprobs import assert_matches, reference

LIMITS = EngineLimits(max_sessions=8, max_session_tokens=512, max_tree_nodes=64, max_tree_depth=16)
SPEC = TreeSpec(max_nodes=8, max_depth=4, branch=2)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(1, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(draft, target, prompt: list[int], top: int | None, *, n: int = 16, chunk: int | None = None,
        limits: EngineLimits = LIMITS, engine: TargetEngine | None = None, sampling: SamplingSpec = SamplingSpec()):
    t_eng = engine or TargetEngine(target, limits)
    if chunk is not None:
        t_eng.linear_chunk = chunk
    d_rpc, t_rpc = EngineRpc(DraftEngine(draft, LIMITS)), EngineRpc(t_eng)
    emitted: list = []
    req = GenerateRequest(session_id=f"s{len(prompt)}-{top}", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC,
                          prompt_logprobs=top, specpv=SpecPVSpec(threshold=0), sampling=sampling)
    done = asyncio.run(SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=SPEC), emitted.append).run())
    assert isinstance(done, GenerateDone), done
    chunks = [m for m in emitted if isinstance(m, TokenChunk)]
    verifies = [m for m in t_rpc.requests if isinstance(m, VerifyRequest)]
    return done, chunks, verifies


@pytest.mark.parametrize("length,chunk", [(6, None), (2, None), (37, 8), (37, 36)],
                         ids=["short", "two-tokens", "many-chunks", "chunk-and-tree"])
def test_each_prompt_tokens_logprob_is_the_targets_at_its_position(models, length, chunk):
    """Short prompts go with the first tree in one forward; longer ones (over ``linear_chunk``)
    are prefilled in chunks first: the rows of every forward are kept, in order."""
    target, often, _ = models["qwen2"]
    prompt = prompt_of(length, seed=length)
    done, chunks, verifies = run(often, target, prompt, 3, chunk=chunk)
    first = chunks[0].prompt_logprobs
    assert first is not None and all(c.prompt_logprobs is None for c in chunks[1:])  # once, on the first chunk
    assert_matches(first, reference(target, prompt[:1], prompt[1:]), prompt[1:], 3)
    # asked once (the first request, from an empty cache), and on the full cache
    assert [v.prompt_logprobs for v in verifies] == [3] + [None] * (len(verifies) - 1)
    assert all(v.specpv is None for v in verifies)
    # the output is unchanged: plain greedy decoding, as without them
    assert done.token_ids == greedy_reference(target, prompt, len(done.token_ids))[0]
    plain, _, _ = run(often, target, prompt, None, chunk=chunk)
    assert plain.token_ids == done.token_ids


def test_a_one_token_prompt_has_none_and_asks_for_none(models):
    target, often, _ = models["qwen2"]
    _, chunks, verifies = run(often, target, [17], 2, n=4)
    assert len(chunks[0].prompt_logprobs) == 0
    assert all(v.prompt_logprobs is None for v in verifies)


def test_zero_alternatives_and_sampling(models):
    target, _, rarely = models["qwen2"]
    prompt = prompt_of(9, seed=4)
    _, chunks, _ = run(rarely, target, prompt, 0, sampling=SamplingSpec(temperature=0.8, seed=5))
    rows = chunks[0].prompt_logprobs
    assert rows.top_ids == [[]] * 8 and rows.top == [[]] * 8
    want = reference(target, prompt[:1], prompt[1:])  # of the raw logits, whatever the sampling
    assert torch.allclose(torch.tensor(rows.token), want.gather(1, torch.tensor(prompt[1:]).unsqueeze(1))[:, 0],
                          atol=1e-4)


def test_a_prefix_cache_does_not_hide_the_prompts_rows(models):
    """A prompt the prefix cache holds is forwarded whole when its rows are asked for (none of
    it is copied), and the session after it still reuses the cache."""
    target, often, _ = models["qwen2"]
    limits = EngineLimits(max_sessions=8, max_session_tokens=512, max_tree_nodes=64, max_tree_depth=16,
                          cache_chunk=4, prefix_cache_gb=0.01)
    engine = TargetEngine(target, limits)
    prompt = prompt_of(24, seed=9)
    first, _, _ = run(often, target, prompt, None, engine=engine)
    reused = engine.prefix_cache.reused_tokens
    again, chunks, _ = run(often, target, prompt, 2, engine=engine)
    assert again.cached_tokens == 0 and engine.prefix_cache.reused_tokens == reused
    assert_matches(chunks[0].prompt_logprobs, reference(target, prompt[:1], prompt[1:]), prompt[1:], 2)
    assert again.token_ids == first.token_ids
    third, _, _ = run(often, target, prompt, None, engine=engine)
    assert third.cached_tokens > 0 and third.token_ids == first.token_ids


def test_a_batch_serves_the_scored_request_alone_and_the_rest_together(models):
    target, _, _ = models["qwen2"]
    engine = TargetEngine(target, LIMITS)
    reqs = []
    for k in range(3):
        prompt = prompt_of(6 + k, seed=20 + k)
        tree = FlatTree(token_ids=[prompt[-1], *greedy_reference(target, prompt, 2)[0]], parents=[-1, 0, 1])
        reqs.append(VerifyRequest(session_id=f"b{k}", round=0, tree=tree, prompt_logprobs=1 if k == 1 else None,
                                  sync=CacheSync(base_len=0, append_token_ids=prompt[:-1], prompt_len=len(prompt))))
    replies = engine.verify_batch(reqs)
    for r, rep in zip(reqs, replies):
        assert isinstance(rep, VerifyReply), rep
        assert len(rep.accepted_token_ids) == 2  # the target's own greedy tokens
        prompt = [*r.sync.append_token_ids, r.tree.token_ids[0]]
        if r.prompt_logprobs is None:
            assert rep.prompt_logprobs is None and rep.batch_size == 2
        else:
            assert rep.batch_size == 1
            assert_matches(rep.prompt_logprobs, reference(target, prompt[:1], prompt[1:]), prompt[1:], 1)


def test_rows_are_gathered_in_slices_over_forwards():
    """PromptRows over forwards of uneven sizes, with log-softmax slices smaller than a forward:
    every row once, in order, up to the prompt's count (the root's rows after it are not)."""
    torch.manual_seed(0)
    logits = torch.randn(11, 30)
    following = torch.randint(0, 30, (11,)).tolist()
    rows = PromptRows(2, following, 9)
    rows.SLICE = 3
    for part in (logits[:4], logits[4:5], logits[5:11]):
        rows.take(part)
    got = rows.result()
    want = torch.log_softmax(logits[:9], -1)
    assert_matches(got, want, following[:9], 2)
    short = PromptRows(0, following, 9)
    short.take(logits[:5])
    with pytest.raises(RuntimeError):
        short.result()


def test_impossible_prompt_logprobs_are_refused():
    tree = FlatTree(token_ids=[5], parents=[-1])
    ok = CacheSync(base_len=0, append_token_ids=[1, 2, 3], prompt_len=4)
    VerifyRequest(session_id="s", round=0, sync=ok, tree=tree, prompt_logprobs=2)
    bad = [
        {"sync": CacheSync(base_len=2, append_token_ids=[3], prompt_len=4)},  # the prompt is cached: no rows
        {"sync": CacheSync(base_len=0, append_token_ids=[1, 2, 3])},  # the prompt is not named
        {"sync": ok, "specpv": SpecPVSpec()},  # on the full cache only
        {"sync": ok, "prompt_logprobs": 21},
    ]
    for kw in bad:
        with pytest.raises(ValidationError):
            VerifyRequest(session_id="s", round=0, tree=tree, **{"prompt_logprobs": 2, **kw})
    long = list(range(1, 20_001))
    top = MAX_PROMPT_LOGPROB_ENTRIES // len(long)  # 12 alternatives fit, 13 would not
    GenerateRequest(session_id="g", prompt_token_ids=long, prompt_logprobs=top - 1)
    with pytest.raises(ValidationError):
        GenerateRequest(session_id="g", prompt_token_ids=long, prompt_logprobs=top)
    # a resumed generation's prompt ends where its output began
    GenerateRequest(session_id="g", prompt_token_ids=long, prompt_logprobs=top, output_from=10_000)
    with pytest.raises(ValidationError):
        Logprobs(token=[-1.0], top_ids=[[1]], top=[[0.5]])


def test_a_round_left_one_token_to_make_asks_the_draft_nothing(models):
    """lm-eval's requests (``max_tokens`` 1) and the last round of any answer left one token: the
    tree can hold its root only, so the round is plain: no DraftRequest (before, the draft
    prefilled the whole prompt to propose nothing)."""
    from schemas import DraftRequest

    target, often, _ = models["qwen2"]
    d_rpc, t_rpc = EngineRpc(DraftEngine(often, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    prompt = prompt_of(12, seed=3)
    for n in (1, 5):
        req = GenerateRequest(session_id=f"one-{n}", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC,
                              prompt_logprobs=1)
        done = asyncio.run(SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=SPEC), lambda m: None).run())
        assert done.token_ids == greedy_reference(target, prompt, n)[0]
    drafts = [m for m in d_rpc.requests if isinstance(m, DraftRequest)]
    assert not any(m.session_id == "one-1" for m in drafts)  # one token: no draft call at all
    assert all(m.tree.max_depth >= 1 for m in drafts) and any(m.session_id == "one-5" for m in drafts)
