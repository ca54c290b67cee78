"""Batched verification (issue 15): the trees of several sessions verified in one forward give
the replies, caches and logits that verifying each session alone gives (fp32: logits to rounding,
tokens identical; the int8 target: bit-identical), and errors stay per request."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from schemas import (
    CacheSync, DraftRequest, EndSession, ErrorCode, ErrorReply, FlatTree, SamplingSpec, SpecPVSpec, TreeSpec,
    VerifyReply, VerifyRequest,
)
from specsplit.engine.base import EngineLimits
from specsplit.engine.batch import Segment
from specsplit.engine.draft import DraftEngine
from specsplit.engine.masks import causal, linear_then_tree, positions
from specsplit.engine.target import TargetEngine
from specsplit.errors import DeviceFailure
from specsplit.models.int8 import int8_supported, quantize_int8
from specsplit.orchestrator.state import SessionCursor
from specsplit.tree import depths_of
from tests.conftest import FAMILIES, perturbed, tiny_model

LIMITS = EngineLimits(max_sessions=16, max_session_tokens=256, max_tree_nodes=16, max_tree_depth=8)
GREEDY = SamplingSpec()
SAMPLED = SamplingSpec(temperature=0.9, top_p=0.95, seed=7)


MEASURED = {"verify_ms", "batch_tokens", "batch_size"}  # what the forward that served a reply measured


def same(a, b) -> bool:
    return type(a) is type(b) and a.model_dump(exclude=MEASURED) == b.model_dump(exclude=MEASURED)


def forward_tokens(req: VerifyRequest) -> int:
    return len(req.sync.append_token_ids) + req.tree.num_nodes


def caches_equal(a: TargetEngine, b: TargetEngine, sid: str, exact: bool) -> None:
    ka, kb = a.store.get(sid).kv, b.store.get(sid).kv
    assert ka.length == kb.length
    for la, lb in zip(ka.layers, kb.layers):
        if exact:
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
        else:  # float32 forwards of other shapes: a windowed Mistral's keys once differed by 2.2e-5
            torch.testing.assert_close(la.keys, lb.keys, atol=5e-5, rtol=1e-4)
            torch.testing.assert_close(la.values, lb.values, atol=5e-5, rtol=1e-4)


def spy_batches(engine: TargetEngine) -> list[int]:
    """Record the number of sessions of each batched forward ``engine`` runs."""
    sizes, real = [], engine.forward_segments

    def spy(segments):
        sizes.append(len(segments))
        return real(segments)

    engine.forward_segments = spy
    return sizes


def run_rounds(target_model, draft_model, sampling: SamplingSpec, *, sessions: int = 5, rounds: int = 6,
               exact: bool = False, seed: int = 0, batched_forwards: bool = True) -> int:
    """Several sessions of different prompt lengths, chains and branching trees; each round the
    same requests go to an engine one at a time and, as ONE list, to ``verify_batch`` of another.
    Replies must be identical, caches equal. Returns the accepted tokens (so tests can check
    that trees were really accepted into). ``batched_forwards`` False: the engine serves the
    list one session a forward (a model whose sessions never share one)."""
    rng = random.Random(seed)
    alone, batched = TargetEngine(target_model, LIMITS), TargetEngine(target_model, LIMITS)
    draft = DraftEngine(draft_model, LIMITS)
    sizes = spy_batches(batched)
    cursors = {f"s{i}": SessionCursor([rng.randrange(128) for _ in range(rng.randrange(1, 40))]) for i in range(sessions)}
    specs = {sid: TreeSpec(max_nodes=rng.choice([4, 8, 12]), max_depth=rng.choice([3, 5]), branch=1 + i % 3)
             for i, sid in enumerate(cursors)}  # branch 1: a chain
    accepted = 0
    for rnd in range(rounds):
        reqs = []
        for sid, cur in cursors.items():
            d = draft.handle(DraftRequest(session_id=sid, round=rnd, sync=cur.draft_sync(), root=cur.committed[-1],
                                          tree=specs[sid], sampling=sampling))
            cur.after_draft()
            sync = cur.target_sync()
            if rnd and rng.random() < 0.3:  # re-send a few committed tokens: a multi-token sync segment
                base = max(0, sync.base_len - rng.randrange(1, 4))
                sync = CacheSync(base_len=base, append_token_ids=cur.committed[base:-1])
            reqs.append(VerifyRequest(session_id=sid, round=rnd, sync=sync, tree=d.tree, sampling=sampling))
        want = [alone.handle(r) for r in reqs]
        got = batched.verify_batch(reqs)
        total = sum(forward_tokens(r) for r in reqs)
        for r, w, g in zip(reqs, want, got):
            assert isinstance(w, VerifyReply) and same(w, g), (w, g)
            assert (w.batch_tokens, w.batch_size) == (forward_tokens(r), 1)  # alone: its own forward
            if batched_forwards:
                assert (g.batch_tokens, g.batch_size) == (total, sessions)  # batched: the shared one
        for r, w in zip(reqs, want):
            accepted += len(cursors[r.session_id].apply_verify(w)) - 1
            caches_equal(alone, batched, r.session_id, exact)
    assert sizes == ([sessions] * rounds if batched_forwards else [])  # every round ONE forward over every session
    return accepted


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_batched_rounds_equal_each_session_alone(models, family, sampling):
    target, close_draft, _ = models[family]
    assert run_rounds(target, close_draft, sampling, seed=hash(family) % 100) > 0


@pytest.mark.skipif(not int8_supported(), reason="torch's fbgemm int8 kernels need an x86 CPU build")
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_int8_target_batched_is_bit_identical(models, sampling):
    target, close_draft, _ = models["qwen2"]
    n = torch.get_num_threads()
    try:
        q = quantize_int8(copy.deepcopy(target))
        assert run_rounds(q, close_draft, sampling, exact=True, seed=3) > 0
    finally:
        torch.set_num_threads(n)


def _segments(engine: TargetEngine, rng: random.Random, k: int):
    """k sessions with prefixes of different lengths; per session (kv, tokens, positions,
    visibility) of a few sync tokens + a random tree."""
    out = []
    for i in range(k):
        kv = engine.store.get_or_create(f"g{i}").kv
        prefix = [rng.randrange(128) for _ in range(rng.randrange(1, 30))]
        engine.forward(kv, prefix, torch.arange(len(prefix)), causal(len(prefix), 0, engine.device), keep=1)
        s, n = rng.randrange(0, 4), rng.randrange(1, 10)
        parents = [-1] + [rng.randrange(j) for j in range(1, n)]
        p = kv.length
        vis = torch.ones(s + n, p + s + n, dtype=torch.bool)
        vis[:, p:] = linear_then_tree(s, parents, engine.device)
        pos = torch.cat([torch.arange(p, p + s), positions(depths_of(parents), p + s, engine.device)])
        out.append((kv, [rng.randrange(128) for _ in range(s + n)], pos, vis, n))
    return out


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_segment_forward_logits_match_single_forwards(quantized, attn):
    """The logits of one batched forward vs each session's own forward: bit-identical for the
    int8 target, to fp32 rounding otherwise; the caches gain the same entries."""
    if quantized and not int8_supported():
        pytest.skip("no fbgemm")
    model = tiny_model("qwen2", seed=5, attn=attn)
    if quantized:
        model = quantize_int8(model)
    a, b = TargetEngine(model, LIMITS), TargetEngine(model, LIMITS)
    sa, sb = _segments(a, random.Random(1), 5), _segments(b, random.Random(1), 5)
    single = [a.forward(kv, ids, pos, vis, keep=n) for kv, ids, pos, vis, n in sa]
    batched = b.forward_segments([Segment(kv, ids, pos, vis, keep=n) for kv, ids, pos, vis, n in sb])
    for x, y in zip(single, batched):
        if quantized:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    for i in range(5):
        caches_equal(a, b, f"g{i}", exact=quantized)


def _start(engine: TargetEngine, sid: str, prompt: list[int]) -> VerifyReply:
    r = engine.handle(VerifyRequest(session_id=sid, round=0, sync=CacheSync(base_len=0, append_token_ids=prompt[:-1]),
                                    tree=FlatTree(token_ids=[prompt[-1]], parents=[-1])))
    assert isinstance(r, VerifyReply)
    return r


def _mixed_batch(held: dict[str, int]) -> list:
    tree = FlatTree(token_ids=[3, 4, 5, 6], parents=[-1, 0, 0, 1])
    return [
        VerifyRequest(session_id="a", round=1, sync=CacheSync(base_len=held["a"]), tree=tree),
        VerifyRequest(session_id="b", round=1, sync=CacheSync(base_len=held["b"]),  # out of the vocabulary
                      tree=FlatTree(token_ids=[3, 10_000], parents=[-1, 0])),
        VerifyRequest(session_id="c", round=0, sync=CacheSync(base_len=held["c"]), tree=tree),  # stale
        VerifyRequest(session_id="d", round=1, sync=CacheSync(base_len=held["d"] + 5), tree=tree),  # cache miss
        VerifyRequest(session_id="new", round=0, sync=CacheSync(base_len=0, append_token_ids=[9, 8, 7]), tree=tree),
        VerifyRequest(session_id="a", round=2, sync=CacheSync(base_len=held["a"] + 1), tree=tree),  # a's 2nd
        EndSession(session_id="e"),
        VerifyRequest(session_id="f", round=1, sync=CacheSync(base_len=held["f"]), tree=tree,
                      specpv=SpecPVSpec(threshold=16, block_size=4)),  # SpecPV: alone
        VerifyRequest(session_id="g", round=1, sync=CacheSync(base_len=held["g"] - 2,
                                                              append_token_ids=[1, 2]), tree=tree),
        # f's next request must still follow its SpecPV one (verified alone), not jump ahead in the forward
        VerifyRequest(session_id="f", round=2, sync=CacheSync(base_len=held["f"]), tree=tree),
    ]


def _engines_with_sessions(model):
    engines = TargetEngine(model, LIMITS), TargetEngine(model, LIMITS)
    held = {}
    for i, sid in enumerate("abcdefg"):
        prompt = list(range(3, 3 + 4 + 3 * i))
        for e in engines:
            held[sid] = _start(e, sid, prompt).cache_len
    c = VerifyRequest(session_id="c", round=3, sync=CacheSync(base_len=held["c"]),
                      tree=FlatTree(token_ids=[1], parents=[-1]))
    for e in engines:  # c is at round 3: its round-0 request below is stale
        r = e.handle(c)
        assert isinstance(r, VerifyReply)
    held["c"] = r.cache_len
    return engines, held


def test_errors_stay_per_request_and_the_rest_match_alone():
    model = tiny_model("llama", seed=6)
    (alone, batched), held = _engines_with_sessions(model)
    reqs = _mixed_batch(held)
    before_b = [layer.keys.clone() for layer in batched.store.get("b").kv.layers]
    sizes = spy_batches(batched)
    want = [alone.handle(r) for r in reqs]
    got = batched.verify_batch(reqs)
    assert sizes == [3]  # a, new and g shared a forward; the rest were refused or verified alone
    for w, g in zip(want, got):
        assert same(w, g), (w, g)
    shared = sum(forward_tokens(reqs[i]) for i in (0, 4, 8))
    for i, (r, g) in enumerate(zip(reqs, got)):
        if isinstance(g, VerifyReply):  # the three members report the shared forward; the rest their own
            assert (g.batch_tokens, g.batch_size) == ((shared, 3) if i in (0, 4, 8) else (forward_tokens(r), 1)), i
    codes = [g.code if isinstance(g, ErrorReply) else None for g in got]
    assert codes[1:4] == [ErrorCode.BAD_REQUEST, ErrorCode.STALE_ROUND, ErrorCode.CACHE_MISS]
    assert isinstance(got[0], VerifyReply) and isinstance(got[4], VerifyReply) and isinstance(got[8], VerifyReply)
    assert all(torch.equal(x, y.keys) for x, y in zip(before_b, batched.store.get("b").kv.layers))
    for sid in "acdg":
        caches_equal(alone, batched, sid, exact=False)


def test_a_failing_batched_forward_verifies_each_alone():
    model = tiny_model("qwen3", seed=7)
    (alone, batched), held = _engines_with_sessions(model)
    reqs = _mixed_batch(held)

    real = batched.forward_segments

    def boom(segments):
        real(segments)  # fail after the forward: every member's cache was written to
        raise RuntimeError("shape mismatch somewhere")

    batched.forward_segments = boom
    want = [alone.handle(r) for r in reqs]
    got = batched.verify_batch(reqs)
    for w, g in zip(want, got):
        assert same(w, g), (w, g)
        if isinstance(g, VerifyReply):  # each verified alone: its own forward
            assert (g.batch_tokens, g.batch_size) == (w.batch_tokens, 1)
    for sid in "acdg":
        caches_equal(alone, batched, sid, exact=True)  # each verified alone: the same forwards


def test_device_failure_in_a_batch_raises_and_drops_its_sessions():
    model = tiny_model("qwen2", seed=8)
    (_, batched), held = _engines_with_sessions(model)
    tree = FlatTree(token_ids=[3, 4], parents=[-1, 0])
    reqs = [VerifyRequest(session_id=s, round=1, sync=CacheSync(base_len=held[s]), tree=tree) for s in "ab"]

    def broken(*a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    batched.model.forward = broken
    with pytest.raises(DeviceFailure):
        batched.verify_batch(reqs)
    assert "a" not in batched.store and "b" not in batched.store and "c" in batched.store


def test_select_fused_takes_each_sessions_first_batchable_request_only():
    """The one selection rule of the draft's and the target's batches: a session's first request
    shares the forward when batchable; its later ones, and unbatchable ones, are served alone."""
    from types import SimpleNamespace as NS

    from specsplit.engine.batch import select_fused

    reqs = [NS(session_id="a", ok=True), NS(session_id="b", ok=False), NS(session_id="a", ok=True),
            NS(session_id="c", ok=True), NS(session_id="b", ok=True), NS(ok=True)]
    assert select_fused(reqs, lambda r: r.ok) == [0, 3, 5]
    assert select_fused([], lambda r: True) == []


def test_a_batched_forward_waits_for_the_device_once_for_all_its_replies():
    """The members of one batched forward share one wait for the device (``elapsed_ms``): one
    device synchronization for their replies, which report the same ms, where a wait per reply
    cost each member a synchronization; a request verified alone still waits once for itself."""
    model = tiny_model("llama", seed=6)
    (_, batched), held = _engines_with_sessions(model)
    reqs = _mixed_batch(held)
    waits = []
    batched.backend.synchronize = lambda: waits.append(1)  # an accelerator's wait for its queue
    got = batched.verify_batch(reqs)
    shared = [got[i] for i in (0, 4, 8)]
    alone = [g for i, g in enumerate(got) if isinstance(g, VerifyReply) and i not in (0, 4, 8)]
    assert all(isinstance(g, VerifyReply) for g in shared) and alone
    assert len({g.verify_ms for g in shared}) == 1
    assert len(waits) == 1 + len(alone), (len(waits), len(alone))
