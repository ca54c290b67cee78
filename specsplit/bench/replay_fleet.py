"""``specsplit bench replay --fleet`` (and ``--overlap``): a round trace replayed through the fleet's processes on
loopback: a router per role and a target (and, with ``--draft``/``--draft-config``, a draft)
worker, each its own process serving the real worker loop, sockets and codec, the replay
process sending the requests as an orchestrator does (an authenticated client of each router).

The workers are ``python -m specsplit.bench.replay_fleet ROLE``: ``specsplit draft``/``target``
with the replay's engine (``specsplit.bench.gpu.load_engine``: the preset's weights where pulled,
else random weights of a config.json, which real workers never serve) and its CUDA graphs warmed
before the worker announces itself, as ``specsplit.workers.build_engine`` does.

Each clean round runs as the fleet runs it: the draft request (re-rooting the grown tree where
the trace did, as ``Replayer.draft_round``), then the verify with the round's growth sent at the
same time (``GrowRequest``, 0.9 of the last verify's ms), both processes on one device at once.
``fleet_ms`` is the draft's round trip plus the verify's, plus what of the growth outlasts the
verify (the next draft would wait for it): the fleet's round without the orchestrator's own
work. ``--overlap`` times the same rounds with both engines in this process instead, each on
its own thread and (CUDA) stream: the growth beside the verify on one device without the
processes, the sockets or a second CUDA context (a worker hosting both roles). Untimed as in the
in-process replay: the target's and the draft's catch-ups (random
weights do not accept what the real pair did) and the target alone's steps, which run through
the same router (their round trips are ``AloneStep.wall_ms``) while nothing else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from schemas import (
    CacheSync,
    DraftReply,
    DraftRequest,
    ErrorReply,
    FlatTree,
    GrownTree,
    GrowReply,
    GrowRequest,
    Message,
    VerifyReply,
    VerifyRequest,
)
from specsplit.bench import replayer
from specsplit.bench.replay_trace import TracedRound, TracedSession
from specsplit.bench.replayer import ReplayedRound, Replayer, ReplayError
from specsplit.openmp import set_worker_openmp
from specsplit.tree import DraftTree, reroot_grown

RPC_TIMEOUT_S = 300.0  # a request's longest wait (a first forward of a shape may compile kernels)
READY_TIMEOUT_S = 600.0  # the workers' model loads and graph captures


class RemoteEngine:
    """A worker behind its router, as the Replayer's engine: ``handle`` sends a request and waits
    for its reply, ``submit`` sends one and returns a future (the reply; ``.stamp`` holds the
    perf_counter time it arrived). The client lives on an event loop in its own thread."""

    store = None  # the engine's sessions are in another process

    def __init__(self, addr: str, secret: bytes | None, name: str) -> None:
        from specsplit.transport.rpc import AsyncRpcClient

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"replay-{name}", daemon=True)
        self._thread.start()
        self.client = AsyncRpcClient(addr, name=f"replay-{name}", secret=secret, default_timeout_s=RPC_TIMEOUT_S)
        self.vocab_size = 0

    def _run(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _call(self, msg: Message, stamp: list[float]) -> Message:
        reply = await self.client.call(msg, session_id=msg.session_id, timeout_s=RPC_TIMEOUT_S)
        stamp.append(time.perf_counter())
        return reply

    def submit(self, msg: Message) -> concurrent.futures.Future:
        stamp: list[float] = []
        fut = self._run(self._call(msg, stamp))
        fut.stamp = stamp  # filled when the reply arrives, before the future is done
        return fut

    def handle(self, msg: Message) -> Message:
        return self.submit(msg).result(RPC_TIMEOUT_S + 10)

    def wait_ready(self, timeout_s: float, alive=lambda: True) -> int:
        """Until the router has an admitted worker (its ping names the vocabulary); the vocab size.
        ReplayError when ``alive()`` turns false (the worker exited) or after ``timeout_s``."""
        deadline, why = time.monotonic() + timeout_s, "no answer"
        while time.monotonic() < deadline:
            if not alive():
                raise ReplayError(f"the worker behind {self.client.addr} exited before it was ready")
            try:
                beat = self._run(self.client.ping(timeout_s=2.0)).result(5.0)
                if getattr(beat, "vocab_size", 0) > 0:
                    self.vocab_size = beat.vocab_size
                    return self.vocab_size
                why = "the router has no worker yet"
            except Exception as exc:  # noqa: BLE001 - not up yet (timeouts, the handshake): ask again
                why = f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)
        raise ReplayError(f"no worker behind {self.client.addr} within {timeout_s:.0f}s ({why})")

    def close(self) -> None:
        try:
            self._run(self.client.close()).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()


class ThreadedEngine:
    """An engine of this process behind its own thread and, on CUDA, its own stream, answering
    futures as a RemoteEngine does (``--overlap``): the draft's growth runs beside the verify on
    the device, in one process, as a worker hosting both roles would run them."""

    def __init__(self, engine, name: str) -> None:
        self.engine, self.store, self.vocab_size = engine, engine.store, engine.vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"replay-{name}",
                                                           initializer=self._own_stream)

    def _own_stream(self) -> None:
        import torch

        if self.engine.device.type == "cuda":  # the current stream is the thread's
            torch.cuda.set_stream(torch.cuda.Stream(self.engine.device))

    def submit(self, msg: Message) -> concurrent.futures.Future:
        stamp: list[float] = []

        def run() -> Message:
            reply = self.engine.handle(msg)
            stamp.append(time.perf_counter())
            return reply

        fut = self._pool.submit(run)
        fut.stamp = stamp
        return fut

    def handle(self, msg: Message) -> Message:
        return self.submit(msg).result(RPC_TIMEOUT_S + 10)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class FleetReplayer(Replayer):
    """``Replayer`` over engines that answer futures (RemoteEngines, ThreadedEngines): the rounds
    timed as the fleet runs them (module doc)."""

    def __init__(self, engine: RemoteEngine | ThreadedEngine, seed: int = 0,
                 draft: RemoteEngine | ThreadedEngine | None = None, branch: int = 2, local_reroot: bool = True) -> None:
        super().__init__(engine, seed, draft, branch)
        self.local_reroot = local_reroot  # the orchestrator re-roots grown trees (SPECSPLIT_GROW_REROOT)
        self._grown_trees: dict[str, GrownTree] = {}  # the last GrowReply's tree per session
        self._grew_first: dict[str, bool] = {}  # the last growth answered before its verify
        self._last_verify_ms = 0.0  # the device's latest verify: the next growth's budget
        self.draft_wall_ms = 0.0  # the last draft request's round trip

    def expect(self, sid: str, reply: VerifyReply, want: int, what: str) -> None:
        if reply.cache_len != want:
            raise ReplayError(f"session {sid}, {what}: the target holds {reply.cache_len} tokens, "
                              f"the recorded progression implies {want}")

    def _request(self, sid, sync, root, spec):
        t0 = time.perf_counter()
        reply = super()._request(sid, sync, root, spec)
        self.draft_wall_ms = (time.perf_counter() - t0) * 1e3
        return reply

    def grown_path(self, sid: str, committed: int) -> list[int]:
        """A path of the last GrowReply's tree (the draft's, in its process) to a forwarded node
        at most ``committed`` deep, as ``Replayer.grown_path`` picks it. [] when none."""
        grown = self._grown_trees.get(sid) if sid in self._grown else None
        return replayer.forwarded_path(DraftTree.from_grown(grown), committed) if grown is not None else []

    def decode(self, sid, held, c, s, out):
        held = super().decode(sid, held, c, s, out)
        self._last_verify_ms = out[-1].verify_ms
        return held

    def session(self, s: TracedSession, prompt: list[int], sid: str | None = None):
        try:
            return super().session(s, prompt, sid)
        finally:
            self._grown_trees.pop(sid or s.session, None)
            self._grew_first.pop(sid or s.session, None)

    def _beside(self, sid: str, r: TracedRound, reuse: int) -> DraftRequest | None:
        """The DraftRequest the orchestrator sends beside round ``r``'s verify, having re-rooted
        the grown tree itself (``specsplit.proposers.draft_model``): where the trace's round
        re-rooted, the last growth answered before its verify and its tree re-roots along the
        path taken (``reroot_grown``). None: the round asks the draft first."""
        spec = self.draft_spec(r)
        if not (self.local_reroot and reuse and spec is not None and self._grew_first.get(sid)):
            return None
        path = self.grown_path(sid, reuse)
        if not path or reroot_grown(self._grown_trees[sid], path, spec) is None:
            return None
        self._grown.discard(sid)
        rnd = self._round[f"draft-{sid}"] = self._round.get(f"draft-{sid}", -1) + 1
        sync = CacheSync(base_len=self._draft_held[sid], append_token_ids=path[:-1])
        return DraftRequest(session_id=sid, round=rnd, sync=sync, root=path[-1], tree=spec)

    def replay_round(self, sid: str, held: int, r: TracedRound, s: TracedSession, out: list[ReplayedRound]) -> int:
        sync, catchup, held = self.place(sid, held, r)
        draft_ms, draft_wall, rerooted, beside = None, 0.0, False, None
        if self.draft is not None and r.clean:
            reuse = self.reuse(r, s, out)
            beside = self._beside(sid, r, reuse)
            if beside is None:
                draft_ms, rerooted = self.draft_round(sid, r, reuse)  # untimed catch-up inside
                draft_wall = self.draft_wall_ms if draft_ms else 0.0
        rnd = self._round[sid] = self._round.get(sid, -1) + 1
        req = VerifyRequest(session_id=sid, round=rnd, sync=self.round_sync(r, s, sync),
                            tree=FlatTree(token_ids=self.tokens(len(r.parents)), parents=list(r.parents)))
        growing = drafting = None
        t0 = time.perf_counter()
        verifying = self.engine.submit(req)
        if beside is not None:
            drafting = self.draft.submit(beside)
        if (draft_ms or beside is not None) and self._last_verify_ms > 0:
            rnd_d = self._round.get(f"draft-{sid}", 0)
            growing = self.draft.submit(GrowRequest(session_id=sid, round=rnd_d, width=replayer.GROW_WIDTH,
                                                    budget_ms=replayer.GROW_FRACTION * self._last_verify_ms,
                                                    return_tree=True))
        reply = verifying.result(RPC_TIMEOUT_S + 10)
        t1 = verifying.stamp[0]
        if isinstance(reply, ErrorReply):
            raise ReplayError(f"session {sid} request {rnd}: the target answered {reply.code}: {reply.message}")
        if drafting is not None:
            drafted = drafting.result(RPC_TIMEOUT_S + 10)
            if not isinstance(drafted, DraftReply):
                raise ReplayError(f"draft session {sid} request {beside.round}: the draft answered {drafted!r}"[:300])
            self._draft_held[sid] = beside.sync.base_len + len(beside.sync.append_token_ids) + 1
            draft_ms, rerooted = drafted.draft_ms, drafted.reused_nodes > 0
        grow_ms, overrun = None, 0.0
        if growing is not None:
            grown = growing.result(RPC_TIMEOUT_S + 10)
            if not isinstance(grown, GrowReply):
                raise ReplayError(f"draft session {sid} grow: the draft answered {grown!r}"[:300])
            self._grown.add(sid)
            if grown.tree is not None:
                self._grown_trees[sid] = grown.tree
            else:
                self._grown_trees.pop(sid, None)
            grow_ms, overrun = grown.grow_ms, max(0.0, growing.stamp[0] - t1) * 1e3
            self._grew_first[sid] = overrun == 0.0
        self.expect(sid, reply, r.context_len + len(reply.accepted_nodes), f"round {r.round}")
        if r.clean:
            self._last_verify_ms = reply.verify_ms
        out.append(self.row(r, s, sync, catchup, reply, (t1 - t0) * 1e3, draft_ms, grow_ms, rerooted,
                            fleet_ms=draft_wall + (t1 - t0) * 1e3 + overrun, beside=beside is not None))
        return min(reply.cache_len, r.context_len + r.accepted)


class ReplayFleet:
    """Routers and workers (``specsplit.launch.Fleet``) for a replay, and a RemoteEngine per role."""

    def __init__(self, args, tmp: Path, draft: bool) -> None:
        from specsplit.launch import Fleet
        from specsplit.models import ModelSettings

        preset = self.preset = args.preset or ModelSettings().preset
        self.fleet = Fleet.create(tmp, preset=preset, threads=args.threads or 1)
        if not args.threads:  # each worker's threads as a worker's settings give them (the environment's)
            for name in ("SPECSPLIT_THREADS", "SPECSPLIT_PREFILL_THREADS"):
                self.fleet.env.pop(name)
                if name in os.environ:
                    self.fleet.env[name] = os.environ[name]
        self.roles = ("target", "draft") if draft else ("target",)
        self.pair = bool(getattr(args, "pair", False)) and draft
        self.engines: dict[str, RemoteEngine] = {}
        self.fleet.start_routers()
        common = ("--device", args.device, "--preset", preset, *(["--random-weights"] if args.random_weights else []))
        dtype = ["--dtype", args.dtype] if args.dtype else []  # the target's
        if self.pair:  # one process hosting both roles (``specsplit pair``)
            self.fleet.spawn("pair", "pair", *common, *dtype,
                             *(["--config", args.target_config] if args.target_config else []),
                             *(["--draft-config", args.draft_config] if args.draft_config else []),
                             env={"SPECSPLIT_WORKER_ID": "replay-pair"}, module="specsplit.bench.replay_fleet")
        else:
            for role in self.roles:
                cfg = getattr(args, f"{role}_config")
                self.fleet.spawn(role, role, *common, *(dtype if role == "target" else []),
                                 *(["--config", cfg] if cfg else []),
                                 env={"SPECSPLIT_WORKER_ID": f"replay-{role}"}, module="specsplit.bench.replay_fleet")

    def connect(self, timeout_s: float = READY_TIMEOUT_S) -> tuple[RemoteEngine, RemoteEngine | None]:
        deadline = time.monotonic() + timeout_s
        self.fleet.wait_log("router_target", "router_started", 1, 60.0)  # it writes the fleet secret first
        secret = self.fleet.secret()
        for role in self.roles:
            self.engines[role] = RemoteEngine(self.fleet.addr(f"{role}_fe"), secret, role)
            name = "pair" if self.pair else role
            proc = self.fleet.procs[name]
            try:
                self.engines[role].wait_ready(max(1.0, deadline - time.monotonic()), lambda p=proc: p.poll() is None)
            except ReplayError as exc:
                raise ReplayError(f"{exc}; its log ends:\n{self.fleet.log(name)[-3000:]}") from None
        return self.engines["target"], self.engines.get("draft")

    def describe(self) -> dict[str, Any]:
        return {"preset": self.preset, "workers": list(self.roles),
                "processes": "a router per role and one worker process hosting both roles (specsplit pair) on loopback"
                if self.pair else "a router and a worker per role on loopback"}

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.fleet.stop()


def run_fleet(args, sessions, started: float, progress) -> tuple[dict[str, Any], list, list]:
    """(description, rounds, alone steps) of the replay through the fleet's processes."""
    from specsplit.bench.replayer import run, trace_branch

    draft = bool(args.draft or args.draft_config)
    with tempfile.TemporaryDirectory(prefix="specsplit-replay-") as tmp:
        fleet = ReplayFleet(args, Path(tmp), draft)
        try:
            left = READY_TIMEOUT_S if args.max_seconds is None else args.max_seconds - (time.perf_counter() - started)
            target, draft_engine = fleet.connect(min(READY_TIMEOUT_S, max(left, 1.0)))
            progress(f"fleet ready in {time.perf_counter() - started:.0f}s")
            replayer = FleetReplayer(target, args.seed, draft_engine, trace_branch(args.trace),
                                     local_reroot=not args.draft_reroots)
            if args.max_seconds is not None:
                replayer.deadline = started + args.max_seconds
            rounds, alone = run(replayer, sessions, progress=progress)
        finally:
            fleet.close()
    return fleet.describe(), rounds, alone


