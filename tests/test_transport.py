"""Transport: socket factory, AsyncRpcClient and WorkerLoop on real loopback sockets (no torch)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq
import zmq.asyncio

from schemas.codec import PROTO, MsgKind, pack_frames, unpack_frames
from schemas.messages import (
    CacheSync,
    ErrorCode,
    ErrorReply,
    FlatTree,
    Message,
    VerifyReply,
    VerifyRequest,
)
from specsplit.transport.rpc import AsyncRpcClient, RpcClosed, RpcTimeout
from specsplit.transport.sockets import endpoint, is_loopback_address, make_socket, recv_frames, send_frames
from specsplit.transport.testing import TEST_SECRET, authed_dealer, make_verify, EchoHandler, RouterThread, WorkerThread
from specsplit.transport.worker_loop import small_request
from tests.conftest import async_wait_until

pytestmark = pytest.mark.timeout(30)

HB = dict(heartbeat_s=0.1, liveness=20)  # generous (2 s): router, workers and test share one GIL, and CI boxes are busy
# the fast path's budget where a test needs it open: an echo takes microseconds, but on a busy box
# the thread measuring it may wait for the GIL far longer than the default (heartbeat_s / 4)
INLINE_MAX_S = 1.0


verify = make_verify


@pytest.fixture
def router():
    with RouterThread("target", **HB) as rt:
        yield rt


@pytest.fixture
async def silent_router():
    """A bare ROUTER on loopback that the test drives by hand (it answers only when told)."""
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    yield sock
    sock.close()
    ctx.term()


# ------------------------------------------------------------------------------- sockets
def test_make_socket_sets_every_option():
    ctx = zmq.Context()
    try:
        r = make_socket(ctx, zmq.ROUTER, router_handover=True, sndhwm=7, rcvhwm=9, bind="tcp://127.0.0.1:*")
        assert r.getsockopt(zmq.LINGER) == 0
        assert (r.getsockopt(zmq.SNDHWM), r.getsockopt(zmq.RCVHWM)) == (7, 9)
        assert endpoint(r).startswith("tcp://127.0.0.1:")
        d = make_socket(ctx, zmq.DEALER, identity=b"me", connect=endpoint(r))
        assert d.getsockopt(zmq.IDENTITY) == b"me"
        d.send(b"x")
        assert r.recv_multipart() == [b"me", b"x"]
        with pytest.raises(zmq.ZMQError):  # ROUTER_MANDATORY: an unknown peer is an error
            r.send_multipart([b"nobody", b"x"])
        with pytest.raises(ValueError):
            make_socket(ctx, zmq.DEALER, router_handover=True)
        with pytest.raises(ValueError):
            make_socket(ctx, zmq.DEALER, identity=b"\x00reserved")
        for s in (r, d):
            s.close()
    finally:
        ctx.term()
    actx = zmq.asyncio.Context()
    s = make_socket(actx, zmq.DEALER)
    assert isinstance(s, zmq.asyncio.Socket)
    s.close()
    actx.term()


def test_send_frames_and_recv_frames_match_pyzmqs_multipart():
    ctx = zmq.Context()
    try:
        r = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
        d = make_socket(ctx, zmq.DEALER, identity=b"me", connect=endpoint(r))
        frames = [PROTO, b"\x03", b"s", b"rid", b"x" * 1000, b""]
        send_frames(d, frames)
        assert r.poll(3000)
        got = recv_frames(r)
        assert got == [b"me", *frames]
        send_frames(r, got)
        assert d.poll(3000) and d.recv_multipart() == frames
        with pytest.raises(zmq.Again):
            recv_frames(d)
        with pytest.raises(zmq.ZMQError):  # ROUTER_MANDATORY still raises at the first frame
            send_frames(r, [b"nobody", b"x"])
        for s in (r, d):
            s.close()
    finally:
        ctx.term()


def test_is_loopback_address():
    for a in ("tcp://127.0.0.1:1", "tcp://localhost:1", "tcp://[::1]:1", "ipc:///tmp/x", "inproc://x"):
        assert is_loopback_address(a), a
    for a in ("tcp://*:1", "tcp://0.0.0.0:1", "tcp://10.0.0.1:1", "tcp://eth0:1"):
        assert not is_loopback_address(a), a


# ---------------------------------------------------------------------------- rpc client
async def test_call_times_out_with_a_typed_error_and_drops_the_pending_entry(silent_router):
    async with AsyncRpcClient(endpoint(silent_router)) as client:
        t0 = time.monotonic()
        with pytest.raises(RpcTimeout) as info:
            await client.call(verify("s"), session_id="s", timeout_s=0.2)
        # at its own timeout: not early, and not at the client's default (10 s; the margin is no stall)
        assert 0.15 < time.monotonic() - t0 < 5.0
        assert info.value.session_id == "s" and isinstance(info.value, TimeoutError)
        assert client.pending == 0


async def test_late_and_malformed_replies_are_dropped(silent_router):
    async with AsyncRpcClient(endpoint(silent_router)) as client:
        with pytest.raises(RpcTimeout):
            await client.call(verify("s"), session_id="s", timeout_s=0.1)
        late = await silent_router.recv_multipart()
        cid, env = late[0], late[1:]
        reply = VerifyReply(session_id="s", round=0, accepted_token_ids=[], bonus_token_id=1, cache_len=0)
        await silent_router.send_multipart([cid, *pack_frames(reply, "s", env[3])])  # late: dropped
        await silent_router.send_multipart([cid, b"garbage"])  # malformed envelope: dropped

        async def answer(body: bytes | None) -> None:
            req = await silent_router.recv_multipart()
            frames = pack_frames(reply.model_copy(update={"round": 1}), "s", req[4])
            await silent_router.send_multipart([req[0], *frames[:4], body or frames[4]])

        task = asyncio.ensure_future(answer(None))
        got = await client.call(verify("s", 1), session_id="s", timeout_s=10)
        await task
        assert isinstance(got, VerifyReply) and got.round == 1
        # a well-addressed reply with an undecodable body fails the call at once (no timeout)
        task = asyncio.ensure_future(answer(b"\xc1"))
        got = await client.call(verify("s", 2), session_id="s", timeout_s=5)
        await task
        assert isinstance(got, ErrorReply) and got.code is ErrorCode.INTERNAL
        assert client.pending == 0


async def test_pending_map_is_bounded_and_close_fails_pending_calls(silent_router):
    client = AsyncRpcClient(endpoint(silent_router), max_pending=2)
    calls = [asyncio.ensure_future(client.call(verify(f"s{i}"), session_id=f"s{i}", timeout_s=10)) for i in range(2)]
    await async_wait_until(lambda: client.pending == 2, 20, "two calls pending")
    over = await client.call(verify("s9"), session_id="s9", timeout_s=10)
    assert isinstance(over, ErrorReply) and over.code is ErrorCode.OVERLOADED and over.retryable
    await client.close()
    for c in calls:
        with pytest.raises(RpcClosed):
            await c
    with pytest.raises(RpcClosed):
        await client.call(verify("s"), session_id="s", timeout_s=1)


async def test_hundreds_of_concurrent_calls_resolve_to_their_own_replies(router):
    with WorkerThread(router.backend, b"w1", **HB), WorkerThread(router.backend, b"w2", **HB):
        router.wait_live(2)
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            sids = [f"conc-{i}" for i in range(600)]
            replies = await asyncio.gather(
                *(client.call(verify(s, i), session_id=s, timeout_s=10) for i, s in enumerate(sids))
            )
            assert client.pending == 0
    for i, (s, r) in enumerate(zip(sids, replies)):
        assert isinstance(r, VerifyReply) and (r.session_id, r.round) == (s, i)


# --------------------------------------------------------------------------- worker loop
class Refusal(Exception):
    def to_reply(self) -> ErrorReply:
        return ErrorReply.of(ErrorCode.CACHE_MISS, "no cache for this session")


def _failing_handler(msg: Message) -> Message:
    if isinstance(msg, VerifyRequest) and msg.round == 1:
        raise RuntimeError("boom")
    if isinstance(msg, VerifyRequest) and msg.round == 2:
        raise Refusal()
    if isinstance(msg, VerifyRequest) and msg.round == 3:
        return "not a message"  # type: ignore[return-value]
    return EchoHandler()(msg)


async def test_worker_turns_handler_failures_into_typed_errors(router):
    with WorkerThread(router.backend, b"w", _failing_handler, **HB):
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            boom = await client.call(verify("s", 1), session_id="s", timeout_s=5)
            assert isinstance(boom, ErrorReply) and boom.code is ErrorCode.INTERNAL and "boom" in boom.message
            refusal = await client.call(verify("s", 2), session_id="s", timeout_s=5)
            assert isinstance(refusal, ErrorReply) and refusal.code is ErrorCode.CACHE_MISS
            assert refusal.session_id == "s"
            junk = await client.call(verify("s", 3), session_id="s", timeout_s=5)
            assert isinstance(junk, ErrorReply) and junk.code is ErrorCode.INTERNAL
            ok = await client.call(verify("s", 4), session_id="s", timeout_s=5)
            assert isinstance(ok, VerifyReply) and ok.round == 4


def _raw_call(addr: str, frames: list[bytes]) -> list[bytes]:
    ctx = zmq.Context()
    sock = authed_dealer(ctx, addr)
    try:
        sock.send_multipart(frames)
        assert sock.poll(3000)
        return sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize("may_inline", [None, small_request], ids=["engine-thread", "fast-path"])
def test_worker_answers_a_garbage_body_with_bad_request(router, may_inline):
    with WorkerThread(router.backend, b"w", may_inline=may_inline, inline_max_s=INLINE_MAX_S, **HB) as worker:
        for attempt in range(2):  # the second pass meets the fast path (the kind is measured by then)
            for body in (b"\xc1", b"\x01", b"\x81\xa3foo\x01"):
                reply = _raw_call(router.frontend, [PROTO, MsgKind.VERIFY_REQUEST.as_byte(), b"s", b"r", body])
                env = unpack_frames(reply)
                assert env.request_id == b"r" and env.msg.code is ErrorCode.BAD_REQUEST
            ok = unpack_frames(_raw_call(router.frontend, pack_frames(verify("s", attempt), "s", b"r2")))
            assert isinstance(ok.msg, VerifyReply) and ok.msg.round == attempt
        assert worker.loop.inline_served == (1 if may_inline else 0)


class _Gate:
    """A handler that blocks until released (a long forward)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, msg: Message) -> Message:
        self.entered.set()
        assert self.release.wait(10)
        return EchoHandler()(msg)


