"""Presence, frequency and repetition penalties on the target (``specsplit.engine.penalties``):
speculative output through the session actor and real engines equals plain greedy decoding
with the same penalties (the oracle: full re-forwards, the penalties applied here to the whole
vocabulary row by row), one session at a time and batched; a session the target lost is
rebuilt from the resend; sampling with penalties is reproducible; out-of-range values are
refused."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch
from pydantic import ValidationError

from schemas import CacheSync, ErrorReply, FlatTree, GenerateRequest, SamplingSpec, TreeSpec, VerifyReply, VerifyRequest
from specsplit.engine.base import EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.orchestrator.actor import ActorPolicy, SessionActor
from tests.conftest import greedy_reference
from tests.test_actor import EngineRpc

LIMITS = EngineLimits(max_sessions=8, max_session_tokens=512, max_tree_nodes=64, max_tree_depth=16)
SPEC = TreeSpec(max_nodes=8, max_depth=4, branch=2)
PROMPT = [3, 14, 15, 92, 65, 35, 14, 3]
SETTINGS = [{"presence_penalty": 1.5}, {"frequency_penalty": 0.8}, {"repetition_penalty": 1.6},
            {"presence_penalty": 0.4, "frequency_penalty": -0.3, "repetition_penalty": 1.3}]


def penalized_greedy(model, prompt: list[int], n: int, presence=None, frequency=None, repetition=None,
                     bias: dict[int, float] | None = None) -> list[int]:
    """Plain greedy decoding with a logit bias, then vLLM's penalties, one full forward a token:
    the oracle."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([ids])).logits[0, -1].float().clone()
        for t, b in (bias or {}).items():
            row[t] += b
        if repetition not in (None, 1.0):
            for t in set(prompt) | set(out):
                row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        for t, c in Counter(out).items():
            row[t] -= (frequency or 0.0) * c + (presence or 0.0)
        t = int(row.argmax())
        out.append(t)
        ids.append(t)
    return out


def run(draft, target, sampling: SamplingSpec, n: int):
    d_rpc, t_rpc = EngineRpc(DraftEngine(draft, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    req = GenerateRequest(session_id="s", prompt_token_ids=PROMPT, max_new_tokens=n, tree=SPEC, sampling=sampling)
    done = asyncio.run(SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=SPEC), lambda _: None).run())
    verifies = [m for m in t_rpc.requests if isinstance(m, VerifyRequest)]
    if sampling.penalized:  # the output's start, named in every sync
        assert all(v.sync.prompt_len == len(PROMPT) and v.specpv is None for v in verifies)
    return done


@pytest.mark.parametrize("which", ["often", "rarely"])
@pytest.mark.parametrize("penalties", SETTINGS, ids=lambda p: ",".join(f"{k[:4]}={v}" for k, v in p.items()))
def test_speculative_output_equals_greedy_decoding_with_the_penalties(models, which, penalties):
    target, often, rarely = models["qwen2"]
    want = penalized_greedy(target, PROMPT, 40, **{k.split("_")[0]: v for k, v in penalties.items()})
    assert want != greedy_reference(target, PROMPT, 40)[0]  # the penalties change the answer
    done = run(often if which == "often" else rarely, target, SamplingSpec(**penalties), 40)
    assert done.token_ids == want


@pytest.mark.parametrize("which", ["often", "rarely"])
def test_a_logit_bias_gives_greedy_decoding_with_it(models, which):
    """A bias that bans the target's favourite tokens and favours another (alone and with
    penalties): speculative output is the oracle's."""
    from schemas import TokenBias

    target, often, rarely = models["qwen2"]
    plain = greedy_reference(target, PROMPT, 30)[0]
    bias = {plain[0]: -100.0, plain[1]: -5.0, 7: 3.0}
    for penalties in ({}, {"frequency_penalty": 0.5}):
        want = penalized_greedy(target, PROMPT, 30, None, penalties.get("frequency_penalty"), None, bias)
        assert want != plain and plain[0] not in want
        s = SamplingSpec(logit_bias=[TokenBias(token_id=t, bias=b) for t, b in bias.items()], **penalties)
        assert run(often if which == "often" else rarely, target, s, 30).token_ids == want


def test_a_bias_outside_the_vocabulary_is_refused_and_changes_nothing(models):
    from schemas import TokenBias

    target, _, _ = models["qwen2"]
    eng = TargetEngine(target, LIMITS)
    req = VerifyRequest(session_id="v", round=0, tree=FlatTree(token_ids=[PROMPT[-1]], parents=[-1]),
                        sync=CacheSync(base_len=0, append_token_ids=PROMPT[:-1]),
                        sampling=SamplingSpec(logit_bias=[TokenBias(token_id=128, bias=1.0)]))
    reply = eng.handle(req)
    assert isinstance(reply, ErrorReply) and reply.code.value == "BAD_REQUEST" and eng.store.get("v") is None


