"""``min_tokens`` (vLLM's): no stop token among an answer's first ``min_tokens`` tokens. Through
the session actor and real engines the answer equals plain greedy decoding with the stop tokens
masked at those positions (the oracle: full re-forwards), whatever the draft proposes; the
rounds before ``min_tokens`` mask them and reach no further; a resumed generation keeps the
rest of its minimum; bad values are refused."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import ValidationError

from schemas import GenerateRequest, GrammarSpec, SamplingSpec, TreeSpec, VerifyRequest
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.orchestrator.actor import ActorPolicy, SessionActor
from specsplit.tree import depths_of
from tests.conftest import greedy_reference
from tests.test_actor import EngineRpc
from tests.test_penalties import LIMITS, PROMPT

SPEC = TreeSpec(max_nodes=8, max_depth=4, branch=2)


@torch.no_grad()
def masked_greedy(model, prompt: list[int], n: int, stop: set[int], min_tokens: int) -> list[int]:
    """Plain greedy decoding that never chooses a stop token before ``min_tokens`` tokens and
    ends at the first one after (included): the oracle."""
    ids, out = list(prompt), []
    for _ in range(n):
        row = model(torch.tensor([ids])).logits[0, -1].float()
        if len(out) < min_tokens:
            row[list(stop)] = float("-inf")
        t = int(row.argmax())
        out.append(t)
        ids.append(t)
        if t in stop:
            break
    return out


def run(draft, target, *, stop: list[int], min_tokens: int, n: int, sampling=SamplingSpec()):
    d_rpc, t_rpc = EngineRpc(DraftEngine(draft, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    req = GenerateRequest(session_id="m", prompt_token_ids=PROMPT, max_new_tokens=n, tree=SPEC, sampling=sampling,
                          stop_token_ids=stop, min_tokens=min_tokens)
    done = asyncio.run(SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=SPEC), lambda _: None).run())
    return done, [m for m in t_rpc.requests if isinstance(m, VerifyRequest)]


@pytest.mark.parametrize("which", ["often", "rarely"])
def test_no_stop_token_before_min_tokens_and_greedy_decoding_otherwise(models, which):
    target, often, rarely = models["qwen2"]
    plain = greedy_reference(target, PROMPT, 40)[0]
    stop = [plain[2], plain[5]]  # the answer would end at its third token
    assert masked_greedy(target, PROMPT, 40, set(stop), 0) == plain[:3]
    for m in (4, 11, 40):
        want = masked_greedy(target, PROMPT, 40, set(stop), m)
        assert len(want) >= m and not set(want[:m]) & set(stop)
        done, verifies = run(often if which == "often" else rarely, target, stop=stop, min_tokens=m, n=40)
        assert done.token_ids == want, m
        for v in verifies:  # rounds within the minimum mask the stop tokens and reach no further
            produced = v.sync.base_len + len(v.sync.append_token_ids) + 1 - len(PROMPT)
            if produced < m:
                depth = max(depths_of(v.tree.parents))
                assert set(v.sampling.masked_token_ids or ()) == set(stop) and produced + depth + 1 <= m
            else:
                assert not v.sampling.masked_token_ids
        assert any(v.sampling.masked_token_ids for v in verifies)
        assert done.finish_reason == ("stop" if want[-1] in stop else "length")


def test_sampling_keeps_the_stop_tokens_out_of_the_minimum(models):
    target, often, _ = models["qwen2"]
    plain = greedy_reference(target, PROMPT, 12)[0]
    stop = sorted(set(plain[:6]))  # tokens the model likes: masked, they cannot come first
    for seed in range(3):
        done, _ = run(often, target, stop=stop, min_tokens=12, n=12, sampling=SamplingSpec(temperature=1.0, seed=seed))
        assert len(done.token_ids) == 12 and not set(done.token_ids) & set(stop)


def test_min_tokens_is_refused_past_max_new_tokens_or_with_a_grammar():
    with pytest.raises(ValidationError):
        GenerateRequest(session_id="x", prompt_token_ids=[1], max_new_tokens=4, min_tokens=5)
    with pytest.raises(ValidationError):
        GenerateRequest(session_id="x", prompt_token_ids=[1], min_tokens=-1)
    with pytest.raises(ValidationError):
        SamplingSpec(masked_token_ids=list(range(129)))
    with pytest.raises(ValidationError):
        GenerateRequest(session_id="x", prompt_token_ids=[1], min_tokens=2,
                        grammar=GrammarSpec(kind="json_schema", text="{}"))
