"""Transport round-trip benchmark: orchestrator -> router -> no-op worker -> router -> orchestrator.

Starts a router and a no-op worker (a VerifyReply for a 16-node VerifyRequest) in separate
spawned processes, measures sequential AsyncRpcClient round trips (p50/p99 in microseconds,
after a warm-up), and next to it a raw pyzmq DEALER<->ROUTER echo of the same frames in the same
run (one hop, no codec: the floor), and raw pyzmq through a minimal ROUTER/ROUTER forwarder to a
raw echo DEALER (two hops, no codec: the floor of any design with a router in the middle). The
three paths run in alternating blocks. Then, unless ``--no-fleet``, fleet tok/s vs the in-process
reference loop on the tiny models (``specsplit.bench.fleet``; JSON key ``fleet``). All child processes
are stopped by pid at the end.

    specsplit bench transport --n 5000 --json runs/bench_transport.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import signal
import statistics
import sys
import threading
import time

import zmq

from schemas.codec import pack_frames
from schemas.messages import CacheSync, FlatTree, VerifyRequest
from specsplit.transport.sockets import make_socket

_START_TIMEOUT_S = 20.0


def _child_setup() -> threading.Event:
    """In a child: quiet logs, and SIGTERM/SIGINT set the returned stop event."""
    from specsplit.logs import configure_logging

    configure_logging("WARNING")
    from brokers.signals import set_on_stop_signals

    stop = threading.Event()
    set_on_stop_signals(stop)
    return stop


def _report_when_ready(ready: threading.Event, conn, value) -> None:
    """Send ``value()`` (or None) through ``conn`` once ``ready`` is set (a readiness handshake)."""

    def report() -> None:
        conn.send(value() if ready.wait(_START_TIMEOUT_S) else None)

    threading.Thread(target=report, daemon=True).start()


def _router_proc(conn, heartbeat_s: float, secret: bytes) -> None:
    from brokers.router import Router

    stop = _child_setup()
    router = Router("target", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=heartbeat_s,
                    secret=secret)
    _report_when_ready(router.ready, conn, lambda: (router.frontend_endpoint, router.backend_endpoint))
    router.run(stop)
    router.close()


def _worker_proc(conn, backend: str, heartbeat_s: float, secret: bytes) -> None:
    from specsplit.transport.testing import EchoHandler, make_hello
    from specsplit.transport.worker_loop import WorkerLoop, small_request

    stop = _child_setup()
    loop = WorkerLoop(backend, b"bench-worker", make_hello(pid=os.getpid()), EchoHandler(), heartbeat_s=heartbeat_s,
                      may_inline=small_request, secret=secret)  # as a real worker whose small forwards run on one thread (the default split: the fast path)
    _report_when_ready(loop.ready, conn, lambda: True)
    sys.exit(loop.run(stop))


def _raw_echo_proc(conn) -> None:
    """A bare ROUTER that sends every message straight back (the raw pyzmq floor)."""
    stop = _child_setup()
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    conn.send(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    while not stop.is_set():
        if sock.poll(100):
            sock.send_multipart(sock.recv_multipart())
    sock.close()
    ctx.term()


def _raw_proxy_proc(conn) -> None:
    """A bare ROUTER/ROUTER forwarder: the first message on the backend names the worker; every
    client message goes to it and every worker reply back to the client it names."""
    stop = _child_setup()
    ctx = zmq.Context()
    fe = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    be = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    conn.send((fe.getsockopt(zmq.LAST_ENDPOINT).decode(), be.getsockopt(zmq.LAST_ENDPOINT).decode()))
    poller = zmq.Poller()
    poller.register(fe, zmq.POLLIN)
    poller.register(be, zmq.POLLIN)
    worker = None
    while not stop.is_set():
        events = dict(poller.poll(100))
        if be in events:
            msg = be.recv_multipart()
            if worker is None:
                worker = msg[0]
            else:
                fe.send_multipart(msg[1:])
        if fe in events:
            msg = fe.recv_multipart()
            if worker is not None:
                be.send_multipart([worker, *msg])
    fe.close()
    be.close()
    ctx.term()


def _raw_proxy_worker_proc(conn, backend: str) -> None:
    """A bare DEALER behind the forwarder that sends every message straight back."""
    stop = _child_setup()
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=backend)
    sock.send(b"ready")
    conn.send(True)
    while not stop.is_set():
        if sock.poll(100):
            sock.send_multipart(sock.recv_multipart())
    sock.close()
    ctx.term()


def make_request() -> VerifyRequest:
    """A realistic verify request: a 16-node tree (branch 2) with draft log-probs."""
    n = 16
    tree = FlatTree(
        token_ids=[1000 + 37 * i for i in range(n)],
        parents=[-1] + [(i - 1) // 2 for i in range(1, n)],
        draft_logprobs=[0.0] + [-0.1 * i for i in range(1, n)],
    )
    return VerifyRequest(session_id="bench-session", round=7, sync=CacheSync(base_len=512, append_token_ids=[11, 12, 13]),
                         tree=tree)


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    us = sorted(s / 1000.0 for s in samples_ns)
    p99 = us[min(len(us) - 1, int(round(0.99 * (len(us) - 1))))]
    return {"p50": round(statistics.median(us), 1), "p99": round(p99, 1), "mean": round(statistics.fmean(us), 1)}


_BLOCK = 250  # round trips per transport before switching: the three paths interleave in time


async def _rpc_block(client, req: VerifyRequest, count: int, samples: list[int] | None) -> None:
    for _ in range(count):
        t0 = time.perf_counter_ns()
        reply = await client.call(req, session_id=req.session_id, timeout_s=5.0)
        dt = time.perf_counter_ns() - t0
        if type(reply).__name__ != "VerifyReply":
            raise RuntimeError(f"unexpected reply {reply!r}")
        if samples is not None:
            samples.append(dt)


def _raw_block(sock: zmq.Socket, frames: list[bytes], count: int, samples: list[int] | None) -> None:
    for _ in range(count):
        t0 = time.perf_counter_ns()
        sock.send_multipart(frames)
        if not sock.poll(5000):
            raise RuntimeError("raw echo timed out")
        sock.recv_multipart()
        if samples is not None:
            samples.append(time.perf_counter_ns() - t0)


def _bench_interleaved(frontend: str, raw_addrs: dict[str, str], req: VerifyRequest, frames: list[bytes], n: int,
                       warmup: int, secret: bytes) -> dict[str, list[int]]:
    """n timed round trips per path (after ``warmup`` each), in alternating blocks of _BLOCK, so
    that a noisy neighbour slows every path alike."""
    from specsplit.transport.rpc import AsyncRpcClient

    loop = asyncio.new_event_loop()
    zctx = zmq.Context()
    socks = {name: make_socket(zctx, zmq.DEALER, connect=addr) for name, addr in raw_addrs.items()}
    client = AsyncRpcClient(frontend, name="bench", secret=secret)
    samples: dict[str, list[int]] = {"rpc": [], **{name: [] for name in socks}}
    try:
        loop.run_until_complete(client.start())
        loop.run_until_complete(client.ping(timeout_s=5.0))
        loop.run_until_complete(_rpc_block(client, req, warmup, None))
        for sock in socks.values():
            _raw_block(sock, frames, warmup, None)
        done = 0
        while done < n:
            count = min(_BLOCK, n - done)
            loop.run_until_complete(_rpc_block(client, req, count, samples["rpc"]))
            for name, sock in socks.items():
                _raw_block(sock, frames, count, samples[name])
            done += count
    finally:
        loop.run_until_complete(client.close())
        loop.close()
        for sock in socks.values():
            sock.close()
        zctx.term()
    return samples


def _spawn(ctx, procs: list[mp.Process], target, *args) -> object:
    """Start ``target`` in a spawned process (recorded in ``procs`` at once, so it is always
    stopped) and return what it reports through its pipe once ready."""
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    procs.append(proc)
    if not parent.poll(_START_TIMEOUT_S):
        raise RuntimeError(f"{target.__name__} did not report ready")
    return parent.recv()


def _stop(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.pid is not None and p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        p.join(5.0)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(2.0)


def run(n: int, warmup: int, heartbeat_s: float) -> dict:
    ctx = mp.get_context("spawn")
    procs: list[mp.Process] = []
    req = make_request()
    frames = pack_frames(req, req.session_id, b"\x00" * 8)
    secret = secrets.token_bytes(32)  # this bench's own fleet
    try:
        addrs = _spawn(ctx, procs, _router_proc, heartbeat_s, secret)
        if addrs is None:
            raise RuntimeError("router did not bind")
        frontend, backend = addrs
        if not _spawn(ctx, procs, _worker_proc, backend, heartbeat_s, secret):
            raise RuntimeError("worker was not admitted")
        raw_addr = _spawn(ctx, procs, _raw_echo_proc)
        proxy_fe, proxy_be = _spawn(ctx, procs, _raw_proxy_proc)
        _spawn(ctx, procs, _raw_proxy_worker_proc, proxy_be)
        got = _bench_interleaved(frontend, {"raw": raw_addr, "proxied": proxy_fe}, req, frames, n, warmup, secret)
    finally:
        _stop(procs)
    return {"rtt_us": percentiles(got["rpc"]), "raw_zmq_rtt_us": percentiles(got["raw"]),
            "raw_zmq_2hop_rtt_us": percentiles(got["proxied"]),
            "n": n, "body_bytes": len(frames[4]), "cpu_count": os.cpu_count(), "load_avg": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specsplit bench transport", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=5000, help="timed round trips per transport")
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--json", dest="json_path", help="write the results here")
    p.add_argument("--no-fleet", action="store_true", help="skip fleet tok/s vs the in-process loop")
    p.add_argument("--fleet-prompts", type=int, default=8)
    p.add_argument("--fleet-max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    # SIGTERM runs the finally blocks (every child is stopped); the caller's handler comes back after
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        result = run(args.n, args.warmup, args.heartbeat_s)
        if not args.no_fleet:
            from specsplit.bench.fleet import run_fleet_vs_local

            result["fleet"] = run_fleet_vs_local(args.fleet_prompts, args.fleet_max_new_tokens)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"{'path':<34}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}")
    for label, key in (("rpc client->router->worker", "rtt_us"), ("raw pyzmq DEALER<->ROUTER echo", "raw_zmq_rtt_us"),
                       ("raw pyzmq via bare forwarder", "raw_zmq_2hop_rtt_us")):
        r = result[key]
        print(f"{label:<34}{r['p50']:>10.1f}{r['p99']:>10.1f}{r['mean']:>10.1f}")
    print(f"n={result['n']} body_bytes={result['body_bytes']} goal: rpc p50 <= 150 us, p99 <= 2000 us; "
          f"rpc / raw p50 = {result['rtt_us']['p50'] / result['raw_zmq_rtt_us']['p50']:.2f}x, "
          f"rpc / 2-hop floor p50 = {result['rtt_us']['p50'] / result['raw_zmq_2hop_rtt_us']['p50']:.2f}x")
    if "fleet" in result:
        from specsplit.bench.fleet import print_table

        print()
        print_table(result["fleet"])
    if args.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
