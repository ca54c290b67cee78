"""SessionStore bounds (LRU, TTL) and eviction under concurrent use."""

from __future__ import annotations

import random
import threading

from schemas import CacheSync, ErrorCode, ErrorReply, FlatTree, VerifyReply, VerifyRequest
from specsplit.engine.base import EngineLimits
from specsplit.engine.kvcache import SessionKV
from specsplit.engine.store import SessionStore
from specsplit.engine.target import TargetEngine
from tests.conftest import tiny_model


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_lru_and_ttl():
    clock = FakeClock()
    store = SessionStore(lambda: SessionKV(1, 8), max_sessions=2, ttl_s=10, clock=clock)
    store.get_or_create("a")
    store.get_or_create("b")
    store.get("a")  # a is now most recent
    store.get_or_create("c")  # evicts b
    assert "a" in store and "c" in store and "b" not in store
    clock.t = 5
    store.get("c")
    clock.t = 12  # a idle 12 s > ttl, c idle 7 s
    assert store.get("a") is None and store.get("c") is not None
    assert store.end_session("c") and not store.end_session("c")
    assert len(store) == 0 and store.evicted == 2


def test_bytes_reported():
    store = SessionStore(lambda: SessionKV(1, 64, chunk=8), max_sessions=4)
    s = store.get_or_create("x")
    import torch

    s.kv.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
    assert store.bytes_by_session() == {"x": 2 * 2 * 8 * 4 * 4}
    assert store.bytes_held() == 512


def test_eviction_under_concurrency_never_breaks_unrelated_requests():
    """Two threads serve many sessions against a store of 3: eviction only ever shows up as
    CACHE_MISS for the evicted session, never as an exception or another session's corruption."""
    model = tiny_model("llama", seed=9)
    eng = TargetEngine(model, EngineLimits(max_sessions=3, max_session_tokens=512))
    errors, results = [], {"ok": 0, "miss": 0}
    lock = threading.Lock()

    def client(tid: int):
        rng = random.Random(tid)
        lens: dict[str, int] = {}
        try:
            for i in range(120):
                sid = f"t{tid}-{rng.randrange(4)}"
                base = lens.get(sid, 0)
                req = VerifyRequest(session_id=sid, round=i, sync=CacheSync(base_len=base, append_token_ids=[1, 2] if base == 0 else []),
                                    tree=FlatTree(token_ids=[3, 4, 5], parents=[-1, 0, 0]))
                reply = eng.handle(req)
                with lock:
                    if isinstance(reply, VerifyReply):
                        lens[sid] = reply.cache_len
                        results["ok"] += 1
                    elif reply.code == ErrorCode.CACHE_MISS:
                        lens.pop(sid, None)
                        results["miss"] += 1
                    else:
                        errors.append(reply)
        except Exception as exc:  # noqa: BLE001 - the test records anything that escapes
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    assert results["ok"] > 100 and results["miss"] > 0, results
    assert len(eng.store) <= 3