class _ThreadRecorder:
    """An echo handler that records which thread served each round; round ``gate_round`` blocks
    until released."""

    def __init__(self, gate_round: int = -1) -> None:
        self.threads: dict[int, str] = {}
        self.gate_round, self.gate = gate_round, _Gate()

    def __call__(self, msg: Message) -> Message:
        self.threads[msg.round] = threading.current_thread().name
        if msg.round == self.gate_round:
            return self.gate(msg)
        return EchoHandler()(msg)


async def test_fast_path_serves_small_requests_on_the_socket_thread_while_the_engine_is_idle(router):
    rec = _ThreadRecorder(gate_round=5)
    policy = lambda m: isinstance(m, VerifyRequest) and m.round != 5  # round 5: a long forward  # noqa: E731
    with WorkerThread(router.backend, b"w", rec, may_inline=policy, inline_max_s=INLINE_MAX_S, **HB) as worker:
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            for rnd in (0, 1, 2):
                reply = await client.call(verify("s", rnd), session_id="s", timeout_s=5)
                assert isinstance(reply, VerifyReply) and reply.round == rnd
            # the first request of a kind measures it on the engine thread; then the fast path
            assert rec.threads[0] == "specsplit-engine"
            assert rec.threads[1] == rec.threads[2] != "specsplit-engine"
            assert worker.loop.inline_served == 2
            # a request the policy refuses goes to the engine thread; while it is busy, small
            # requests queue behind it (one handler at a time, arrival order kept)
            slow = asyncio.ensure_future(client.call(verify("s", 5), session_id="s", timeout_s=5))
            await asyncio.to_thread(rec.gate.entered.wait, 5)
            behind = asyncio.ensure_future(client.call(verify("t", 6), session_id="t", timeout_s=5))
            await async_wait_until(lambda: worker.loop.queue_depth() == 1, 20, "round 6 queued")
            assert not behind.done() and 6 not in rec.threads
            rec.gate.release.set()
            assert (await slow).round == 5 and (await behind).round == 6
            assert rec.threads[5] == rec.threads[6] == "specsplit-engine"
            again = await client.call(verify("s", 7), session_id="s", timeout_s=5)
            assert again.round == 7 and rec.threads[7] != "specsplit-engine"
            assert worker.loop.inline_served == 3


