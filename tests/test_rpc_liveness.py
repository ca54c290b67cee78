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
from tests.conftest import async_wait_until

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
    # 1 s of silence is a loss: far above a busy box's stalls, far below the call's timeout (20 s)
    async with AsyncRpcClient(endpoint(bare_router), heartbeat_s=0.1, liveness=10) as client:
        await _answer_pings(bare_router, time.monotonic() + 0.3)
        assert not client.router_lost
        call = asyncio.ensure_future(client.call(make_verify("s"), session_id="s", timeout_s=20))
        # silent (nothing read, nothing answered) until the client notices
        await async_wait_until(lambda: client.router_lost, 20, "the silence noticed")
        assert not call.done()
        pongs = asyncio.ensure_future(_answer_pings(bare_router, time.monotonic() + 15))
        try:
            # RpcRouterLost, not RpcTimeout: failed when the router answered again, not at the timeout
            with pytest.raises(RpcRouterLost):
                await call
        finally:
            pongs.cancel()
        assert not client.router_lost and client.router_losses == 1


async def test_dropped_connection_fails_pending_calls_at_once():
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    try:
        async with AsyncRpcClient(endpoint(sock), ctx=ctx, heartbeat_s=0.5, liveness=10) as client:
            call = asyncio.ensure_future(client.call(make_verify("s"), session_id="s", timeout_s=20))
            assert await sock.poll(10_000)  # the request arrived: the connection is up
            await sock.recv_multipart()
            sock.close(linger=0)
            # failed by the disconnect itself: silence (5 s) fails nothing, the timeout would be RpcTimeout
            with pytest.raises(RpcRouterLost, match="disconnected"):
                await call
            assert client.router_lost
    finally:
        ctx.term()
