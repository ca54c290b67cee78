"""The preallocated KV pool (issue 45): engines whose session caches live in fixed slots allocated
once give plain greedy decoding, tree forwards equal to sequential paths and batched verification
equal to each session alone; a slot is reused only once no request holds its old session, and a
full pool refuses a new session with OVERLOADED, changing nothing (fp32, tiny random models)."""

from __future__ import annotations

import random
import threading
from dataclasses import replace

import pytest
import torch

from schemas import (
    CacheSync, DraftRequest, EndSession, ErrorCode, ErrorReply, FlatTree, GrowRequest, SamplingSpec, TreeSpec,
    VerifyReply, VerifyRequest,
)
from specsplit.engine.base import Engine, EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.kvcache import SessionKV
from specsplit.engine.kvpool import GB, KVPool, PooledKV, pool_shape, pool_slots
from specsplit.engine.target import TargetEngine
from specsplit.errors import SpecError
from specsplit.local import generate
from specsplit.orchestrator.state import SessionCursor
from specsplit.tree import root_to_leaf_paths
from tests.conftest import FAMILIES, fp32_tolerance, greedy_reference, on_device, tiny_model
from tests.test_batch_draft import drafts_match, kv_close
from tests.test_tree_forward import prefill, random_parents, sequential_logits, tree_logits

LIMITS = EngineLimits(max_sessions=8, max_session_tokens=160, max_tree_nodes=24, max_tree_depth=8)
GREEDY = SamplingSpec()
SAMPLED = SamplingSpec(temperature=0.9, top_p=0.95, seed=7)
MARGIN = 1e-3


def pooled(limits: EngineLimits, model, slots: int) -> EngineLimits:
    """``limits`` with a pool of exactly ``slots`` slots for ``model``."""
    shape = pool_shape(model, limits.max_session_tokens, torch.float32)
    return replace(limits, kv_pool_gb=slots * shape.slot_bytes / GB)


def assert_in_pool(engine: Engine) -> None:
    """Every live session's cache is its slot's view of the pool's buffers, which never moved."""
    pool = engine.kv_pool
    for sid in list(engine.store.bytes_by_session()):
        kv = engine.store.get(sid).kv
        assert isinstance(kv, PooledKV) and not kv.released
        for layer, k, v in zip(kv.layers, pool.keys, pool.values):
            assert layer._k.data_ptr() == k[kv.slot].data_ptr() and layer._v.data_ptr() == v[kv.slot].data_ptr()
            assert layer._k.shape[2] == pool.shape.max_len


def test_pool_sizing_from_gb():
    model = tiny_model("qwen3", seed=1)
    shape = pool_shape(model, 160, torch.float32)
    # 2 layers x (K, V) x 2 KV heads x 160 tokens x 16 dims x 4 bytes
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (2, 2, 16)
    assert shape.slot_bytes == 2 * 2 * 2 * 160 * 16 * 4
    assert pool_slots(3 * shape.slot_bytes / GB, shape, 64) == 3
    assert pool_slots(3.9 * shape.slot_bytes / GB, shape, 64) == 3  # whole slots only
    assert pool_slots(100 * shape.slot_bytes / GB, shape, 5) == 5  # bounded by max_sessions
    with pytest.raises(ValueError, match="holds no session"):
        pool_slots(0.9 * shape.slot_bytes / GB, shape, 64)
    with pytest.raises(ValueError, match="holds no session"):
        TargetEngine(model, replace(LIMITS, kv_pool_gb=0.5 * shape.slot_bytes / GB))
    engine = TargetEngine(model, pooled(LIMITS, model, 3))
    pool = engine.kv_pool
    assert pool.slots == pool.free_slots == 3 and pool.nbytes == 3 * shape.slot_bytes
    for t in (*pool.keys, *pool.values):
        assert t.shape == (3, 2, 160, 16) and t.dtype == engine.dtype and t.device == engine.device
    assert TargetEngine(model, LIMITS).kv_pool is None  # 0: off, caches grow as before
    assert not isinstance(TargetEngine(model, LIMITS).store.get_or_create("s").kv, PooledKV)