def test_small_request_policy_keeps_prefills_and_growth_off_the_socket_thread():
    from schemas.messages import DraftRequest, EndSession, GrowRequest

    tree = FlatTree(token_ids=[1] * 16, parents=[-1] + list(range(15)))
    assert small_request(VerifyRequest(session_id="s", round=1, sync=CacheSync(base_len=9, append_token_ids=[3] * 4),
                                       tree=tree))
    assert not small_request(VerifyRequest(session_id="s", round=0, sync=CacheSync(base_len=0, append_token_ids=[3] * 60),
                                           tree=tree))  # a prompt prefill
    assert small_request(DraftRequest(session_id="s", round=1, sync=CacheSync(base_len=9, append_token_ids=[3]), root=2))
    assert not small_request(DraftRequest(session_id="s", round=0, sync=CacheSync(base_len=0, append_token_ids=[3] * 500),
                                          root=2))
    assert not small_request(GrowRequest(session_id="s", round=1, budget_ms=50.0))
    assert small_request(EndSession(session_id="s"))


async def test_fast_path_skips_kinds_slower_than_its_budget(router):
    rec = _ThreadRecorder()
    slow = EchoHandler(delay_s=0.05)  # > heartbeat_s / 4 = 0.025 s

    def handler(msg: Message) -> Message:
        rec(msg)
        return slow(msg)

    with WorkerThread(router.backend, b"w", handler, may_inline=small_request, **HB) as worker:
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            for rnd in range(4):
                assert (await client.call(verify("s", rnd), session_id="s", timeout_s=5)).round == rnd
        assert worker.loop.inline_served == 0
        assert set(rec.threads.values()) == {"specsplit-engine"}


