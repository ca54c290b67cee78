"""specsplit.delayrelay: what the accepted side sends arrives ``delay`` later, in order and
intact; the other direction is not delayed; a new delay applies to what arrives after it."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from specsplit.delayrelay import DelayRelay


async def _echo_server():
    async def echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[:2]


async def _rtt(reader, writer, payload: bytes = b"x") -> float:
    t0 = time.perf_counter()
    writer.write(payload)
    await writer.drain()
    got = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
    assert got == payload
    return (time.perf_counter() - t0) * 1e3


DELAY_MS = 150.0


def test_the_relay_delays_one_direction_keeps_order_and_takes_new_delays():
    async def run():
        server, upstream = await _echo_server()
        relay = DelayRelay(("127.0.0.1", 0), upstream, delay_ms=DELAY_MS)
        addr = await relay.start()
        reader, writer = await asyncio.open_connection(*addr)
        slow = [await _rtt(reader, writer) for _ in range(5)]
        # one way (the echo's way back is not delayed): never early, and not delayed twice; the
        # delay is long so that a busy box's lateness (tens of ms) stays far from either bound
        assert min(slow) >= DELAY_MS, slow
        assert sorted(slow)[2] < 2 * DELAY_MS, slow
        relay.set_delay(0)
        fast = [await _rtt(reader, writer) for _ in range(5)]
        assert sorted(fast)[2] < DELAY_MS, fast  # the new delay applies: no longer the old one
        relay.set_delay(5)
        blob = os.urandom(3 << 20)  # many chunks, each delayed: they arrive intact and in order
        t0 = time.perf_counter()
        writer.write(blob)
        await writer.drain()
        back = await asyncio.wait_for(reader.readexactly(len(blob)), 30)
        assert back == blob and (time.perf_counter() - t0) * 1e3 >= 5.0
        writer.close()
        server.close()
        relay.server.close()

    asyncio.run(run())


def test_a_relay_to_nowhere_closes_the_connection():
    async def run():
        relay = DelayRelay(("127.0.0.1", 0), ("127.0.0.1", 1), delay_ms=1)  # port 1: refused
        addr = await relay.start()
        reader, writer = await asyncio.open_connection(*addr)
        assert await asyncio.wait_for(reader.read(10), 10) == b""  # closed, not hung
        assert relay.connections == 0
        writer.close()
        relay.server.close()

    asyncio.run(run())


def test_negative_delays_are_refused():
    with pytest.raises(ValueError):
        DelayRelay(("127.0.0.1", 0), ("127.0.0.1", 1), delay_ms=-1)
