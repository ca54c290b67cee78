"""Batched drafting (issue 15, the draft side): several greedy sessions' trees built in lockstep,
one forward per step, equal the trees each session drafts alone; sampled sessions draft alone;
errors stay per request."""

from __future__ import annotations

import random

import pytest
import torch

from schemas import (
    CacheSync, DraftReply, DraftRequest, ErrorCode, ErrorReply, GrowRequest, SamplingSpec, TreeSpec, VerifyRequest,
)
from specsplit.engine.base import EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.orchestrator.state import SessionCursor
from tests.conftest import FAMILIES
from tests.test_batch_verify import same, spy_batches

LIMITS = EngineLimits(max_sessions=16, max_session_tokens=256, max_tree_nodes=16, max_tree_depth=8)
SAMPLED = SamplingSpec(temperature=0.9, top_p=0.95, seed=5)


def drafts_match(a, b) -> bool:
    """The same tree (tokens, parents, reuse, each distribution's support); the floats it carries
    (draft log-probs, probabilities) to fp32 rounding: forwards of another shape round differently
    (and near-equal probabilities may then list their ids in another order)."""
    if not (isinstance(a, DraftReply) and isinstance(b, DraftReply)):
        return same(a, b) or a.model_dump(exclude={"grow_ms"}) == b.model_dump(exclude={"grow_ms"})
    ta, tb = a.tree, b.tree
    if (a.session_id, a.round, a.reused_nodes, ta.token_ids, ta.parents) != (
            b.session_id, b.round, b.reused_nodes, tb.token_ids, tb.parents):
        return False
    xs, ys = list(ta.draft_logprobs), list(tb.draft_logprobs)
    for ids_a, pa, ids_b, pb in zip(ta.child_dist_ids, ta.child_dist_probs, tb.child_dist_ids, tb.child_dist_probs):
        da, db = dict(zip(ids_a, pa)), dict(zip(ids_b, pb))
        if da.keys() != db.keys():
            return False
        xs += [da[k] for k in sorted(da)]
        ys += [db[k] for k in sorted(da)]
    return torch.allclose(torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64),
                          atol=1e-5, rtol=1e-4)