def test_batched_verification_applies_each_sessions_penalties(models):
    """Rounds of four sessions with different penalties, verified one at a time and as a batch:
    the same verdicts (the batch's greedy argmax is of unpenalized rows: it must not be used)."""
    target, _, _ = models["qwen2"]
    single, batched = TargetEngine(target, LIMITS), TargetEngine(target, LIMITS)
    reqs = []
    from schemas import TokenBias

    for k, penalties in enumerate([*SETTINGS, {"logit_bias": "ban the branch"}]):
        prompt = PROMPT[k:] + PROMPT[:k]
        own = greedy_reference(target, prompt, 12)[0]  # the unpenalized answer: its output so far, then a branch
        if "logit_bias" in penalties:
            penalties = {"logit_bias": [TokenBias(token_id=own[9], bias=-100.0)]}
        context = prompt + own[:9]
        tree = FlatTree(token_ids=[context[-1], *own[9:12], 5, 9], parents=[-1, 0, 1, 2, 0, 1])
        reqs.append(VerifyRequest(session_id=f"b{k}", round=0, tree=tree, sampling=SamplingSpec(**penalties),
                                  sync=CacheSync(base_len=0, append_token_ids=context[:-1], prompt_len=len(prompt))))
    one = [single.handle(r) for r in reqs]
    many = batched.verify_batch(reqs)
    plain = TargetEngine(target, LIMITS).verify_batch([r.model_copy(update={"sampling": SamplingSpec()}) for r in reqs])
    for a, b in zip(one, many):
        assert isinstance(a, VerifyReply) and isinstance(b, VerifyReply), (a, b)
        assert (a.accepted_token_ids, a.bonus_token_id) == (b.accepted_token_ids, b.bonus_token_id)
    verdicts = [(r.accepted_token_ids, r.bonus_token_id) for r in one]
    assert any((a.accepted_token_ids, a.bonus_token_id) != (p.accepted_token_ids, p.bonus_token_id)
               for a, p in zip(one, plain)), verdicts  # the penalties changed some verdict
    assert one[-1].bonus_token_id != plain[-1].bonus_token_id  # the banned token is not chosen


def test_each_nodes_row_is_penalized_after_its_own_path(models):
    """A tree whose paths repeat tokens of the output and of each other: every node's row is the
    oracle's penalized row for the output so far plus that node's path (random logits)."""
    from specsplit.engine import penalties
    from specsplit.tree import path_to, validate_tree

    target, _, _ = models["qwen2"]
    prompt_len, context = 4, [7, 3, 7, 9, 5, 3, 5]  # output so far: 9, 5, 3 (and the root, 5)
    tree = FlatTree(token_ids=[5, 3, 3, 9, 7, 5, 11], parents=[-1, 0, 1, 2, 0, 4, 5])
    layout = validate_tree(tree, vocab_size=128, max_nodes=16, max_depth=8)
    s = SamplingSpec(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.5)
    req = VerifyRequest(session_id="p", round=0, tree=tree, sampling=s,
                        sync=CacheSync(base_len=0, append_token_ids=context[:-1], prompt_len=prompt_len))
    eng = TargetEngine(target, LIMITS)
    session = eng.open_session("p", 0, req.sync, layout.num_nodes)
    logits = torch.randn(len(tree.token_ids), 128) * 4
    rows = penalties.penalize(session, req, layout, logits)
    for i in range(len(tree.token_ids)):
        out = context[prompt_len:] + [tree.token_ids[j] for j in path_to(i, layout.parents)[1:]]
        want = logits[i].clone()
        for t in set(context[:prompt_len]) | set(out):
            want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
        for t, c in Counter(out).items():
            want[t] -= 0.9 * c + 0.7
        assert torch.allclose(rows[i], want, atol=1e-5), i


def test_a_session_its_target_lost_is_rebuilt_from_the_resend(models):
    """One-token rounds; after three, the target drops the session (a CACHE_MISS, then the
    resend from an empty cache); after six, only the penalties' state is lost (rebuilt from the
    tokens the cache holds). The output is the oracle's to the end."""
    target, _, _ = models["qwen2"]
    sampling = SamplingSpec(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2)
    want = penalized_greedy(target, PROMPT, 12, 1.0, 0.5, 1.2)
    eng = TargetEngine(target, LIMITS)
    committed, cached, out = list(PROMPT), 0, []
    for rnd in range(len(want)):
        if rnd == 3:
            eng.store.end_session("r")
        if rnd == 6:
            eng.store.get("r").penalties = None
        req = VerifyRequest(session_id="r", round=rnd, sampling=sampling, tree=FlatTree(token_ids=[committed[-1]],
                            parents=[-1]), sync=CacheSync(base_len=cached, append_token_ids=committed[cached:-1],
                                                          prompt_len=len(PROMPT)))
        reply = eng.handle(req)
        if isinstance(reply, ErrorReply):
            assert reply.code.value == "CACHE_MISS" and rnd == 3, reply
            reply = eng.handle(req.model_copy(update={"sync": CacheSync(base_len=0, append_token_ids=committed[:-1],
                                                                        prompt_len=len(PROMPT))}))
        assert isinstance(reply, VerifyReply), reply
        cached = reply.cache_len
        committed.append(reply.bonus_token_id)
        out.append(reply.bonus_token_id)
    assert out == want


def test_sampling_with_penalties_is_reproducible(models):
    target, often, _ = models["qwen2"]
    s = SamplingSpec(temperature=0.9, seed=5, presence_penalty=1.0, repetition_penalty=1.2)
    a, b = run(often, target, s, 24), run(often, target, s, 24)
    assert a.token_ids == b.token_ids and a.token_ids != run(often, target, SamplingSpec(temperature=0.9, seed=5),
                                                             24).token_ids


def test_out_of_range_penalties_and_impossible_requests_are_refused():
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0},
                {"repetition_penalty": 11.0}):
        with pytest.raises(ValidationError):
            SamplingSpec(**bad)
    from schemas import SpecPVSpec

    with pytest.raises(ValidationError):  # penalties are verified against the full cache
        VerifyRequest(session_id="s", round=0, sync=CacheSync(base_len=0, append_token_ids=[], prompt_len=1),
                      tree=FlatTree(token_ids=[1], parents=[-1]), sampling=SamplingSpec(presence_penalty=1.0),
                      specpv=SpecPVSpec())
    assert not SamplingSpec(repetition_penalty=1.0).penalized and SamplingSpec(frequency_penalty=-0.1).penalized
