"""AsyncRpcClient router liveness: a lost router fails pending calls at once (retryable), never
at their timeout."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from schemas.codec import MsgKind, unpack_frames
from specsplit.transport.rpc import AsyncRpcClient, RpcRouterLost
from specsplit.transport.sockets import endpoint, make_socket
from specsplit.transport.testing import make_verify

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def bare_router():
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    yield sock
    sock.close()
    ctx.term()


async def _answer_pings(sock, until: float) -> int:
    """Echo HEARTBEATs (what a router does), ignore everything else; returns pings answered."""
    answered = 0
    while time.monotonic() < until:
        if not await sock.poll(50):
            continue
        frames = await sock.recv_multipart()
        if unpack_frames(frames[1:]).kind is MsgKind.HEARTBEAT:
            await sock.send_multipart(frames)
            answered += 1
    return answered


async def test_silent_router_that_answers_again_fails_pending_calls_at_once(bare_router):
    async with AsyncRpcClient(endpoint(bare_router), heartbeat_s=0.1, liveness=3) as client:
        await _answer_pings(bare_router, time.monotonic() + 0.3)
        assert not client.router_lost
        call = asyncio.ensure_future(client.call(make_verify("s"), session_id="s", timeout_s=20))
        await asyncio.sleep(0.6)  # silent: nothing read, nothing answered
        assert client.router_lost and not call.done()
        t0 = time.monotonic()
        await _answer_pings(bare_router, time.monotonic() + 0.4)
        with pytest.raises(RpcRouterLost):
            await asyncio.wait_for(call, 1.0)
        assert time.monotonic() - t0 < 1.0 and not client.router_lost and client.router_losses == 1


async def test_dropped_connection_fails_pending_calls_at_once():
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    try:
        async with AsyncRpcClient(endpoint(sock), ctx=ctx, heartbeat_s=0.5, liveness=10) as client:
            call = asyncio.ensure_future(client.call(make_verify("s"), session_id="s", timeout_s=20))
            assert await sock.poll(2000)  # the request arrived: the connection is up
            await sock.recv_multipart()
            t0 = time.monotonic()
            sock.close(linger=0)
            with pytest.raises(RpcRouterLost):
                await asyncio.wait_for(call, 3.0)
            assert time.monotonic() - t0 < 3.0 and client.router_lost
    finally:
        ctx.term()
