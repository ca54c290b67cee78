"""A router's placements (``WorkerRegistry.pick``): sessions stay on the worker they were routed
to while it is live (no sockets; tests/test_crash_only.py kills a target mid-prefill under honcho)."""

from __future__ import annotations

from brokers import rendezvous
from brokers.registry import WorkerRegistry
from specsplit.transport.testing import make_hello


def test_sessions_stay_with_their_worker_when_one_joins_or_comes_back():
    """Sessions routed before a worker joins (scaling out) or comes back (a crash, a new process
    in its slot) stay where their caches are; new sessions spread over all by the hash; only a
    lost worker's sessions move, and they stay where they moved. Past ``max_placements`` the
    least recently routed go by the hash again; an ended session's placement is forgotten, a
    group's kept."""
    reg = WorkerRegistry("target", ttl_s=10.0, max_placements=150)
    for w in (b"w0", b"w1"):
        assert reg.admit(w, make_hello(), now=0.0).ok
    old = {f"s{i}": reg.pick(f"s{i}") for i in range(60)}
    assert reg.admit(b"w2", make_hello(), now=0.0).ok  # scaled out
    assert {s: reg.pick(s) for s in old} == old
    fresh = [f"n{i}" for i in range(60)]
    assert {reg.pick(s) for s in fresh} == {b"w0", b"w1", b"w2"}
    assert all(reg.pick(s) == rendezvous.pick(s, reg.live) for s in fresh)

    moved = [s for s, w in old.items() if w == b"w0"]
    assert moved and reg.remove(b"w0")  # crashed: its sessions move to the hash over the others
    now = {s: reg.pick(s) for s in old}
    assert all(now[s] == rendezvous.pick(s, (b"w1", b"w2")) for s in moved)
    assert all(now[s] == w for s, w in old.items() if w != b"w0")
    assert reg.admit(b"w0", make_hello(), now=1.0).ok  # its slot's new process
    assert {s: reg.pick(s) for s in old} == now  # nothing moves back to an empty cache

    assert len(reg._placed) <= 150
    reg.ended(moved[0])
    assert moved[0] not in reg._placed
    reg.pick("conv~1")
    reg.ended("conv~1")
    assert "conv" in reg._placed
    for i in range(200):  # the oldest placements go: routed by the hash again
        reg.pick(f"later{i}")
    assert len(reg._placed) == 150 and all(reg.pick(s) == rendezvous.pick(s, reg.live) for s in moved[1:])