async def test_full_queue_is_answered_overloaded_at_once(router):
    gate = _Gate()
    with WorkerThread(router.backend, b"w", gate, max_queue=1, **HB) as worker:
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            first = asyncio.ensure_future(client.call(verify("a"), session_id="a", timeout_s=5))
            await asyncio.to_thread(gate.entered.wait, 5)
            queued = asyncio.ensure_future(client.call(verify("b"), session_id="b", timeout_s=5))
            await async_wait_until(lambda: worker.loop.queue_depth() == 1, 20, "b queued")
            over = await client.call(verify("c"), session_id="c", timeout_s=5)
            assert isinstance(over, ErrorReply) and over.code is ErrorCode.OVERLOADED and over.retryable
            gate.release.set()
            assert isinstance(await first, VerifyReply) and isinstance(await queued, VerifyReply)


async def test_worker_keeps_heartbeating_while_the_handler_blocks(router):
    busy_s = 1.5 * HB["heartbeat_s"] * HB["liveness"]  # longer than the router waits for a beat
    with WorkerThread(router.backend, b"w", EchoHandler(delay_s=busy_s), **HB):
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            reply = await client.call(verify("slow"), session_id="slow", timeout_s=busy_s + 10)
        assert isinstance(reply, VerifyReply)
        stats = router.router.stats  # busy past the router's liveness window, yet never expired
        assert stats.workers_expired == stats.workers_lost == 0 and router.live_workers() == (b"w",)


