"""Routers: rendezvous hashing, registry state, and a real router on loopback (no torch)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter

import pytest
import zmq

from brokers import rendezvous
from brokers.registry import EndCopies, Inflight, InflightTable, WorkerRegistry
from brokers.router import Router
from brokers.settings import RouterSettings, default_addresses
from schemas.codec import PROTO, MsgKind, decode, pack_frames
from schemas.messages import Ack, EndSession, ErrorCode, ErrorReply, Heartbeat, VerifyReply
from specsplit.transport.rpc import AsyncRpcClient
from specsplit.transport.sockets import make_socket
from specsplit.transport.testing import TEST_SECRET, authed_dealer, make_verify, EchoHandler, RouterThread, SilentWorker, WorkerThread, make_hello
from tests.conftest import async_wait_until

pytestmark = pytest.mark.timeout(30)

HB = dict(heartbeat_s=0.1, liveness=20)  # generous (2 s): router, workers and test share one GIL, and CI boxes are busy


verify = make_verify


@pytest.fixture
def router():
    with RouterThread("target", **HB) as rt:
        yield rt


# ------------------------------------------------------------------------------ rendezvous
def test_rendezvous_is_stable_and_order_independent():
    workers = [b"w%d" % i for i in range(5)]
    for i in range(200):
        sid = f"s{i}"
        first = rendezvous.pick(sid, workers)
        assert first == rendezvous.pick(sid, list(reversed(workers))) == rendezvous.rank(sid, workers)[0]
        assert first == rendezvous.pick(sid.encode(), workers)
    assert rendezvous.pick("s", []) is None


def test_rendezvous_moves_only_a_dead_workers_sessions():
    workers = [b"w%d" % i for i in range(5)]
    sessions = [f"session-{i}" for i in range(2000)]
    before = {s: rendezvous.pick(s, workers) for s in sessions}
    alive = [w for w in workers if w != b"w2"]
    after = {s: rendezvous.pick(s, alive) for s in sessions}
    moved = {s for s in sessions if before[s] != after[s]}
    assert moved == {s for s in sessions if before[s] == b"w2"}
    assert moved  # the dead worker held some sessions


def test_rendezvous_is_roughly_uniform():
    workers = [b"worker-%d" % i for i in range(8)]
    counts = Counter(rendezvous.pick(f"sess-{i}", workers) for i in range(16_000))
    assert set(counts) == set(workers)
    assert all(abs(c - 2000) < 250 for c in counts.values()), counts


def test_sessions_of_one_group_go_to_one_worker_and_groups_spread():
    """A session id "GROUP~UNIQUE" routes by its group (a conversation's turns, sharing a prefix
    cache); an id without a group, or with an empty one, by itself."""
    assert rendezvous.route_key("abc~123") == "abc" and rendezvous.route_key("abc~1~2") == "abc"
    assert rendezvous.route_key("~123") == "~123" and rendezvous.route_key("plain") == "plain"
    reg = WorkerRegistry("target", ttl_s=10.0)
    for w in (b"w0", b"w1", b"w2", b"w3"):
        assert reg.admit(w, make_hello(), now=0.0).ok
    for g in range(50):
        assert len({reg.pick(f"g{g}~{u}") for u in range(20)}) == 1
    assert len({reg.pick(f"g{g}~x") for g in range(200)}) == 4  # groups spread over the workers
    assert len({reg.pick(f"s{u}") for u in range(200)}) == 4


# -------------------------------------------------------------------------------- registry
def test_registry_admits_refuses_and_expires():
    reg = WorkerRegistry("target", ttl_s=1.0, max_workers=3)
    assert reg.admit(b"a", make_hello(), now=0.0).ok
    assert not reg.admit(b"b", make_hello(vocab_size=7), now=0.0).ok
    assert not reg.admit(b"c", make_hello(tokenizer_hash="other"), now=0.0).ok
    assert not reg.admit(b"d", make_hello("draft"), now=0.0).ok
    again = reg.admit(b"a", make_hello(), now=0.5)
    assert again.ok and again.replaced
    assert reg.admit(b"b", make_hello(), now=0.6).ok
    assert reg.live == (b"a", b"b")
    assert reg.touch(b"b", now=1.4) and not reg.touch(b"zz", now=1.4)
    assert reg.expire(now=1.55) == [b"a"]
    assert reg.live == (b"b",)
    # with only b left, a lone worker may re-register with a new profile
    assert reg.admit(b"b", make_hello(vocab_size=9), now=1.6).ok


def test_inflight_table_is_bounded_and_tracks_workers():
    t = InflightTable(max_entries=3, ttl_s=10.0)
    for i in range(3):
        assert t.add(Inflight(b"c", b"r%d" % i, "s", b"w1" if i < 2 else b"w2", float(i)))
    assert not t.add(Inflight(b"c", b"r9", "s", b"w1", 3.0))
    assert t.count(b"w1") == 2
    assert [e.request_id for e in t.pop_worker(b"w1")] == [b"r0", b"r1"]
    assert len(t) == 1 and t.pop(b"c", b"r2").worker_id == b"w2"
    t.add(Inflight(b"c", b"old", "s", b"w1", 0.0))
    t.add(Inflight(b"c", b"new", "s", b"w1", 20.0))
    assert [e.request_id for e in t.sweep(now=15.0)] == [b"old"] and len(t) == 1


def test_end_copies_keep_the_ends_an_expired_worker_missed_bounded():
    c = EndCopies(max_entries=4, away_ttl_s=100.0, max_owed=3, max_away=2)
    rid = c.next_id()
    assert len(rid) == 16 and rid != c.next_id()
    c.sent(rid, b"w1")
    assert not c.acked(rid, b"w2") and not c.acked(b"client-8", b"w1") and c.acked(rid, b"w1")
    assert not c.acked(rid, b"w1") and len(c) == 0  # acked once
    c.owe("before", now=0.0)  # nobody away: nothing kept
    c.away(b"w1", now=1.0)
    for i in range(5):
        c.owe(f"end{i}", now=2.0)
    assert c.back(b"w1", now=3.0) == ["end2", "end3", "end4"]  # the newest max_owed
    assert c.back(b"w1", now=3.0) == [] and c.back(b"never", now=3.0) == []
    c.away(b"a", now=10.0)
    c.away(b"b", now=20.0)
    c.away(b"c", now=30.0)  # max_away: a is forgotten
    c.owe("x", now=40.0)
    assert c.back(b"a", now=41.0) == [] and c.back(b"b", now=41.0) == ["x"]
    c.owe("y", now=135.0)  # c away 105 s > away_ttl_s: dropped, nothing kept
    assert c.back(b"c", now=136.0) == []


# -------------------------------------------------------------------------------- settings
def test_settings_defaults_env_and_loopback_guard(monkeypatch):
    assert default_addresses("draft") == ("tcp://127.0.0.1:5550", "tcp://127.0.0.1:5551")
    s = RouterSettings(service="target")
    assert (s.frontend_addr, s.backend_addr) == default_addresses("target")
    monkeypatch.setenv("SPECSPLIT_HEARTBEAT_S", "0.5")
    monkeypatch.setenv("SPECSPLIT_FRONTEND_ADDR", "ipc:///tmp/x-fe")
    s = RouterSettings(service="draft")
    assert s.heartbeat_s == 0.5 and s.frontend_addr == "ipc:///tmp/x-fe"
    assert s.backend_addr == "tcp://127.0.0.1:5551"
    monkeypatch.delenv("SPECSPLIT_FRONTEND_ADDR")
    monkeypatch.setenv("SPECSPLIT_TARGET_BACKEND", "ipc:///tmp/x-tbe")  # the fleet-wide name
    s = RouterSettings(service="target")
    assert (s.frontend_addr, s.backend_addr) == ("tcp://127.0.0.1:5560", "ipc:///tmp/x-tbe")
    with pytest.raises(ValueError):
        RouterSettings(service="draft", frontend_addr="tcp://0.0.0.0:5550")
    with pytest.raises(ValueError):
        Router("draft", "tcp://*:5550", "tcp://127.0.0.1:5551")


# ------------------------------------------------------------------------------ the router
async def test_sessions_stick_to_their_rendezvous_worker(router):
    ids = [b"worker-a", b"worker-b", b"worker-c"]
    workers = [WorkerThread(router.backend, wid, EchoHandler(tag=i), **HB).start() for i, wid in enumerate(ids)]
    try:
        router.wait_live(3)
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            seen: dict[str, set[int]] = {}
            for rnd in range(3):
                for i in range(30):
                    sid = f"sticky-{i}"
                    reply = await client.call(verify(sid, rnd), session_id=sid, timeout_s=5)
                    assert isinstance(reply, VerifyReply) and reply.round == rnd
                    seen.setdefault(sid, set()).add(reply.cache_len)
        for sid, tags in seen.items():
            assert tags == {ids.index(rendezvous.pick(sid, ids))}
        assert len(set().union(*seen.values())) == 3
    finally:
        for w in workers:
            assert w.stop() == 0


async def test_no_worker_is_answered_at_once(router):
    async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
        reply = await client.call(verify("lonely"), session_id="lonely", timeout_s=5)
    # an answer at all, not RpcTimeout: the router answered instead of holding the request
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.NO_WORKER and reply.retryable
    assert reply.session_id == "lonely" and router.router.stats.no_worker == 1


def _raw_roundtrip(sock: zmq.Socket, frames: list[bytes]) -> list[bytes]:
    sock.send_multipart(frames)
    assert sock.poll(3000), "no reply"
    return sock.recv_multipart()


def test_malformed_frames_get_typed_errors_and_the_router_keeps_serving(router):
    with WorkerThread(router.backend, b"w", **HB):
        ctx = zmq.Context()
        sock = authed_dealer(ctx, router.frontend)
        body = pack_frames(verify("s1"), "s1", b"r1")[4]
        cases = [
            ([b"just one frame"], "-", b"-"),
            ([b"XXXX", MsgKind.VERIFY_REQUEST.as_byte(), b"s1", b"r1", body], "s1", b"r1"),
            ([PROTO, b"\x7f", b"s1", b"r2", body], "s1", b"r2"),
            ([PROTO, b"\x03\x03", b"s1", b"r3", body], "s1", b"r3"),
            ([PROTO, MsgKind.VERIFY_REQUEST.as_byte(), b"\xff\xfe", b"r4", body], "-", b"r4"),
            ([PROTO, MsgKind.VERIFY_REQUEST.as_byte(), b"s1", b"", body], "s1", b"-"),
            ([PROTO, MsgKind.WORKER_HELLO.as_byte(), b"s1", b"r5", body], "s1", b"r5"),
            ([PROTO, MsgKind.VERIFY_REQUEST.as_byte(), b"s1", b"r6", b"\xc1garbage"], "s1", b"r6"),  # worker
            ([PROTO, MsgKind.VERIFY_REQUEST.as_byte(), b"s1", b"r7", b"\x93\x01\x02\x03"], "s1", b"r7"),
        ]
        try:
            for frames, sid, rid in cases:
                reply = _raw_roundtrip(sock, frames)
                assert reply[0] == PROTO and reply[1] == MsgKind.ERROR.as_byte(), frames
                assert (reply[2].decode(), reply[3]) == (sid, rid)
                err = decode(reply[1], reply[4])
                assert err.code is ErrorCode.BAD_REQUEST and not err.retryable
            good = _raw_roundtrip(sock, pack_frames(verify("s1", 4), "s1", b"ok"))
            assert good[1] == MsgKind.VERIFY_REPLY.as_byte() and decode(good[1], good[4]).round == 4
        finally:
            sock.close()
            ctx.term()
    assert router.router.stats.bad_frames >= 7


def test_garbage_on_the_backend_does_not_kill_the_router(router):
    ctx = zmq.Context()
    junk = make_socket(ctx, zmq.DEALER, identity=b"junk", connect=router.backend)
    try:
        for frames in ([b"x"], [b"", b"x"], [b"", PROTO, b"\x11", b"-", b"hb"], [b"client", b"nonsense"],
                       [b"", PROTO, MsgKind.WORKER_HELLO.as_byte(), b"-", b"h", b"\xc1"]):
            junk.send_multipart(frames)
        while True:  # first "unknown worker: send WORKER_HELLO", then the undecodable hello refused
            assert junk.poll(3000)
            reply = junk.recv_multipart()
            assert reply[0] == b"" and reply[2] == MsgKind.ERROR.as_byte()
            if reply[4] == b"h":
                break
        refusal = decode(reply[2], reply[5])  # an unauthenticated peer is told nothing more
        assert refusal.code is ErrorCode.UNAUTHENTICATED and refusal.message == "authentication refused"
        with WorkerThread(router.backend, b"w", **HB):
            sock = authed_dealer(ctx, router.frontend)
            good = _raw_roundtrip(sock, pack_frames(verify("s1"), "s1", b"ok"))
            sock.close()
        assert good[1] == MsgKind.VERIFY_REPLY.as_byte()
        assert b"junk" not in router.live_workers()
    finally:
        junk.close()
        ctx.term()


def test_hello_mismatch_is_refused(router):
    with WorkerThread(router.backend, b"good", **HB):
        bad_vocab = WorkerThread(router.backend, b"bad-vocab", hello=make_hello(vocab_size=5), **HB)
        bad_service = WorkerThread(router.backend, b"bad-service", hello=make_hello("draft"), **HB)
        bad_vocab.start(wait_ready=False)
        bad_service.start(wait_ready=False)
        assert bad_vocab.join(5) == 2 and bad_service.join(5) == 2
        assert router.live_workers() == (b"good",)
        assert router.router.stats.workers_refused == 2


async def test_expired_worker_fails_its_inflight_and_only_its_sessions_move(router):
    ids = [b"alive-1", b"alive-2", b"stuck"]
    workers = [WorkerThread(router.backend, wid, EchoHandler(tag=i), **HB).start() for i, wid in enumerate(ids[:2])]
    stuck = SilentWorker(router.backend, b"stuck").start()
    try:
        router.wait_live(3)
        sessions = [f"move-{i}" for i in range(40)]
        owner = {s: rendezvous.pick(s, ids) for s in sessions}
        on_stuck = [s for s in sessions if owner[s] == b"stuck"]
        assert on_stuck and len(on_stuck) < len(sessions)
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            before = {}
            for s in sessions:
                if owner[s] != b"stuck":
                    before[s] = (await client.call(verify(s), session_id=s, timeout_s=5)).cache_len
            pending = asyncio.ensure_future(client.call(verify(on_stuck[0]), session_id=on_stuck[0], timeout_s=20))
            await async_wait_until(lambda: len(stuck.requests) == 1, 20, "the stuck worker holds the request")
            assert not pending.done()
            stuck.stop_heartbeats()
            reply = await pending  # answered on expiry (2 s), not by the call's timeout (RpcTimeout)
            assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.NO_WORKER and reply.retryable
            assert reply.session_id == on_stuck[0]
            router.wait_live(2)
            for s in sessions:
                reply = await client.call(verify(s), session_id=s, timeout_s=5)
                assert isinstance(reply, VerifyReply)
                if s in before:
                    assert reply.cache_len == before[s]  # did not move
                else:
                    assert ids[reply.cache_len] == rendezvous.pick(s, ids[:2])
        stats = router.router.stats
        assert stats.workers_expired == 1 and stats.workers_lost == 0 and stats.inflight_failed == 1
    finally:
        stuck.close()
        for w in workers:
            w.stop()


class _Ends(EchoHandler):
    """EchoHandler that records the sessions it was told to end."""

    def __init__(self, tag: int) -> None:
        super().__init__(tag=tag)
        self.ended: list[str] = []

    def __call__(self, msg):
        if isinstance(msg, EndSession):
            self.ended.append(msg.session_id.split("/")[-1])  # the worker scopes ids to the client
        return super().__call__(msg)


async def test_end_session_reaches_every_worker_and_is_answered_once(router):
    """A session that moved (its worker expired and came back) may have caches on two workers:
    its END_SESSION goes to its worker, which answers it, and a copy to every other, whose acks
    the router drops without counting them as unsolicited."""
    handlers = {b"ea": _Ends(1), b"eb": _Ends(2), b"ec": _Ends(3)}
    workers = [WorkerThread(router.backend, i, h, **HB).start() for i, h in handlers.items()]
    try:
        router.wait_live(3)
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            for sid in ("gone-1", "gone-2"):
                reply = await client.call(EndSession(session_id=sid), session_id=sid, timeout_s=5)
                assert isinstance(reply, Ack) and reply.session_id == sid
            await async_wait_until(lambda: all(h.ended == ["gone-1", "gone-2"] for h in handlers.values()), 10,
                                   "every worker ended both sessions")
            # the copies' acks are consumed, not delivered: the next call gets its own reply
            reply = await client.call(verify("after"), session_id="after", timeout_s=5)
            assert isinstance(reply, VerifyReply) and reply.cache_len == handlers[rendezvous.pick("after", list(handlers))].tag
        stats = router.router.stats
        await async_wait_until(lambda: not router.router._copies, 10, "every copy acked")
        assert stats.ends_copied == 4 and stats.unsolicited_replies == 0 and len(router.router.inflight) == 0
        assert stats.replies == 3
    finally:
        for w in workers:
            w.stop()


async def test_restarted_worker_reclaims_its_identity(router):
    """A worker that died (its connection gone) and comes back under its identity is admitted
    again. (While the old connection lives, no second one can take the identity: there is no
    ROUTER_HANDOVER; see test_admission.py.)"""
    old = SilentWorker(router.backend, b"same-id").start()
    try:
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            lost = asyncio.ensure_future(client.call(verify("s"), session_id="s", timeout_s=10))
            await async_wait_until(lambda: len(old.requests) == 1, 20, "the old worker holds the request")
            old.close()  # the old process dies
            reply = await lost
            assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.NO_WORKER and reply.retryable
            with WorkerThread(router.backend, b"same-id", EchoHandler(tag=7), **HB):
                reply = await client.call(verify("s", 1), session_id="s", timeout_s=5)
                assert isinstance(reply, VerifyReply) and reply.cache_len == 7
    finally:
        old.close()


async def test_vanished_worker_or_client_does_not_stall_the_router(router):
    gone = SilentWorker(router.backend, b"gone").start()
    gone.close()  # its socket is gone; the router still lists it until a send fails or it expires
    with WorkerThread(router.backend, b"here", EchoHandler(delay_s=0.05), **HB):
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            for i in range(10):
                reply = await client.call(verify(f"v{i}"), session_id=f"v{i}", timeout_s=3)
                assert isinstance(reply, (VerifyReply, ErrorReply))
                if isinstance(reply, ErrorReply):
                    assert reply.retryable
        # a client that leaves before its reply: the router logs EHOSTUNREACH and goes on
        stats = router.router.stats
        routed, replies = stats.routed, stats.replies
        ctx = zmq.Context()
        sock = authed_dealer(ctx, router.frontend)
        sock.send_multipart(pack_frames(verify("bye"), "bye", b"r"))
        await async_wait_until(lambda: stats.routed > routed, 20, "the request reached the worker")
        sock.close()
        ctx.term()
        await async_wait_until(lambda: stats.replies > replies, 20, "the router had the reply for the gone client")
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            assert isinstance(await client.call(verify("after"), session_id="after", timeout_s=3), VerifyReply)
        assert router.live_workers() == (b"here",)


async def test_killed_worker_is_dropped_on_disconnect_before_expiry():
    with RouterThread("target", heartbeat_s=0.1, liveness=50) as rt:  # expiry would take 5 s
        gone = SilentWorker(rt.backend, b"killed").start()
        try:
            async with AsyncRpcClient(rt.frontend, secret=TEST_SECRET) as client:
                lost = asyncio.ensure_future(client.call(verify("k"), session_id="k", timeout_s=20))
                await async_wait_until(lambda: len(gone.requests) == 1, 20, "the worker holds the request")
                gone.close()  # the process vanishes: its connection drops
                reply = await lost
                assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.NO_WORKER
            assert rt.live_workers() == ()
            # dropped on the disconnect, not at expiry (5 s) nor by the call's timeout
            assert rt.router.stats.workers_lost == 1 and rt.router.stats.workers_expired == 0
        finally:
            gone.close()


async def test_router_answers_pings(router):
    async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
        reply = await client.ping()
    assert type(reply).__name__ == "Heartbeat"


def test_a_ping_names_the_workers_tokenizer_to_authenticated_clients_only(router):
    """The fleet's tokenizer (what the HTTP API checks its own against) is told to a client that
    proved the fleet secret, never to anyone who can reach the port."""
    ctx = zmq.Context.instance()
    worker = WorkerThread(router.backend, b"w-tok", hello=make_hello(tokenizer_hash="abc123", vocab_size=777),
                          **HB).start()
    authed = authed_dealer(ctx, router.frontend)
    anyone = make_socket(ctx, zmq.DEALER, connect=router.frontend)
    try:
        for sock, want in ((authed, ("abc123", 777)), (anyone, ("", 0))):
            sock.send_multipart(pack_frames(Heartbeat(), "-", b"p1"))
            assert sock.poll(5000)
            frames = sock.recv_multipart()
            pong = decode(frames[1], frames[4])
            assert isinstance(pong, Heartbeat) and (pong.tokenizer_hash, pong.vocab_size) == want
    finally:
        authed.close(linger=0)
        anyone.close(linger=0)
        worker.stop()


# --------------------------------------------------------------------- processes, imports
def test_python_m_brokers_runs_and_exits_cleanly_on_sigterm():
    tmp = tempfile.mkdtemp(prefix="ssb")
    fe, be = f"ipc://{tmp}/fe", f"ipc://{tmp}/be"
    proc = subprocess.Popen(
        [sys.executable, "-m", "brokers", "draft", "--frontend", fe, "--backend", be, "--heartbeat-s", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "SPECSPLIT_FLEET_SECRET": TEST_SECRET.decode()},
    )
    ctx = zmq.Context()
    sock = authed_dealer(ctx, fe)
    try:
        sock.send_multipart(pack_frames(verify("p"), "p", b"r1"))
        assert sock.poll(15_000), "router did not answer"
        reply = sock.recv_multipart()
        assert decode(reply[1], reply[4]).code is ErrorCode.NO_WORKER
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert b"router_stopped" in proc.stdout.read()
    finally:
        sock.close()
        ctx.term()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_brokers_and_transport_never_import_torch():
    code = (
        "import sys, brokers, brokers.router, brokers.settings, brokers.__main__, "
        "specsplit.transport.rpc, specsplit.transport.worker_loop, specsplit.transport.testing\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_layers_brokers_need_nothing_from_specsplit_and_orchestrator_no_torch():
    """brokers/ depends on schemas and zmq only; the orchestrator and client never import torch."""
    code = (
        "import sys, brokers, brokers.router, brokers.settings, brokers.__main__\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('specsplit', 'torch', 'transformers')]\n"
        "assert not bad, bad\n"
        "import specsplit.orchestrator.server, specsplit.orchestrator.actor, specsplit.client\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
