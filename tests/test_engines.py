"""Typed errors from the engines, and that an error changes nothing in the session's cache."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    Ack, CacheSync, DraftReply, DraftRequest, EndSession, ErrorCode, ErrorReply, FlatTree, SamplingSpec,
    TreeSpec, VerifyReply, VerifyRequest,
)
from specsplit.engine.draft import DraftEngine
from specsplit.engine.base import EngineLimits
from specsplit.engine.target import TargetEngine
from specsplit.tree import TreeError, check_parents
from tests.conftest import tiny_model

LIMITS = EngineLimits(max_sessions=4, max_session_tokens=128, max_tree_nodes=16, max_tree_depth=6)


@pytest.fixture(scope="module")
def engines():
    model = tiny_model("qwen2", seed=4)
    return DraftEngine(model, LIMITS), TargetEngine(model, LIMITS)


def snapshot(engine, sid):
    s = engine.store.get(sid)
    return s.kv.length, s.last_round, [layer.keys.clone() for layer in s.kv.layers]


def assert_same(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    for x, y in zip(a[2], b[2]):
        assert torch.equal(x, y)


def start(engine_t, sid="s1"):
    prompt = [5, 6, 7, 8, 9]
    r = engine_t.handle(VerifyRequest(session_id=sid, round=0, sync=CacheSync(base_len=0, append_token_ids=prompt[:-1]),
                                      tree=FlatTree(token_ids=[prompt[-1], 3], parents=[-1, 0])))
    assert isinstance(r, VerifyReply)
    return r


def test_target_errors_change_nothing(engines):
    _, tgt = engines
    r = start(tgt)
    before = snapshot(tgt, "s1")
    bad = [
        (ErrorCode.CACHE_MISS, VerifyRequest(session_id="s1", round=1, sync=CacheSync(base_len=r.cache_len + 1),
                                             tree=FlatTree(token_ids=[1], parents=[-1]))),
        (ErrorCode.CACHE_MISS, VerifyRequest(session_id="nope", round=1, sync=CacheSync(base_len=3),
                                             tree=FlatTree(token_ids=[1], parents=[-1]))),
        (ErrorCode.BAD_REQUEST, VerifyRequest(session_id="s1", round=1, sync=CacheSync(base_len=r.cache_len),
                                              tree=FlatTree(token_ids=[1, 10_000], parents=[-1, 0]))),
        (ErrorCode.BAD_REQUEST, VerifyRequest(session_id="s1", round=1, sync=CacheSync(base_len=r.cache_len, append_token_ids=[999]),
                                              tree=FlatTree(token_ids=[1], parents=[-1]))),
        (ErrorCode.BAD_REQUEST, VerifyRequest(session_id="s1", round=1, sync=CacheSync(base_len=r.cache_len),
                                              tree=FlatTree(token_ids=[1, 2, 3], parents=[-1, 2, 0]))),
        (ErrorCode.BAD_REQUEST, VerifyRequest(session_id="s1", round=1, sync=CacheSync(base_len=r.cache_len),
                                              tree=FlatTree(token_ids=[1] * 17, parents=[-1] + list(range(16))))),
        (ErrorCode.BAD_REQUEST, VerifyRequest(session_id="s1", round=1, sync=CacheSync(base_len=r.cache_len, append_token_ids=[1] * 120),
                                              tree=FlatTree(token_ids=[1] * 9, parents=[-1] * 1 + [0] * 8))),
        # the infill sampler on a target without its tokenizer's tables (no worker set them)
        (ErrorCode.BAD_REQUEST, VerifyRequest(session_id="s1", round=1, sync=CacheSync(base_len=r.cache_len),
                                              tree=FlatTree(token_ids=[1], parents=[-1]),
                                              sampling=SamplingSpec(temperature=1.0, top_k=8, infill=True))),
    ]
    for code, req in bad:
        reply = tgt.handle(req)
        assert isinstance(reply, ErrorReply) and reply.code == code, (code, reply)
        assert_same(before, snapshot(tgt, "s1"))
    assert "nope" not in tgt.store


def test_stale_round_and_idempotent_retry(engines):
    _, tgt = engines
    r0 = start(tgt, "s2")
    req = VerifyRequest(session_id="s2", round=3, sync=CacheSync(base_len=r0.cache_len), tree=FlatTree(token_ids=[4, 1], parents=[-1, 0]))
    a = tgt.handle(req)
    b = tgt.handle(req)  # a retry of the same round gives the same answer
    assert isinstance(a, VerifyReply) and a.model_dump(exclude={"verify_ms"}) == b.model_dump(exclude={"verify_ms"})
    before = snapshot(tgt, "s2")
    stale = tgt.handle(VerifyRequest(session_id="s2", round=2, sync=CacheSync(base_len=a.cache_len), tree=FlatTree(token_ids=[1], parents=[-1])))
    assert isinstance(stale, ErrorReply) and stale.code == ErrorCode.STALE_ROUND and not stale.retryable
    assert_same(before, snapshot(tgt, "s2"))
    # refusals disclose nothing of the session: not its round, not how many tokens it holds
    assert "3" not in stale.message.replace("round 2", ""), stale.message
    miss = tgt.handle(VerifyRequest(session_id="s2", round=4, sync=CacheSync(base_len=a.cache_len + 57),
                                    tree=FlatTree(token_ids=[1], parents=[-1])))
    assert isinstance(miss, ErrorReply) and miss.code == ErrorCode.CACHE_MISS
    assert str(a.cache_len) not in miss.message.replace(str(a.cache_len + 57), ""), miss.message
    assert_same(before, snapshot(tgt, "s2"))


def test_draft_errors_and_end_session(engines):
    dft, _ = engines
    ok = dft.handle(DraftRequest(session_id="d1", round=0, sync=CacheSync(base_len=0, append_token_ids=[1, 2, 3]), root=4,
                                 tree=TreeSpec(max_nodes=8, max_depth=3, branch=2)))
    assert isinstance(ok, DraftReply) and 1 < ok.tree.num_nodes <= 8
    check_parents(ok.tree.parents, max_nodes=8, max_depth=3)
    before = snapshot(dft, "d1")
    for req in (
        DraftRequest(session_id="d1", round=1, sync=CacheSync(base_len=4), root=100_000),
        DraftRequest(session_id="d1", round=1, sync=CacheSync(base_len=9), root=1),
        DraftRequest(session_id="d1", round=1, sync=CacheSync(base_len=4, append_token_ids=[1] * 200), root=1),
    ):
        reply = dft.handle(req)
        assert isinstance(reply, ErrorReply) and reply.code in (ErrorCode.BAD_REQUEST, ErrorCode.CACHE_MISS), reply
        assert_same(before, snapshot(dft, "d1"))
    assert dft.handle(EndSession(session_id="d1")) == Ack(session_id="d1", existed=True)
    assert dft.handle(EndSession(session_id="d1")) == Ack(session_id="d1", existed=False)
    wrong = dft.handle(VerifyRequest(session_id="x", round=0, sync=CacheSync(base_len=0), tree=FlatTree(token_ids=[1], parents=[-1])))
    assert isinstance(wrong, ErrorReply) and wrong.code == ErrorCode.BAD_REQUEST


def test_draft_tree_is_deterministic_and_within_budget(engines):
    dft, _ = engines
    rng = random.Random(0)
    for i in range(10):
        spec = TreeSpec(max_nodes=rng.randrange(1, 17), max_depth=rng.randrange(0, 7), branch=rng.randrange(1, 5))
        ctx = [rng.randrange(128) for _ in range(rng.randrange(0, 12))]
        trees = [dft.handle(DraftRequest(session_id=f"t{i}{k}", round=0, sync=CacheSync(base_len=0, append_token_ids=ctx),
                                         root=7, tree=spec)).tree for k in range(2)]
        assert trees[0] == trees[1]
        layout = check_parents(trees[0].parents, max_nodes=spec.max_nodes, max_depth=max(spec.max_depth, 0) or 0)
        if spec.branch == 1:  # a chain
            assert trees[0].parents == list(range(-1, trees[0].num_nodes - 1))
        assert layout.num_nodes <= spec.max_nodes


@st.composite
def invalid_parents(draw):
    n = draw(st.integers(1, 20))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    kind = draw(st.sampled_from(["root", "forward", "negative", "self"]))
    i = draw(st.integers(0, n - 1))
    if kind == "root" or i == 0:
        parents[0] = draw(st.integers(0, 5))
    elif kind == "forward":
        parents[i] = draw(st.integers(i + 1, i + 10))
    elif kind == "negative":
        parents[i] = draw(st.integers(-10, -1))
    else:
        parents[i] = i  # a cycle of length one
    return parents


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parents=invalid_parents())
def test_random_invalid_trees_rejected_and_mutate_nothing(engines, parents):
    _, tgt = engines
    with pytest.raises(TreeError):
        check_parents(parents, max_nodes=64, max_depth=64)
    if "inv" not in tgt.store:
        start(tgt, "inv")
    s = tgt.store.get("inv")
    before = snapshot(tgt, "inv")
    reply = tgt.handle(VerifyRequest(session_id="inv", round=s.last_round + 1, sync=CacheSync(base_len=s.kv.length),
                                     tree=FlatTree(token_ids=[1] * len(parents), parents=parents)))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.BAD_REQUEST
    assert_same(before, snapshot(tgt, "inv"))


def test_sampled_tree_distribution_checks(engines):
    _, tgt = engines
    r = start(tgt, "q1")
    base = dict(session_id="q1", round=1, sync=CacheSync(base_len=r.cache_len), sampling=SamplingSpec(temperature=1.0))
    cases = [
        FlatTree(token_ids=[1, 2], parents=[-1, 0], child_dist_ids=[[3], []], child_dist_probs=[[1.0], []]),  # child not in q
        FlatTree(token_ids=[1, 2], parents=[-1, 0], child_dist_ids=[[2, 3], []], child_dist_probs=[[0.5, 0.2], []]),  # sum
        FlatTree(token_ids=[1, 2], parents=[-1, 0], child_dist_ids=[[], []], child_dist_probs=[[], []]),  # missing q
    ]
    before = snapshot(tgt, "q1")
    for tree in cases:
        reply = tgt.handle(VerifyRequest(tree=tree, **base))
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.BAD_REQUEST, reply
        assert_same(before, snapshot(tgt, "q1"))


def test_forwards_use_prefill_threads_for_long_inputs():
    """Prompt-sized forwards run on ``prefill_threads``, tree-sized ones on ``threads``."""
    from specsplit.backends import CpuBackend

    eng = TargetEngine(tiny_model("qwen2", seed=4), EngineLimits(max_sessions=2, max_session_tokens=256),
                       backend=CpuBackend(threads=1, prefill_threads=2, pack_weights=False))
    seen = []
    forward = eng.model.forward

    def spy(*a, **kw):
        seen.append((kw["input_ids"].shape[1], torch.get_num_threads()))
        return forward(*a, **kw)

    eng.model.forward = spy
    before = torch.get_num_threads()
    try:
        prompt = [random.Random(1).randrange(128) for _ in range(100)]
        start_reply = eng.handle(VerifyRequest(session_id="p", round=0, sync=CacheSync(base_len=0, append_token_ids=prompt),
                                               tree=FlatTree(token_ids=[3, 4], parents=[-1, 0])))
        assert isinstance(start_reply, VerifyReply)
        held = start_reply.cache_len
        r = eng.handle(VerifyRequest(session_id="p", round=1, sync=CacheSync(base_len=held, append_token_ids=[]),
                                     tree=FlatTree(token_ids=[start_reply.bonus_token_id, 5, 6], parents=[-1, 0, 0])))
        assert isinstance(r, VerifyReply)
    finally:
        torch.set_num_threads(before)
    assert seen == [(102, 2), (3, 1)]


def test_prefill_threads_can_be_set_per_role():
    """SPECSPLIT_DRAFT_PREFILL_THREADS / _TARGET_ override SPECSPLIT_PREFILL_THREADS for one role
    (where the two share cores and prefill at once: the first round's overlap)."""
    from specsplit.backends import build_backend
    from specsplit.config import WorkerSettings

    s = WorkerSettings(prefill_threads=2, draft_prefill_threads=1, threads=1)
    assert build_backend("draft", "cpu", s).prefill_threads == 1
    assert build_backend("target", "cpu", s).prefill_threads == 2
    assert build_backend("target", "cpu", WorkerSettings(target_prefill_threads=3, threads=1)).prefill_threads == 3


def test_thread_chooser_runs_the_faster_option_and_notices_a_change_of_regime():
    """Per forward size, the option measured faster runs; the other is retried now and then, so
    when the cores free up (or fill) the choice follows within a few forwards."""
    from specsplit.backends import ThreadChooser

    chooser = ThreadChooser((1, 2), explore_every=4)
    cost = {1: 100.0, 2: 60.0}  # the other role idle: every core is faster

    def run(n: int, tokens: int = 20) -> list[int]:
        picked = []
        for _ in range(n):
            threads = chooser.choose(tokens)
            chooser.observe(tokens, threads, cost[threads])
            picked.append(threads)
        return picked

    first = run(24)
    assert first[:4] == [1, 1, 2, 2]  # each option measured first
    assert first[8:].count(2) >= 12 and 1 in first[8:]  # mostly the faster one, the other tried
    cost[2] = 150.0  # the other role computes beside it: more threads than free cores
    after = run(24)
    assert after[-16:].count(1) >= 12, after
    assert chooser.choose(1) == 1 and chooser.choose(2) == 1  # other sizes are measured apart
    assert set(chooser.table()) >= {"5/1", "5/2"}


def test_adaptive_threads_time_tree_forwards_and_leave_prompts_on_every_core():
    from specsplit.backends import CpuBackend, build_backend
    from specsplit.config import WorkerSettings

    assert build_backend("target", "cpu", WorkerSettings()).chooser is None  # off unless set
    backend = build_backend("target", "cpu", WorkerSettings(adaptive_threads=True, target_threads=1,
                                                            prefill_threads=2))
    assert backend.chooser is not None and backend.describe()["adaptive_threads"]
    assert CpuBackend(threads=2, prefill_threads=2, adaptive_threads=True).chooser is None  # nothing to choose
    eng = TargetEngine(tiny_model("qwen2", seed=4), EngineLimits(max_sessions=2, max_session_tokens=256),
                       backend=CpuBackend(threads=1, prefill_threads=2, pack_weights=False, adaptive_threads=True))
    before = torch.get_num_threads()
    try:
        prompt = [random.Random(1).randrange(128) for _ in range(100)]
        r = eng.handle(VerifyRequest(session_id="p", round=0, sync=CacheSync(base_len=0, append_token_ids=prompt),
                                     tree=FlatTree(token_ids=[3, 4], parents=[-1, 0])))
        assert isinstance(r, VerifyReply)
        for rnd in range(1, 6):
            r = eng.handle(VerifyRequest(session_id="p", round=rnd, sync=CacheSync(base_len=r.cache_len),
                                         tree=FlatTree(token_ids=[r.bonus_token_id, 5, 6], parents=[-1, 0, 0])))
            assert isinstance(r, VerifyReply)
    finally:
        torch.set_num_threads(before)
    timed = eng.backend.chooser.table()
    assert set(timed) == {"2/1", "2/2"}, timed  # 3-token forwards on both options; the prompt not timed


def test_non_cpu_backends_never_touch_threads():
    """The engine itself sets no thread counts: only the CPU backend policy does."""
    from specsplit.backends import CudaBackend
    from specsplit.engine.base import Backend

    assert CudaBackend.before_forward is Backend.before_forward  # CUDA workers inherit the no-op
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        eng = TargetEngine(tiny_model("qwen2", seed=4), EngineLimits(max_sessions=2, max_session_tokens=256))
        prompt = list(range(1, 100))
        r = eng.handle(VerifyRequest(session_id="p", round=0, sync=CacheSync(base_len=0, append_token_ids=prompt),
                                     tree=FlatTree(token_ids=[3, 4], parents=[-1, 0])))
        assert isinstance(r, VerifyReply) and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: an illegal memory access was encountered"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")])
def test_device_failure_is_raised_not_answered(error):
    """A failing device is never a retryable reply: the engine raises DeviceFailure (the worker
    logs it and exits non-zero, so the router fails the session over), and drops the session."""
    from specsplit.engine.base import is_device_failure
    from specsplit.errors import DeviceFailure

    eng = TargetEngine(tiny_model("qwen2", seed=4), LIMITS)
    start(eng, "d")
    assert is_device_failure(error) and not is_device_failure(RuntimeError("shape mismatch"))

    def broken(*a, **kw):
        raise error

    eng.model.forward = broken
    with pytest.raises(DeviceFailure, match="target on cpu"):
        eng.handle(VerifyRequest(session_id="d", round=1, sync=CacheSync(base_len=5),
                                 tree=FlatTree(token_ids=[1, 2], parents=[-1, 0])))
    assert "d" not in eng.store
