"""``specsplit bench load``: aggregate tok/s under load, the fleet against its own target engine
decoding the same prompts batched without speculation, in one run.

The fleet is a local one (routers, one draft and one target worker, the orchestrator) with the
fleet's default settings (the repository's .env, under the shell's: int8 kernels for both roles)
and the workers' default threads. The baseline is the fleet target's engine, built in this process
by the worker's own code (``specsplit.workers.build_engine``: the same model, backend, int8
kernels and threads), decoding greedily: each step verifies a one-node tree (the newest token) for
every active session, grouped into forwards as the target worker groups its queue
(``target_max_batch_tokens``, ``TargetEngine.verify_batch``). Prompt prefills take the same path
in both systems.

At each concurrency C the same prompts (HumanEval, chat-formatted as ``specsplit produce`` does)
run through both systems, C sessions in flight at once (a new one starts when one finishes); the
order of the two systems alternates per level, and by default (``--aba``) the level's first system
runs again after the second (A B A): these shared machines drift by tens of percent within
minutes, and a drift that is linear over the level then weighs on both systems alike. Aggregate
tok/s = all new tokens of the level / its wall time (A: the mean of its two passes' walls; each
pass's figure is kept as ``*_passes_tok_s``). Latency: one request's seconds from its start to its
last token. Greedy: every fleet output must equal the batched target's for the same prompt.
Every fleet pass starts on a fresh orchestrator (the workers stay loaded): its n-gram cache
learns from what other sessions generate, and greedy decoding repeats an answer exactly, so a
pass after the first would otherwise draft the answers it memorized, and its acceptance climbs
from level to level on the same prompts (``ops/results/load-qwen-coder-1-4-16-*``, docs/results.md).

    specsplit bench load --concurrency 1,4,16 --json runs/load.json          (writes runs/load.png)
    specsplit bench load --preset tiny --concurrency 1,2 --prompts 4 --max-new-tokens 8 --json /tmp/l.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

from specsplit.bench import import_torch_as_users_run_it


@dataclass(frozen=True)
class Done:
    """One finished request."""

    index: int  # prompt index
    token_ids: list[int]
    latency_s: float
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    reproduced: bool = True  # the same tokens in every pass of its level (merge_passes)


@dataclass(frozen=True)
class Level:
    """One system at one concurrency: its requests (in prompt order) and the level's wall time."""

    done: list[Done]
    wall_s: float
    forwards: int = 0  # engine calls (the batched target)

    @property
    def new_tokens(self) -> int:
        return sum(len(d.token_ids) for d in self.done)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def latency(self, q: float) -> float:
        return percentile([d.latency_s for d in self.done], q)


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); ``q`` in [0, 100]."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the fleet ------------------------------------------------------------------------------
async def fleet_level(client, prompts: list[list[int]], concurrency: int, max_new_tokens: int,
                      stop_ids: list[int]) -> Level:
    """Every prompt through the fleet, ``concurrency`` sessions in flight at once."""
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int, ids: list[int]) -> Done:
        async with slots:
            r = await client.generate(ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
        return Done(i, r.token_ids, r.elapsed_s, r.rounds, r.drafted_tokens, r.accepted_tokens)

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return Level(list(done), time.perf_counter() - t0)


# ---- the target alone, batched ----------------------------------------------------------------
@dataclass
class _Decoding:
    index: int
    session_id: str
    cursor: object  # SessionCursor
    prompt_len: int
    started: float
    out: list[int]
    round: int = 0


class BatchedTarget:
    """The fleet target's engine in this process, decoding without speculation: one verify of a
    one-node tree per session and step, the steps' requests grouped into forwards as the worker
    groups its queue."""

    def __init__(self, settings, model_settings):
        from specsplit.workers import build_engine

        self.engine, _ = build_engine("target", settings, model_settings)
        self.max_batch_tokens = settings.target_max_batch_tokens
        self.forwards = 0  # engine calls (one batched forward each, or a request alone)
        self.resends = 0  # CACHE_MISS answers: the session's context sent again

    def _serve(self, requests: list) -> list:
        """Replies in request order; consecutive requests share an engine call while their
        tokens fit ``max_batch_tokens`` (``specsplit.transport.batching.take_batch``)."""
        from specsplit.transport.batching import take_batch, verify_tokens

        queue, replies = deque(requests), []

        def waiting():
            while queue:
                yield queue.popleft()

        while queue:
            batch, back = take_batch(queue.popleft(), waiting(), verify_tokens, self.max_batch_tokens)
            queue.extendleft(reversed(back))
            replies.extend(self.engine.verify_batch(batch) if len(batch) > 1 else [self.engine.handle(batch[0])])
            self.forwards += 1
        return replies

    def level(self, prompts: list[list[int]], concurrency: int, max_new_tokens: int, stop_ids: list[int]) -> Level:
        from schemas import EndSession, ErrorCode, ErrorReply, SamplingSpec, VerifyRequest
        from specsplit.orchestrator.state import SessionCursor, root_only

        pending, active, done = deque(enumerate(prompts)), [], {}
        stop, tag, greedy = set(stop_ids), uuid.uuid4().hex[:8], SamplingSpec()
        t0, forwards = time.perf_counter(), self.forwards
        while pending or active:
            while pending and len(active) < concurrency:
                i, ids = pending.popleft()
                active.append(_Decoding(i, f"load-{tag}-{i}", SessionCursor(list(ids)), len(ids),
                                        time.perf_counter(), []))
            requests = [VerifyRequest(session_id=s.session_id, round=s.round, sync=s.cursor.target_sync(),
                                      tree=root_only(s.cursor.committed[-1]), sampling=greedy) for s in active]
            for s, reply in zip(list(active), self._serve(requests)):
                if isinstance(reply, ErrorReply) and reply.code == ErrorCode.CACHE_MISS:
                    s.cursor.target_len = 0  # evicted (more sessions than it keeps): resend, as the orchestrator does
                    self.resends += 1
                    continue
                if isinstance(reply, ErrorReply):
                    raise RuntimeError(f"target engine: {reply.code.value}: {reply.message}")
                s.cursor.apply_verify(reply)
                s.round += 1
                if s.cursor.take_confirmed(s.out, s.prompt_len, max_new_tokens, stop):
                    done[s.index] = Done(s.index, s.out, time.perf_counter() - s.started, s.round)
                    active.remove(s)
                    self.engine.handle(EndSession(session_id=s.session_id))
        return Level([done[i] for i in sorted(done)], time.perf_counter() - t0, self.forwards - forwards)


# ---- rows, table, plot --------------------------------------------------------------------
def merge_passes(passes: list[Level]) -> Level:
    """One system's passes over the same prompts at one level as one: the mean wall time and
    per-request latency, the first pass's tokens and counts; a request whose tokens differ
    between passes is marked not ``reproduced`` (it counts as not identical: greedy decoding
    that depends on which sessions shared a forward is not the target's own), and its tokens
    still count for tok/s (dropping them undercounted a llama.cpp fleet's speed: docs/results.md,
    commit 18c0300)."""
    first = passes[0]
    if len(passes) == 1:
        return first
    done = []
    for i, d in enumerate(first.done):
        same = all(p.done[i].token_ids == d.token_ids for p in passes[1:])
        done.append(replace(d, reproduced=same,
                            latency_s=sum(p.done[i].latency_s for p in passes) / len(passes)))
    return Level(done, sum(p.wall_s for p in passes) / len(passes),
                 round(sum(p.forwards for p in passes) / len(passes)))


def make_row(concurrency: int, fleet: Level | list[Level], target: Level | list[Level]) -> dict:
    fleet_passes = fleet if isinstance(fleet, list) else [fleet]
    target_passes = target if isinstance(target, list) else [target]
    fleet, target = merge_passes(fleet_passes), merge_passes(target_passes)
    rounds = sum(d.rounds for d in fleet.done)
    drafted = sum(d.drafted for d in fleet.done)
    accepted = sum(d.accepted for d in fleet.done)
    same = [f.reproduced and t.reproduced and f.token_ids == t.token_ids for f, t in zip(fleet.done, target.done)]
    return {
        "concurrency": concurrency,
        "fleet_tok_s": round(fleet.tok_s, 3),
        "target_batched_tok_s": round(target.tok_s, 3),
        "fleet_p50_latency_s": round(fleet.latency(50), 3),
        "fleet_p99_latency_s": round(fleet.latency(99), 3),
        # tree nodes verified per round, root included (drafted counts the rest)
        "mean_tree_nodes": round((drafted + rounds) / rounds, 3) if rounds else 0.0,
        # tokens committed per target pass: accepted + the bonus (as `specsplit bench` reports it)
        "mean_accepted": round((accepted + rounds) / rounds, 3) if rounds else 0.0,
        "fleet_vs_target_batched": round(fleet.tok_s / target.tok_s, 3) if target.tok_s else 0.0,
        "sessions": len(fleet.done),
        "identical_to_target_batched": sum(same),
        "fleet_new_tokens": fleet.new_tokens, "fleet_wall_s": round(fleet.wall_s, 3),
        "target_batched_new_tokens": target.new_tokens, "target_batched_wall_s": round(target.wall_s, 3),
        "target_batched_p50_latency_s": round(target.latency(50), 3),
        "target_batched_p99_latency_s": round(target.latency(99), 3),
        "target_batched_forwards": target.forwards,
        "fleet_rounds": rounds, "fleet_drafted": drafted, "fleet_accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "fleet_passes_tok_s": [round(p.tok_s, 3) for p in fleet_passes],
        "target_batched_passes_tok_s": [round(p.tok_s, 3) for p in target_passes],
        "requests": [{"prompt_index": f.index, "new_tokens": len(f.token_ids), "latency_s": round(f.latency_s, 3),
                      "rounds": f.rounds, "drafted": f.drafted, "accepted": f.accepted,
                      "target_batched_latency_s": round(t.latency_s, 3), "identical": ok}
                     for f, t, ok in zip(fleet.done, target.done, same)],
    }


def summarize(rows: list[dict]) -> dict:
    lo, hi = rows[0], rows[-1]
    same, total = sum(r["identical_to_target_batched"] for r in rows), sum(r["sessions"] for r in rows)
    return {
        f"fleet_scaling_{hi['concurrency']}_vs_{lo['concurrency']}":
            round(hi["fleet_tok_s"] / lo["fleet_tok_s"], 3) if lo["fleet_tok_s"] else 0.0,
        "fleet_vs_target_batched": {str(r["concurrency"]): r["fleet_vs_target_batched"] for r in rows},
        "fleet_at_least_target_batched_everywhere": all(r["fleet_vs_target_batched"] >= 1.0 for r in rows),
        "identical_to_target_batched": f"{same}/{total}",
    }


def markdown(rows: list[dict], summary: dict) -> str:
    lines = ["| concurrency | fleet tok/s | target batched tok/s | fleet / target | fleet p50 s | fleet p99 s "
             "| target p50 s | tree nodes | accepted/round | identical |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['fleet_tok_s']:.2f} | {r['target_batched_tok_s']:.2f} "
                     f"| {r['fleet_vs_target_batched']:.2f}x | {r['fleet_p50_latency_s']:.2f} "
                     f"| {r['fleet_p99_latency_s']:.2f} | {r['target_batched_p50_latency_s']:.2f} "
                     f"| {r['mean_tree_nodes']:.2f} | {r['mean_accepted']:.2f} "
                     f"| {r['identical_to_target_batched']}/{r['sessions']} |")
    scaling = ", ".join(f"{k} = {v}x" for k, v in summary.items() if k.startswith("fleet_scaling"))
    return "\n".join(lines) + f"\n\n{scaling}; identical to the batched target: " \
                              f"{summary['identical_to_target_batched']}\n"


def plot(path: str, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["fleet_tok_s"] for r in rows], "o-", label="fleet (speculative)")
    ax.plot(xs, [r["target_batched_tok_s"] for r in rows], "s--", label="target alone, batched")
    for r in rows:
        ax.annotate(f"{r['fleet_vs_target_batched']:.2f}x", (r["concurrency"], r["fleet_tok_s"]),
                    textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    if len(xs) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("aggregate tokens / s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the run ----------------------------------------------------------------------------------
def parse(argv):
    p = argparse.ArgumentParser(prog="specsplit bench load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,4,16", help="comma list of sessions in flight at once")
    p.add_argument("--prompts", type=int, default=None,
                   help="HumanEval prompts, the same at every level (default: max(16, largest concurrency); "
                        "past the 164 prompts they repeat)")
    p.add_argument("--offset", type=int, default=0, help="skip this many HumanEval prompts first")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--preset", default=None, help="model preset (default: SPECSPLIT_PRESET or qwen-coder)")
    p.add_argument("--chat", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--env-file", default=None,
                   help="the fleet's default settings (default: ./.env, which every specsplit command applies, "
                        "else the repository's; 'none': only what the command applied, and "
                        "SPECSPLIT_ENV_FILE= keeps it from applying ./.env)")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    p.add_argument("--keep-logs", action="store_true", help="keep the fleet's logs (kept anyway when the run fails)")
    p.add_argument("--aba", action=argparse.BooleanOptionalAction, default=True,
                   help="run each level's first system again after the second (A B A) to cancel the machine's drift")
    args = p.parse_args(argv)
    try:
        args.levels = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        p.error(f"--concurrency: a comma list of integers, got {args.concurrency!r}")
    if not args.levels or args.levels[0] < 1 or args.max_new_tokens < 1:
        p.error("--concurrency takes integers >= 1 and --max-new-tokens >= 1")
    args.prompts = args.prompts or max(16, args.levels[-1])
    return args


def load_prompts(args, codec) -> tuple[list[str], list[list[int]]]:
    from specsplit.bench.systems import humaneval_prompts

    pool = humaneval_prompts()[args.offset:]
    if not pool:
        raise SystemExit(f"specsplit bench load: --offset {args.offset} leaves no HumanEval prompt")
    texts = [pool[i % len(pool)] for i in range(args.prompts)]
    return texts, [codec.encode(t) for t in texts]


def run_levels(args, fleet_client, loop, target: BatchedTarget, prompts, stop_ids, fresh_fleet=None) -> list[dict]:
    """``fresh_fleet()`` runs before every fleet pass: each pass must meet the prompts as a fleet
    that never saw them does (the orchestrator's n-gram cache would otherwise propose the answers
    it generated in an earlier pass, which greedy decoding repeats exactly)."""
    rows = []
    for k, c in enumerate(args.levels):
        levels: dict[str, list[Level]] = {"fleet": [], "target": []}
        order = ("fleet", "target") if k % 2 == 0 else ("target", "fleet")  # alternate to cancel drift
        for name in (*order, order[0]) if args.aba else order:
            log(f"concurrency {c}: {name} ...")
            if name == "fleet":
                if fresh_fleet is not None:
                    fresh_fleet()
                level = loop.run_until_complete(fleet_level(fleet_client, prompts, c, args.max_new_tokens, stop_ids))
            else:
                level = target.level(prompts, c, args.max_new_tokens, stop_ids)
            levels[name].append(level)
            log(f"concurrency {c}: {name} {level.tok_s:.2f} tok/s in {level.wall_s:.1f} s")
        rows.append(make_row(c, levels["fleet"], levels["target"]))
    return rows


def main(argv=None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: stop the fleet
    args = parse(argv)
    import_torch_as_users_run_it()  # the baselines' OpenMP wait; before anything imports torch
    from transformers.utils import logging as hf_logging

    from specsplit.bench.fleetenv import environ_with, fleet_defaults, fleet_env
    from specsplit.config import WorkerSettings
    from specsplit.launch import Fleet
    from specsplit.logs import configure_logging
    from specsplit.models import ModelSettings, resolve_model_paths
    from specsplit.produce import PromptCodec

    configure_logging("WARNING")
    hf_logging.disable_progress_bar()
    defaults = fleet_defaults(args.env_file)
    with environ_with(defaults):  # the settings a worker started by honcho would read
        settings, ms = WorkerSettings(), ModelSettings(**({"preset": args.preset} if args.preset else {}))
    paths = resolve_model_paths(ms)
    codec = PromptCodec(paths.target, chat=args.chat)
    texts, prompts = load_prompts(args, codec)
    stop_ids = codec.stop_token_ids
    threads = threads_env(settings, ms)
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-bench-load-"))
    fleet = Fleet.create(tmp, preset=ms.preset, **{**fleet_env(defaults), **threads}).start(1, 1)
    log(f"fleet starting (logs in {tmp})")
    loop, client, rows, orchestrators = asyncio.new_event_loop(), None, None, 0
    try:
        with environ_with(defaults):  # (the model's dtype may be set there)
            target = BatchedTarget(settings.model_copy(update=threads_fields(threads)), ms)
        fleet.wait_ready(timeout_s=900)
        client = loop.run_until_complete(_connect(fleet.orchestrator))
        loop.run_until_complete(fleet_level(client, prompts[:1], 1, 8, stop_ids))  # warm-up: first-call costs
        target.level(prompts[:1], 1, 8, stop_ids)

        def fresh_fleet() -> None:  # a new orchestrator: nothing learned from earlier passes
            fleet.restart_orchestrator()
            loop.run_until_complete(_await_orchestrator(client))

        rows = run_levels(args, client, loop, target, prompts, stop_ids, fresh_fleet)
        orchestrators = fleet.log("orchestrator").count("orchestrator_started")
    finally:
        if client is not None:
            loop.run_until_complete(client.close())
        loop.close()
        fleet.stop()
        if rows is None or args.keep_logs:
            log(f"fleet logs kept in {tmp}")
    if not args.keep_logs:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = summarize(rows)
    print(markdown(rows, summary))
    config = {k: v for k, v in vars(args).items()} | {
        "preset": ms.preset, "draft": str(paths.draft), "target": str(paths.target), "env_file_defaults": defaults,
        "threads": threads, "target_backend": target.engine.backend.describe(),
        "target_max_batch_tokens": target.max_batch_tokens, "target_batched_resends": target.resends,
        "distinct_prompts": len(set(texts)), "orchestrators_started": orchestrators,
        "stop_token_ids": stop_ids, "cpu_count": os.cpu_count()}
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps({"config": config, "rows": rows, "summary": summary}, indent=2))
        plot_path = args.plot or str(Path(args.json_path).with_suffix(".png"))
        plot(plot_path, rows, f"{ms.preset}: {args.prompts} HumanEval prompts x {args.max_new_tokens} new tokens")
        log(f"wrote {args.json_path} and {plot_path}")
    return 0


def threads_env(settings, model_settings) -> dict[str, str]:
    """Each role's torch threads as its worker would pick them (settings, else the backends'
    defaults), made explicit for the fleet and the in-process target alike."""
    from specsplit.backends import default_prefill_threads, default_threads

    return {"SPECSPLIT_DRAFT_THREADS": str(settings.threads_for("draft") or default_threads("draft")),
            "SPECSPLIT_TARGET_THREADS": str(settings.threads_for("target")
                                            or default_threads("target", settings.speculator)),
            "SPECSPLIT_PREFILL_THREADS": str(settings.prefill_threads or default_prefill_threads())}


def threads_fields(threads: dict[str, str]) -> dict[str, int]:
    return {k.removeprefix("SPECSPLIT_").lower(): int(v) for k, v in threads.items()}


async def _connect(addr: str, timeout_s: float = 120.0):
    """A started client of the orchestrator at ``addr``, once it answers (readiness by handshake)."""
    from specsplit.client import SpecSplitClient

    client = SpecSplitClient(addr, timeout_s=3600)
    client.start()
    await _await_orchestrator(client, timeout_s)
    return client


async def _await_orchestrator(client, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await client.ping(timeout_s=2.0):
        if time.monotonic() > deadline:
            raise TimeoutError("the fleet's orchestrator did not answer")


if __name__ == "__main__":
    sys.exit(main())
