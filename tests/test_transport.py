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
from specsplit.transport.sockets import endpoint, is_loopback_address, make_socket
from specsplit.transport.testing import make_verify, EchoHandler, RouterThread, WorkerThread

pytestmark = pytest.mark.timeout(30)

HB = dict(heartbeat_s=0.1, liveness=20)  # generous (2 s): router, workers and test share one GIL, and CI boxes are busy


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
        assert 0.15 < time.monotonic() - t0 < 1.0
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
    await asyncio.sleep(0.05)
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
        async with AsyncRpcClient(router.frontend) as client:
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
        async with AsyncRpcClient(router.frontend) as client:
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
    sock = make_socket(ctx, zmq.DEALER, connect=addr)
    try:
        sock.send_multipart(frames)
        assert sock.poll(3000)
        return sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()


def test_worker_answers_a_garbage_body_with_bad_request(router):
    with WorkerThread(router.backend, b"w", **HB):
        for body in (b"\xc1", b"\x01", b"\x81\xa3foo\x01"):
            reply = _raw_call(router.frontend, [PROTO, MsgKind.VERIFY_REQUEST.as_byte(), b"s", b"r", body])
            env = unpack_frames(reply)
            assert env.request_id == b"r" and env.msg.code is ErrorCode.BAD_REQUEST
        ok = unpack_frames(_raw_call(router.frontend, pack_frames(verify("s"), "s", b"r2")))
        assert isinstance(ok.msg, VerifyReply)


class _Gate:
    """A handler that blocks until released (a long forward)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, msg: Message) -> Message:
        self.entered.set()
        assert self.release.wait(10)
        return EchoHandler()(msg)


async def test_full_queue_is_answered_overloaded_at_once(router):
    gate = _Gate()
    with WorkerThread(router.backend, b"w", gate, max_queue=1, **HB):
        async with AsyncRpcClient(router.frontend) as client:
            first = asyncio.ensure_future(client.call(verify("a"), session_id="a", timeout_s=5))
            await asyncio.to_thread(gate.entered.wait, 5)
            queued = asyncio.ensure_future(client.call(verify("b"), session_id="b", timeout_s=5))
            await asyncio.sleep(0.1)
            over = await client.call(verify("c"), session_id="c", timeout_s=5)
            assert isinstance(over, ErrorReply) and over.code is ErrorCode.OVERLOADED and over.retryable
            gate.release.set()
            assert isinstance(await first, VerifyReply) and isinstance(await queued, VerifyReply)


async def test_worker_keeps_heartbeating_while_the_handler_blocks(router):
    with WorkerThread(router.backend, b"w", EchoHandler(delay_s=1.0), **HB):
        async with AsyncRpcClient(router.frontend) as client:
            reply = await client.call(verify("slow"), session_id="slow", timeout_s=5)
        assert isinstance(reply, VerifyReply)
        stats = router.router.stats  # 1 s busy > 0.5 s liveness, yet never expired
        assert stats.workers_expired == stats.workers_lost == 0 and router.live_workers() == (b"w",)


async def test_stop_finishes_the_request_in_hand_and_returns_zero(router):
    gate = _Gate()
    worker = WorkerThread(router.backend, b"w", gate, **HB).start()
    async with AsyncRpcClient(router.frontend) as client:
        in_hand = asyncio.ensure_future(client.call(verify("a"), session_id="a", timeout_s=5))
        await asyncio.to_thread(gate.entered.wait, 5)
        queued = asyncio.ensure_future(client.call(verify("b"), session_id="b", timeout_s=5))
        await asyncio.sleep(0.1)
        worker.stop_event.set()
        await asyncio.sleep(0.2)
        gate.release.set()
        assert isinstance(await in_hand, VerifyReply)
        rejected = await queued
        assert isinstance(rejected, ErrorReply) and rejected.retryable
    assert await asyncio.to_thread(worker.join, 5) == 0


async def test_worker_reconnects_to_a_restarted_router():
    first = RouterThread("target", **HB).start()
    frontend, backend = first.frontend, first.backend
    worker = WorkerThread(backend, b"w", reconnect_max_s=0.4, **HB).start()
    try:
        first.stop()
        deadline = time.monotonic() + 3
        while worker.loop.ready.is_set():  # the worker notices the silence and backs off
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        with RouterThread("target", frontend, backend, **HB) as second:
            await asyncio.to_thread(second.wait_live, 1, 5.0)
            async with AsyncRpcClient(frontend) as client:
                reply = await client.call(verify("again"), session_id="again", timeout_s=5)
            assert isinstance(reply, VerifyReply)
    finally:
        assert worker.stop() == 0