@pytest.mark.parametrize("layers", [2, 6])
def test_compaction_in_a_slot_moves_every_layer_at_once(layers):
    """A pooled cache's compaction (the accepted path moved after the prefix) leaves each layer as
    a growing cache's does, for paths that are and are not already in place, and takes the same
    few operations whatever the number of layers (one gather and one copy over the pool)."""
    from specsplit.bench.opcount import CountOps
    from specsplit.engine.kvpool import PoolShape

    shape = PoolShape(layers=layers, kv_heads=2, head_dim=8, max_len=64, dtype=torch.float32)
    pool = KVPool(shape, 3, torch.device("cpu"))
    for src, dst in (([10, 12, 13, 17], 10), ([5, 6, 7], 5), ([20, 31], 19), ([], 4)):
        pooled_kv, plain = pool.make_kv(), SessionKV(layers, 64)
        for i in range(layers):
            k, v = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
            pooled_kv.layers[i].update(k, v)
            plain.layers[i].update(k, v)
        other = {s: pool.all[:, :, s].clone() for s in range(3) if s != pooled_kv.slot}
        with CountOps() as count:
            pooled_kv.compact(src, dst)
        plain.compact(src, dst)
        assert pooled_kv.length == plain.length == dst + len(src)
        for a, b in zip(pooled_kv.layers, plain.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
            torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
        assert sum(count.ops.values()) <= (0 if src == list(range(dst, dst + len(src))) else 4), count.ops
        assert all(torch.equal(t, pool.all[:, :, s]) for s, t in other.items())  # no other slot moved
        pool.release(type("S", (), {"kv": pooled_kv, "lock": threading.Lock(), "draft_tree": None})())


def test_several_sessions_compact_at_once():
    """A batched verify's compactions, every member's at once (``KVPool.compact_sessions``): each
    cache as a growing cache compacted alone, paths already in place untouched, slots outside
    the batch untouched, and the same few operations for three sessions as for one."""
    from specsplit.bench.opcount import CountOps
    from specsplit.engine.kvpool import PoolShape

    shape = PoolShape(layers=3, kv_heads=2, head_dim=8, max_len=64, dtype=torch.float32)
    pool = KVPool(shape, 7, torch.device("cpu"))
    moves = (([10, 12, 13, 17], 10), ([5, 6, 7], 5), ([20, 31], 19), ([], 4), ([33, 30, 40], 30))
    pooled, plain = [pool.make_kv() for _ in moves], [SessionKV(3, 64) for _ in moves]
    for a, b in zip(pooled, plain):
        for i in range(3):
            k, v = torch.randn(1, 2, 45, 8), torch.randn(1, 2, 45, 8)
            a.layers[i].update(k, v)
            b.layers[i].update(k, v)
    others = [s for s in range(7) if s not in {kv.slot for kv in pooled}]
    for s in others:  # slots outside the batch hold something to keep
        pool.all[:, :, s].normal_()
    idle = pool.all[:, :, others].clone()
    with CountOps() as count:
        pool.compact_sessions([(kv, src, dst) for kv, (src, dst) in zip(pooled, moves)])
    for b, (src, dst) in zip(plain, moves):
        b.compact(src, dst)
    for a, b in zip(pooled, plain):
        assert a.length == b.length
        for la, lb in zip(a.layers, b.layers):
            torch.testing.assert_close(la.keys, lb.keys, rtol=0, atol=0)
            torch.testing.assert_close(la.values, lb.values, rtol=0, atol=0)
    assert sum(count.ops.values()) <= 4, count.ops  # one index copy, one gather, one put, for all of them
    assert len(others) == 2 and torch.equal(idle, pool.all[:, :, others])


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_forward_in_a_slot_matches_each_path(family):
    model = tiny_model(family, seed=1)
    engine = Engine(model, pooled(EngineLimits(max_sessions=4, max_session_tokens=128), model, 2))
    rng = random.Random(7)
    for offset in (1, 9, 33):
        for n in (1, 7, 23):
            engine.store.end_session("s")  # the next session reuses the slot, stale K/V in it
            prefix = [rng.randrange(128) for _ in range(offset)]
            kv = prefill(engine, prefix)
            assert isinstance(kv, PooledKV)
            parents = random_parents(n, rng)
            tokens = [rng.randrange(128) for _ in range(n)]
            logits = tree_logits(engine, kv, tokens, parents)  # [N, V]
            for path in root_to_leaf_paths(parents):
                ref = sequential_logits(model, prefix + [tokens[i] for i in path])[offset:]
                torch.testing.assert_close(logits[path], ref, **fp32_tolerance("cpu"))
            path = rng.choice(root_to_leaf_paths(parents))
            kv.compact([offset + i for i in path], offset)  # the accepted path, moved inside the slot
            nxt = tree_logits(engine, kv, [5], [-1])
            ref = sequential_logits(model, prefix + [tokens[i] for i in path] + [5])[-1:]
            torch.testing.assert_close(nxt, ref, **fp32_tolerance("cpu"))
            assert_in_pool(engine)


def generate_equals_greedy(models, family: str, on_pool, device=None, prompts: int = 6, after_each=None) -> None:
    """Greedy generation with draft and target engines made by ``on_pool(cls, model, limits)``
    equals the target's plain greedy decoding (prompts whose top-2 margin holds, at least
    ``prompts`` - 2 of them; ``after_each()`` after every run), and a sampled run equals the same
    run on growing caches. ``device``: the models' copies there (the references stay on CPU)."""
    target, often, rarely = (on_device(m, device) if device else m for m in models[family])

    def engine_of(cls):
        return lambda model, limits: on_pool(cls, model, limits)

    rng = random.Random(11)
    compared = 0
    for i in range(prompts):
        prompt = [rng.randrange(128) for _ in range(rng.randrange(1, 30))]
        ref, gap = greedy_reference(models[family][0], prompt, 20)
        if gap < MARGIN:
            continue
        for tree in (TreeSpec(max_nodes=5, max_depth=4, branch=1), TreeSpec(max_nodes=16, max_depth=5, branch=3)):
            out = generate(often if i % 2 else rarely, target, prompt, max_new_tokens=20, tree=tree,
                           sampling=GREEDY, make_target_engine=engine_of(TargetEngine),
                           make_draft_engine=engine_of(DraftEngine), grow_budget_ms=5.0 * (i % 2))
            assert out == ref, (family, prompt, tree)
            if after_each:
                after_each()
        compared += 1
    assert compared >= prompts - 2
    kw = {"max_new_tokens": 16, "tree": TreeSpec(max_nodes=8, max_depth=4, branch=2), "sampling": SAMPLED}
    assert generate(often, target, [3, 1, 4], **kw, make_target_engine=engine_of(TargetEngine),
                    make_draft_engine=engine_of(DraftEngine)) == generate(often, target, [3, 1, 4], **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_pools_equals_plain_greedy(models, family):
    """Draft and target engines both on pools give the target's greedy decoding, their caches
    stay in their slots, and a sampled run equals the same run on growing caches."""
    engines = []

    def on_pool(cls, model, limits):
        engines.append(cls(model, pooled(limits, model, 1)))
        return engines[-1]

    def in_their_slots():
        for e in engines[-2:]:
            assert e.kv_pool is not None and len(e.store) == 1
            assert_in_pool(e)

    generate_equals_greedy(models, family, on_pool, after_each=in_their_slots)


def same(a, b) -> bool:
    measured = {"verify_ms", "batch_tokens", "batch_size"}
    return type(a) is type(b) and a.model_dump(exclude=measured) == b.model_dump(exclude=measured)


def lockstep(engine: Engine, rng: random.Random) -> tuple[list[int], dict[str, SessionCursor]]:
    """Four sessions with random prompts for rounds in lockstep on ``engine``, and the list its
    ``forward_segments`` appends each fused forward's session count to."""
    sizes, real = [], engine.forward_segments
    engine.forward_segments = lambda segs: sizes.append(len(segs)) or real(segs)
    return sizes, {f"s{i}": SessionCursor([rng.randrange(128) for _ in range(rng.randrange(1, 40))]) for i in range(4)}


def tree_spec(j: int) -> TreeSpec:
    return TreeSpec(max_nodes=8, max_depth=4, branch=1 + j % 3)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_verify_on_a_pool_equals_each_session_alone(models, family):
    """The same rounds verified one at a time on growing caches and batched on a pool whose
    slots were used before (stale K/V in them): the same replies."""
    target, draft_model, _ = models[family]
    rng = random.Random(5)
    alone = TargetEngine(target, LIMITS)
    batched = TargetEngine(target, pooled(LIMITS, target, 4))
    for i in range(4):  # fill every slot with other sessions' K/V, then free them
        kv = batched.store.get_or_create(f"old{i}").kv
        batched.forward_linear(kv, [rng.randrange(128) for _ in range(100)])
    for i in range(4):
        batched.store.end_session(f"old{i}")
    assert batched.kv_pool.free_slots == 4
    draft = DraftEngine(draft_model, LIMITS)
    sizes, cursors = lockstep(batched, rng)
    accepted = batched_rounds_equal_alone(draft, alone, batched, cursors)
    assert sizes == [4] * 5 and accepted > 0
    assert_in_pool(batched)


def batched_rounds_equal_alone(draft: DraftEngine, alone: TargetEngine, batched: TargetEngine,
                               cursors: dict[str, SessionCursor], rounds: int = 5) -> int:
    """``rounds`` greedy rounds of every cursor's session: ``draft`` drafts (tree_spec), ``alone``
    verifies one at a time, ``batched`` all at once (``verify_batch``); the replies must be the
    same. Returns the tokens accepted."""
    accepted = 0
    for rnd in range(rounds):
        reqs = []
        for j, (sid, cur) in enumerate(cursors.items()):
            d = draft.handle(DraftRequest(session_id=sid, round=rnd, sync=cur.draft_sync(), root=cur.committed[-1],
                                          tree=tree_spec(j), sampling=GREEDY))
            cur.after_draft()
            reqs.append(VerifyRequest(session_id=sid, round=rnd, sync=cur.target_sync(), tree=d.tree, sampling=GREEDY))
        want = [alone.handle(r) for r in reqs]
        got = batched.verify_batch(reqs)
        for r, w, g in zip(reqs, want, got):
            assert isinstance(w, VerifyReply) and same(w, g), (w, g)
            accepted += len(cursors[r.session_id].apply_verify(w)) - 1
    return accepted


@pytest.mark.parametrize("family", FAMILIES)
def test_lockstep_drafts_on_a_pool_equal_each_session_alone(models, family):
    """Greedy sessions drafting (and growing their kept trees) in lockstep on a pool's slots give
    the trees and caches each session gets alone on growing caches."""
    target_model, draft_model, _ = models[family]
    rng = random.Random(len(family))
    alone, batched = DraftEngine(draft_model, LIMITS), DraftEngine(draft_model, pooled(LIMITS, draft_model, 4))
    target = TargetEngine(target_model, LIMITS)
    sizes, cursors = lockstep(batched, rng)
    reused = 0
    for rnd in range(5):
        reqs = [DraftRequest(session_id=sid, round=rnd, sync=cur.draft_sync(), root=cur.committed[-1],
                             tree=tree_spec(j), sampling=GREEDY)
                for j, (sid, cur) in enumerate(cursors.items())]
        want = [alone.handle(r) for r in reqs]
        got = batched.draft_batch(reqs)
        for r, w, g in zip(reqs, want, got):
            assert drafts_match(w, g), (w, g)
            cur = cursors[r.session_id]
            cur.after_draft()
            reused += w.reused_nodes
            for e in (alone, batched):
                e.handle(GrowRequest(session_id=r.session_id, round=rnd, budget_ms=60_000.0))
            kv_close(alone, batched, r.session_id)
            cur.apply_verify(target.handle(VerifyRequest(session_id=r.session_id, round=rnd, sync=cur.target_sync(),
                                                         tree=w.tree, sampling=GREEDY)))
    assert max(sizes) == 4 and reused > 0
    assert_in_pool(batched)


def greedy_in_engine(engine: TargetEngine, sid: str, prompt: list[int], n: int) -> list[int]:
    """n tokens of greedy decoding through ``engine``'s session ``sid``, one root-only tree per
    round (every token is the target's bonus)."""
    cur = SessionCursor(list(prompt))
    for rnd in range(n):
        reply = engine.handle(VerifyRequest(session_id=sid, round=rnd, sync=cur.target_sync(),
                                            tree=_root(cur.committed[-1]), sampling=GREEDY))
        assert isinstance(reply, VerifyReply), reply
        cur.apply_verify(reply)
    return cur.committed[len(prompt):]


def _root(token: int) -> FlatTree:
    return FlatTree(token_ids=[token], parents=[-1], draft_logprobs=[0.0])


class Held:
    """Runs ``engine.handle(req)`` on a thread that stops inside its forward (the session's lock
    held, its request in flight) until ``go()``."""

    def __init__(self, engine: Engine, req):
        self.entered, self.gate, self.reply = threading.Event(), threading.Event(), None
        real = engine.forward

        def forward(*args, **kwargs):
            if threading.current_thread() is self.thread:
                self.entered.set()
                assert self.gate.wait(30)
            return real(*args, **kwargs)

        engine.forward = forward
        self.thread = threading.Thread(target=lambda: setattr(self, "reply", engine.handle(req)), daemon=True)
        self.thread.start()
        assert self.entered.wait(30)

    def go(self):
        self.gate.set()
        self.thread.join(30)
        return self.reply


def first_request(sid: str, prompt: list[int]) -> VerifyRequest:
    return VerifyRequest(session_id=sid, round=0, sync=CacheSync(base_len=0, append_token_ids=prompt[:-1]),
                         tree=_root(prompt[-1]), sampling=GREEDY)


def test_a_slot_is_reused_only_after_its_evicted_sessions_request_ended():
    model = tiny_model("llama", seed=4)
    engine = TargetEngine(model, pooled(LIMITS, model, 1))
    pool = engine.kv_pool
    a_prompt, b_prompt = list(range(40, 100)), [7, 3, 9]
    a_ref, gap_a = greedy_reference(model, a_prompt, 1)
    b_ref, gap_b = greedy_reference(model, b_prompt, 12)
    assert min(gap_a, gap_b) > MARGIN
    held = Held(engine, first_request("A", a_prompt))  # A's first request, stopped in its forward
    a_session = engine.store.get("A")
    assert engine.handle(EndSession(session_id="A")).existed  # A leaves the store mid-request
    assert pool.retired == 1 and pool.free_slots == 0 and "A" not in engine.store
    refused = engine.handle(first_request("B", b_prompt))
    assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.OVERLOADED and refused.retryable
    assert "B" not in engine.store and pool.retired == 1
    a_reply = held.go()  # A's request reads its own K/V to the end: its slot was not given away
    assert isinstance(a_reply, VerifyReply) and a_reply.bonus_token_id == a_ref[0], a_reply
    # A's request ended: B gets A's slot, over A's longer stale K/V, and decodes exactly
    assert greedy_in_engine(engine, "B", b_prompt, 12) == b_ref
    assert pool.retired == 0 and engine.store.get("B").kv.slot == 0
    assert_in_pool(engine)
    with pytest.raises(SpecError) as refused_a:  # a request still holding A's old session
        engine.check_locked(a_session, 1, CacheSync(base_len=0))
    assert refused_a.value.code == ErrorCode.CACHE_MISS
    again = engine.handle(VerifyRequest(session_id="A", round=1, sync=CacheSync(base_len=len(a_prompt)),
                                        tree=_root(a_ref[0]), sampling=GREEDY))
    assert isinstance(again, ErrorReply) and again.code == ErrorCode.CACHE_MISS


def test_a_full_pool_evicts_the_least_recently_used_idle_session():
    """Two slots: A's request is in flight (A the least recently used), B idles; C takes B's
    slot (B's next request gets CACHE_MISS), never A's; A and C decode exactly."""
    model = tiny_model("qwen2", seed=5)
    engine = TargetEngine(model, pooled(LIMITS, model, 2))
    a_prompt, b_prompt, c_prompt = list(range(10, 50)), list(range(60, 90)), [1, 2]
    refs = {p[0]: greedy_reference(model, p, 8) for p in (a_prompt, c_prompt)}
    assert all(gap > MARGIN for _, gap in refs.values())
    held = Held(engine, first_request("A", a_prompt))
    greedy_in_engine(engine, "B", b_prompt, 1)
    b_slot = engine.store.get("B").kv.slot
    evicted = engine.store.evicted
    assert greedy_in_engine(engine, "C", c_prompt, 8) == refs[c_prompt[0]][0]
    assert engine.store.evicted == evicted + 1 and "B" not in engine.store and "A" in engine.store
    assert engine.store.get("C").kv.slot == b_slot
    a_reply = held.go()
    assert isinstance(a_reply, VerifyReply) and a_reply.bonus_token_id == refs[a_prompt[0]][0][0]
    b_again = engine.handle(VerifyRequest(session_id="B", round=1, sync=CacheSync(base_len=len(b_prompt)),
                                          tree=_root(5), sampling=GREEDY))
    assert isinstance(b_again, ErrorReply) and b_again.code == ErrorCode.CACHE_MISS
    assert_in_pool(engine)


def test_a_pool_full_of_busy_sessions_refuses_a_new_one_and_changes_nothing():
    model = tiny_model("qwen3", seed=6)
    engine = TargetEngine(model, pooled(LIMITS, model, 1))
    greedy_in_engine(engine, "A", list(range(20, 50)), 2)
    a = engine.store.get("A")
    before = ([k.clone() for k in engine.kv_pool.keys], [v.clone() for v in engine.kv_pool.values],
              a.kv.length, a.last_round, engine.store.evicted, engine.store.bytes_by_session())
    with a.lock:  # a request is being served for A
        refused = engine.handle(first_request("B", [1, 2, 3]))
    assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.OVERLOADED and refused.retryable
    assert "B" not in engine.store and engine.store.get("A") is a
    after = (engine.kv_pool.keys, engine.kv_pool.values, a.kv.length, a.last_round, engine.store.evicted,
             engine.store.bytes_by_session())
    for x, y in zip(before[0] + before[1], after[0] + after[1]):
        assert torch.equal(x, y)
    assert before[2:] == after[2:]
    # once A is idle, B takes its slot
    assert isinstance(engine.handle(first_request("B", [1, 2, 3])), VerifyReply)
    assert "A" not in engine.store


def test_a_released_cache_refuses_every_write():
    model = tiny_model("llama", seed=7)
    shape = pool_shape(model, 32, torch.float32)
    pool = KVPool(shape, 1, torch.device("cpu"))
    kv = pool.make_kv()
    assert isinstance(kv, SessionKV) and pool.make_kv() is None
    kv.layers[0].update(torch.ones(1, 2, 4, 16), torch.ones(1, 2, 4, 16))
    kv.crop_to(2)
    assert kv.length == 2 and pool.keys[0][0, :, :4].eq(1).all()

    class S:  # what the store hands its on_evict: a session with a lock and a cache
        lock, draft_tree = threading.Lock(), object()

    s = S()
    s.kv = kv
    pool.release(s)
    assert kv.released and pool.free_slots == 1 and s.draft_tree is None
    with pytest.raises(RuntimeError, match="released"):
        kv.layers[0].update(torch.ones(1, 2, 1, 16), torch.ones(1, 2, 1, 16))
    with pytest.raises(ValueError, match="do not fit"):
        pool.make_kv().layers[0].update(torch.ones(1, 2, 1, 16, dtype=torch.float64),
                                        torch.ones(1, 2, 1, 16, dtype=torch.float64))


def test_a_batch_whose_compaction_fails_answers_every_member_and_serves_on():
    """The batched compaction failing (not the device) drops the members' sessions and answers
    each with a retryable INTERNAL error; the worker's engine serves the next requests (the
    clients resend from scratch: CACHE_MISS rebuilds the sessions)."""
    model = tiny_model("qwen2", seed=2)
    engine = TargetEngine(model, pooled(LIMITS, model, 4))
    rng = random.Random(9)
    cursors = {f"s{i}": SessionCursor([rng.randrange(128) for _ in range(12)]) for i in range(3)}
    for sid, cur in cursors.items():
        cur.apply_verify(engine.handle(VerifyRequest(session_id=sid, round=0, sync=cur.target_sync(),
                                                     tree=_root(cur.committed[-1]), sampling=GREEDY)))

    def tree(cur):  # a root and two children: an accepted second child is not in place
        return FlatTree(token_ids=[cur.committed[-1], 1, 2], parents=[-1, 0, 0])

    pool, real = engine.kv_pool, engine.kv_pool.compact_sessions
    pool.compact_sessions = lambda moves: (_ for _ in ()).throw(RuntimeError("index out of range"))
    replies = engine.verify_batch([VerifyRequest(session_id=sid, round=1, sync=cur.target_sync(), tree=tree(cur),
                                                 sampling=GREEDY) for sid, cur in cursors.items()])
    assert all(isinstance(r, ErrorReply) and r.code == ErrorCode.INTERNAL and r.retryable for r in replies), replies
    assert all(engine.store.get(sid) is None for sid in cursors)
    assert pool.free_slots + pool.retired == 4  # retired while the batch held them: free on the next take
    pool.compact_sessions = real
    for sid, cur in cursors.items():  # the client starts the session again: served as before
        fresh = SessionCursor(list(cur.committed))
        reply = engine.handle(VerifyRequest(session_id=sid, round=2, sync=fresh.target_sync(), tree=tree(fresh),
                                            sampling=GREEDY))
        assert isinstance(reply, VerifyReply), reply