def run_overlap(args, sessions, started: float, progress) -> tuple[dict[str, Any], list, list]:
    """(description, rounds, alone steps) of the replay with both engines in this process, each
    on its own thread and stream (``--overlap``), timed as ``run_fleet``'s."""
    from specsplit.bench.replayer import build_draft, build_target, run, trace_branch

    target, described = build_target(args)
    draft, draft_described = build_draft(args)
    if draft is None:
        raise ReplayError("--overlap replays the draft's growth beside the verify: add --draft or --draft-config")
    engines = [ThreadedEngine(target, "target"), ThreadedEngine(draft, "draft")]
    try:
        replayer = FleetReplayer(engines[0], args.seed, engines[1], trace_branch(args.trace),
                                 local_reroot=not args.draft_reroots)
        if args.max_seconds is not None:
            replayer.deadline = started + args.max_seconds
        rounds, alone = run(replayer, sessions, progress=progress)
    finally:
        for engine in engines:
            engine.close()
    return described | {"backend": target.backend.describe(), "processes": "one, an engine per thread and stream",
                        "draft": draft_described | {"backend": draft.backend.describe()}}, rounds, alone


# ---- the workers ---------------------------------------------------------------------------------

def _build(args, service: str, settings, model_settings):
    """(engine, hello) as ``specsplit.workers.build_engine``, by the replay's loader."""
    from schemas import WorkerHello
    from specsplit.bench.gpu import load_engine

    pair = args.role == "pair"  # both services in this process: --config is the target's, --draft-config the draft's
    ns = argparse.Namespace(device=args.device, dtype=args.dtype if service == "target" else None,
                            random_weights=args.random_weights, target_config=args.config,
                            draft_config=args.draft_config if pair else args.config)
    engine, described = load_engine(service, ns, model_settings, settings)
    if engine.graphs is not None:
        engine.graphs.warm(compact=service == "target")
    hello = WorkerHello(service=service, model_id=f"{described['weights']}:{described['source']}"[:1024],
                        vocab_size=engine.vocab_size, tokenizer_hash="replay", pid=os.getpid())
    return engine, hello