async def test_stop_finishes_the_request_in_hand_and_returns_zero(router):
    gate = _Gate()
    worker = WorkerThread(router.backend, b"w", gate, **HB).start()
    async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
        in_hand = asyncio.ensure_future(client.call(verify("a"), session_id="a", timeout_s=20))
        await asyncio.to_thread(gate.entered.wait, 5)
        queued = asyncio.ensure_future(client.call(verify("b"), session_id="b", timeout_s=20))
        await async_wait_until(lambda: worker.loop.queue_depth() == 1, 20, "b queued")
        worker.stop_event.set()
        rejected = await queued  # answered while a is still in hand: the stop turned it away
        assert isinstance(rejected, ErrorReply) and rejected.retryable and not in_hand.done()
        gate.release.set()
        assert isinstance(await in_hand, VerifyReply)
    assert await asyncio.to_thread(worker.join, 5) == 0


async def test_worker_reconnects_to_a_restarted_router():
    first = RouterThread("target", **HB).start()
    frontend, backend = first.frontend, first.backend
    worker = WorkerThread(backend, b"w", reconnect_max_s=0.4, **HB).start()
    try:
        first.stop()
        # the worker notices the silence (2 s) and backs off; the waits only guard a hang
        await async_wait_until(lambda: not worker.loop.ready.is_set(), 20, "the worker noticed the silence")
        with RouterThread("target", frontend, backend, **HB) as second:
            await asyncio.to_thread(second.wait_live, 1, 20.0)
            async with AsyncRpcClient(frontend, secret=TEST_SECRET) as client:
                reply = await client.call(verify("again"), session_id="again", timeout_s=5)
            assert isinstance(reply, VerifyReply)
    finally:
        assert worker.stop() == 0


async def test_engine_loop_runs_on_the_compute_thread_that_built_the_engine(router):
    """A real worker loads its model on a ComputeThread and hands it to the loop: every request
    is handled on that very thread (one OpenMP master per process, specsplit.compute)."""
    from specsplit.compute import ComputeThread

    compute = ComputeThread(name="compute-under-test")
    built_on = compute.call(lambda: threading.get_ident())
    seen: list[int] = []

    def handler(msg: Message) -> Message:
        seen.append(threading.get_ident())
        return EchoHandler()(msg)

    with WorkerThread(router.backend, b"w", handler, compute=compute, **HB):
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
            for rnd in range(3):
                assert (await client.call(verify("s", rnd), session_id="s", timeout_s=5)).round == rnd
    assert seen == [built_on] * 3 and built_on != threading.get_ident()


def test_compute_thread_runs_in_order_and_hands_back_results_and_errors():
    from specsplit.compute import ComputeThread

    compute = ComputeThread()
    order: list[int] = []
    tasks = [compute.submit(lambda i=i: order.append(i) or i * i) for i in range(5)]
    assert [t.result(timeout=5) for t in tasks] == [0, 1, 4, 9, 16] and order == [0, 1, 2, 3, 4]
    with pytest.raises(ZeroDivisionError):
        compute.call(lambda: 1 / 0)
    # a task that submits to its own thread runs at once instead of waiting for itself
    assert compute.call(lambda: compute.call(lambda: "nested")) == "nested"
    gate = threading.Event()
    stuck = compute.submit(gate.wait)
    stuck.join(0.05)
    assert stuck.is_alive()
    with pytest.raises(TimeoutError):
        stuck.result(timeout=0.01)
    gate.set()
    stuck.join(5)
    assert not stuck.is_alive() and stuck.result() is True
    compute.close()
