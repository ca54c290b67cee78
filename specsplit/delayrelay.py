"""A TCP relay that delays one direction: link latency where the kernel has no ``tc netem``.

``python -m specsplit.delayrelay --listen 127.0.0.1:6561 --to 10.213.7.1:5561 --delay-ms 5``
accepts connections on ``--listen`` and opens one to ``--to`` for each; every chunk read from
the accepting side (the host the relay runs on: what it *sends*) is written upstream ``delay``
ms after it arrived, in order; the other direction passes at once. This is what ``tc netem
delay`` on the host's egress does to a TCP stream's data (not to its ACKs, and with no loss or
reordering), so a worker that connects through the relay sees each round trip to its router
grow by the delay. A line on stdin with a number sets a new delay for chunks that arrive from
then on (``specsplit.netns.NetnsFleet.set_target_delay``); EOF on stdin changes nothing.

The relay's own cost is one more loopback hop each way (~0.1 ms); timers fire with the event
loop's ~1 ms resolution, so a delay is honoured to within about a millisecond, late not early.
Bounded: at most ``MAX_QUEUED`` chunks wait per connection (reading pauses until they leave),
at most ``MAX_CONNECTIONS`` connections at once (more are closed at once). No torch here.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

CHUNK = 64 * 1024
MAX_QUEUED = 1024
MAX_CONNECTIONS = 64
CONNECT_TIMEOUT_S = 5.0


class DelayRelay:
    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], delay_ms: float = 0.0) -> None:
        if delay_ms < 0:
            raise ValueError("delay_ms must be >= 0")
        self.listen, self.upstream, self.delay_s = listen, upstream, delay_ms / 1e3
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None

    def set_delay(self, delay_ms: float) -> None:
        if delay_ms < 0:
            raise ValueError("delay_ms must be >= 0")
        self.delay_s = delay_ms / 1e3

    async def start(self) -> tuple[str, int]:
        """Listen; returns the bound (host, port) (port 0 in ``listen`` picks a free one)."""
        self.server = await asyncio.start_server(self._accept, *self.listen)
        return self.server.sockets[0].getsockname()[:2]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= MAX_CONNECTIONS:
            writer.close()
            return
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.upstream), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            self.connections -= 1
            writer.close()
            return
        try:
            await asyncio.gather(self._delayed(reader, up_writer), self._direct(up_reader, writer))
        finally:
            self.connections -= 1
            for w in (writer, up_writer):
                w.close()

    async def _delayed(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(MAX_QUEUED)

        async def pump() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(pump())
        try:
            while data := await reader.read(CHUNK):
                await queue.put((loop.time() + self.delay_s, data))
            await queue.put(None)
            await sender
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sender.cancel()

    @staticmethod
    async def _direct(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(CHUNK):
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:
            pass


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"HOST:PORT, got {text!r}")
    return host, int(port)


async def _serve(relay: DelayRelay) -> None:
    host, port = await relay.start()
    print(f"delayrelay listening={host}:{port} upstream={relay.upstream[0]}:{relay.upstream[1]} "
          f"delay_ms={relay.delay_s * 1e3:g}", file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        try:
            relay.set_delay(float(line.decode().strip()))
            print(f"delayrelay delay_ms={relay.delay_s * 1e3:g}", file=sys.stderr, flush=True)
        except ValueError as exc:
            print(f"delayrelay bad delay {line!r}: {exc}", file=sys.stderr, flush=True)
    await asyncio.Event().wait()  # stdin closed: keep relaying until killed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specsplit.delayrelay", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", type=_addr, required=True, help="HOST:PORT to accept on")
    p.add_argument("--to", type=_addr, required=True, help="HOST:PORT to relay to")
    p.add_argument("--delay-ms", type=float, default=0.0, help="delay of what the accepted side sends")
    args = p.parse_args(argv)
    try:
        asyncio.run(_serve(DelayRelay(args.listen, args.to, args.delay_ms)))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