def worker_main(argv: list[str] | None = None) -> int:
    set_worker_openmp()  # before torch loads, as ``specsplit draft``/``target``
    p = argparse.ArgumentParser(prog="python -m specsplit.bench.replay_fleet",
                                description="A worker of `specsplit bench replay --fleet` (see its module doc).")
    p.add_argument("role", choices=["target", "draft", "pair"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default=None)
    p.add_argument("--config", default=None, metavar="DIR", help="random weights of DIR/config.json")
    p.add_argument("--draft-config", default=None, metavar="DIR", help="pair: the draft's (--config: the target's)")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    from functools import partial

    from brokers.settings import MetricsSettings
    from specsplit.config import WorkerSettings
    from specsplit.logs import configure_logging
    from specsplit.models import ModelSettings
    from specsplit.workers import run_pair, run_worker

    settings = WorkerSettings()
    configure_logging(settings.log_level, settings.log_json)
    roles = ("draft", "target") if args.role == "pair" else (args.role,)
    ms = ModelSettings(**({"preset": args.preset} if args.preset else {}), **{f"{r}_device": args.device for r in roles})
    if args.role == "pair":
        return run_pair(settings, ms, MetricsSettings(metrics_port=0), build=partial(_build, args))
    return run_worker(args.role, settings, ms, MetricsSettings(metrics_port=0), build=partial(_build, args))


if __name__ == "__main__":
    sys.exit(worker_main())