def kv_close(a: DraftEngine, b: DraftEngine, sid: str) -> None:
    ka, kb = a.store.get(sid).kv, b.store.get(sid).kv
    assert ka.length == kb.length
    for la, lb in zip(ka.layers, kb.layers):
        torch.testing.assert_close(la.keys, lb.keys, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampling", [SamplingSpec(), SAMPLED], ids=["greedy", "sampled"])
def test_lockstep_drafts_equal_each_session_alone(models, family, sampling):
    target_model, draft_model, _ = models[family]
    rng = random.Random(len(family))
    alone, batched = DraftEngine(draft_model, LIMITS), DraftEngine(draft_model, LIMITS)
    target = TargetEngine(target_model, LIMITS)
    sizes = spy_batches(batched)
    cursors = {f"s{i}": SessionCursor([rng.randrange(128) for _ in range(rng.randrange(1, 40))]) for i in range(5)}
    specs = {sid: TreeSpec(max_nodes=rng.choice([4, 8, 12]), max_depth=rng.choice([2, 4, 6]), branch=1 + i % 3)
             for i, sid in enumerate(cursors)}
    reused = 0
    for rnd in range(6):
        reqs = [DraftRequest(session_id=sid, round=rnd, sync=cur.draft_sync(), root=cur.committed[-1],
                             tree=specs[sid], sampling=sampling) for sid, cur in cursors.items()]
        want = [alone.handle(r) for r in reqs]
        got = batched.draft_batch(reqs)
        for w, g in zip(want, got):
            assert isinstance(w, DraftReply) and drafts_match(w, g), (w, g)
        for r, w in zip(reqs, want):
            cur = cursors[r.session_id]
            cur.after_draft()
            reused += w.reused_nodes
            if sampling.greedy:  # grow the kept tree (alone; an unbounded budget is deterministic)
                for e in (alone, batched):
                    e.handle(GrowRequest(session_id=r.session_id, round=rnd, budget_ms=60_000.0))
            kv_close(alone, batched, r.session_id)
            v = target.handle(VerifyRequest(session_id=r.session_id, round=rnd, sync=cur.target_sync(), tree=w.tree,
                                            sampling=sampling))
            cur.apply_verify(v)
    if sampling.greedy:
        assert len(sizes) >= 6 and max(sizes) == 5  # every session's first forward of a round shared one
        assert reused > 0  # grown trees were re-rooted in the lockstep too
    else:  # sampled sessions draft alone: a seeded tree never depends on who shared a forward
        assert max(sizes, default=1) == 1, sizes


def _started(engine: DraftEngine, sid: str, n: int) -> int:
    r = engine.handle(DraftRequest(session_id=sid, round=0, sync=CacheSync(base_len=0, append_token_ids=list(range(1, n))),
                                   root=n, tree=TreeSpec(max_nodes=6, max_depth=3, branch=2)))
    assert isinstance(r, DraftReply)
    return n


@pytest.mark.parametrize("fail_forward", [False, True], ids=["ok", "batched-forward-fails"])
def test_draft_errors_stay_per_request(models, fail_forward):
    _, draft_model, _ = models["llama"]
    engines = DraftEngine(draft_model, LIMITS), DraftEngine(draft_model, LIMITS)
    held = {}
    for e in engines:
        for i, sid in enumerate("abcd"):
            held[sid] = _started(e, sid, 5 + 3 * i)
    spec = TreeSpec(max_nodes=8, max_depth=4, branch=2)
    reqs = [
        DraftRequest(session_id="a", round=1, sync=CacheSync(base_len=held["a"]), root=3, tree=spec),
        DraftRequest(session_id="b", round=1, sync=CacheSync(base_len=held["b"]), root=100_000, tree=spec),  # bad root
        DraftRequest(session_id="c", round=1, sync=CacheSync(base_len=held["c"] + 9), root=3, tree=spec),  # miss
        DraftRequest(session_id="new", round=0, sync=CacheSync(base_len=0, append_token_ids=[7, 8]), root=9,
                     tree=spec, sampling=SAMPLED),
        GrowRequest(session_id="d", round=0, budget_ms=60_000.0),
        DraftRequest(session_id="a", round=2, sync=CacheSync(base_len=held["a"], append_token_ids=[3]), root=4,
                     tree=spec),  # a's second: after its first
        DraftRequest(session_id="d", round=1, sync=CacheSync(base_len=held["d"] - 2,
                                                             append_token_ids=[1, 2]), root=5, tree=spec),
    ]
    alone, batched = engines
    if fail_forward:
        real = batched.forward_segments

        def boom(segments):
            real(segments)  # every cache was written to
            raise RuntimeError("shape mismatch somewhere")

        batched.forward_segments = boom
    want = [alone.handle(r) for r in reqs]
    got = batched.draft_batch(reqs)
    for w, g in zip(want, got):
        assert drafts_match(w, g), (w, g)
    assert [g.code for g in got if isinstance(g, ErrorReply)] == [ErrorCode.BAD_REQUEST, ErrorCode.CACHE_MISS]
    for sid in ("a", "d", "new"):
        kv_close(alone, batched, sid)



def test_a_lockstep_waits_for_the_device_once_for_all_its_replies(models):
    """The members of a lockstep batch leave together and share one wait for the device: one
    synchronization for all their replies, which report the same ms (a wait per member cost each
    a synchronization); a request drafted alone still waits once for itself."""
    draft = DraftEngine(models["qwen2"][1], LIMITS)
    held = {sid: _started(draft, sid, n) for sid, n in (("a", 9), ("b", 14), ("c", 5))}
    reqs = [DraftRequest(session_id=sid, round=1, sync=CacheSync(base_len=n), root=7,
                         tree=TreeSpec(max_nodes=8, max_depth=4, branch=2)) for sid, n in held.items()]
    reqs.append(DraftRequest(session_id="d", round=0, sync=CacheSync(base_len=0, append_token_ids=list(range(1, 9))),
                             root=3, tree=TreeSpec(max_nodes=4, max_depth=2, branch=2), sampling=SAMPLED))  # alone
    waits = []
    draft.backend.synchronize = lambda: waits.append(1)  # an accelerator's wait for its queue
    sizes = spy_batches(draft)
    got = draft.draft_batch(reqs)
    assert all(isinstance(g, DraftReply) for g in got) and max(sizes) == 3
    assert len({g.draft_ms for g in got[:3]}) == 1 and got[0].draft_ms > 0
    assert len(waits) == 2, waits  # the lockstep's three replies, then d's
