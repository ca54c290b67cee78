"""Transport round-trip benchmark: orchestrator -> router -> no-op worker -> router -> orchestrator.

Starts a router and a no-op worker (a VerifyReply for a 16-node VerifyRequest) in separate
spawned processes, measures sequential AsyncRpcClient round trips (p50/p99 in microseconds,
after a warm-up), and next to it a raw pyzmq DEALER<->ROUTER echo of the same frames in the same
run (one hop, no codec: the floor). Then, unless ``--no-fleet``, fleet tok/s vs the in-process
reference loop on the tiny models (``ops.bench_fleet``; JSON key ``fleet``). All child processes
are stopped by pid at the end.

    python -m ops.bench_transport --n 5000 --json runs/bench_transport.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
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
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _report_when_ready(ready: threading.Event, conn, value) -> None:
    """Send ``value()`` (or None) through ``conn`` once ``ready`` is set (a readiness handshake)."""

    def report() -> None:
        conn.send(value() if ready.wait(_START_TIMEOUT_S) else None)

    threading.Thread(target=report, daemon=True).start()


def _router_proc(conn, heartbeat_s: float) -> None:
    from brokers.router import Router

    stop = _child_setup()
    router = Router("target", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=heartbeat_s)
    _report_when_ready(router.ready, conn, lambda: (router.frontend_endpoint, router.backend_endpoint))
    router.run(stop)
    router.close()


def _worker_proc(conn, backend: str, heartbeat_s: float) -> None:
    from specsplit.transport.testing import EchoHandler, make_hello
    from specsplit.transport.worker_loop import WorkerLoop

    stop = _child_setup()
    loop = WorkerLoop(backend, b"bench-worker", make_hello(pid=os.getpid()), EchoHandler(), heartbeat_s=heartbeat_s)
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


async def _bench_rpc(frontend: str, req: VerifyRequest, n: int, warmup: int) -> list[int]:
    from specsplit.transport.rpc import AsyncRpcClient

    samples: list[int] = []
    async with AsyncRpcClient(frontend, name="bench") as client:
        await client.ping(timeout_s=5.0)
        for i in range(warmup + n):
            t0 = time.perf_counter_ns()
            reply = await client.call(req, session_id=req.session_id, timeout_s=5.0)
            dt = time.perf_counter_ns() - t0
            if type(reply).__name__ != "VerifyReply":
                raise RuntimeError(f"unexpected reply {reply!r}")
            if i >= warmup:
                samples.append(dt)
    return samples


def _bench_raw(addr: str, frames: list[bytes], n: int, warmup: int) -> list[int]:
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=addr)
    samples: list[int] = []
    try:
        for i in range(warmup + n):
            t0 = time.perf_counter_ns()
            sock.send_multipart(frames)
            if not sock.poll(5000):
                raise RuntimeError("raw echo timed out")
            sock.recv_multipart()
            if i >= warmup:
                samples.append(time.perf_counter_ns() - t0)
    finally:
        sock.close()
        ctx.term()
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
    try:
        addrs = _spawn(ctx, procs, _router_proc, heartbeat_s)
        if addrs is None:
            raise RuntimeError("router did not bind")
        frontend, backend = addrs
        if not _spawn(ctx, procs, _worker_proc, backend, heartbeat_s):
            raise RuntimeError("worker was not admitted")
        raw_addr = _spawn(ctx, procs, _raw_echo_proc)
        rpc = asyncio.run(_bench_rpc(frontend, req, n, warmup))
        raw = _bench_raw(raw_addr, frames, n, warmup)
    finally:
        _stop(procs)
    return {"rtt_us": percentiles(rpc), "raw_zmq_rtt_us": percentiles(raw), "n": n, "body_bytes": len(frames[4])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.bench_transport", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=5000, help="timed round trips per transport")
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--json", dest="json_path", help="write the results here")
    p.add_argument("--no-fleet", action="store_true", help="skip fleet tok/s vs the in-process loop")
    p.add_argument("--fleet-prompts", type=int, default=8)
    p.add_argument("--fleet-max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop every child
    result = run(args.n, args.warmup, args.heartbeat_s)
    if not args.no_fleet:
        from ops.bench_fleet import run_fleet_vs_local

        result["fleet"] = run_fleet_vs_local(args.fleet_prompts, args.fleet_max_new_tokens)
    print(f"{'path':<34}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}")
    for label, key in (("rpc client->router->worker", "rtt_us"), ("raw pyzmq DEALER<->ROUTER echo", "raw_zmq_rtt_us")):
        r = result[key]
        print(f"{label:<34}{r['p50']:>10.1f}{r['p99']:>10.1f}{r['mean']:>10.1f}")
    print(f"n={result['n']} body_bytes={result['body_bytes']}")
    if "fleet" in result:
        from ops.bench_fleet import print_table

        print()
        print_table(result["fleet"])
    if args.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
