"""``specsplit bench soak``: many sessions through one fleet, C at a time; none may be lost, and
the memory of every worker and the orchestrator must stay flat once the fleet is warm.

A local fleet (routers, one draft and one target worker, the orchestrator; the repository's .env
defaults under the shell's, as ``honcho start`` runs it) serves ``--sessions`` greedy generations
of ``--max-new-tokens`` tokens each from one producer, ``--concurrency`` in flight at once (a new
one starts when one finishes). Prompts are random token ids from a pool of ``--distinct``, so a
prompt recurs and every answer to it must be the same (greedy).

The resident memory (RSS: psutil, else /proc/PID/status VmRSS) of each role's process tree (the
supervisor and its working child) is read the moment the N-th session completes, every
``--sample-every`` sessions, and with it (from the processes' Prometheus pages) the sessions and
KV bytes each worker holds and the orchestrator's running sessions. The check, as issue 15 states
it: all sessions complete with their tokens, and each worker's and the orchestrator's RSS at the
last session is within ``--tolerance`` of its RSS at session ``--rss-from``. The routers are
reported beside them. "Within" holds for the peak between the two samples too, so memory
freed once the last session ends cannot hide growth in between.

    specsplit bench soak --sessions 1000 --concurrency 256 --json runs/soak.json   (tiny models)
    specsplit bench soak --preset smollm2 --sessions 300 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

CHECKED = ("draft0", "target0", "orchestrator")  # the "worker and orchestrator"
ROUTERS = ("router_draft", "router_target")
GAUGES = ("specsplit:worker_sessions", "specsplit:worker_kv_bytes", "specsplit:num_sessions_running",
          "specsplit:num_sessions_waiting", "specsplit:router_inflight")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tree_rss(pid: int) -> int:
    """Bytes resident in process ``pid`` and all its descendants (0 once gone)."""
    try:
        import psutil
    except ImportError:
        return sum(_proc_rss(p) for p in _proc_tree(pid))
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _proc_tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo.extend(int(c) for c in task.read_text().split())
            except OSError:
                pass
    return out


def _proc_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def random_prompts(n: int, seed: int, vocab: int = 400, min_len: int = 8, max_len: int = 64) -> list[list[int]]:
    """Token ids below 400: valid for every preset (the tiny pair's special ids start at 416)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


class Sampler:
    """RSS of every fleet process at given completion counts, and the gauges scraped then."""

    def __init__(self, fleet, at: set[int]):
        self.fleet, self.at = fleet, at
        self.t0 = time.monotonic()  # reset when the sessions start
        self.samples: list[dict] = []
        self._scrapes: list[asyncio.Task] = []

    def completed(self, n: int, in_flight: int) -> None:
        if n not in self.at:
            return
        sample = {"sessions": n, "in_flight": in_flight, "elapsed_s": round(time.monotonic() - self.t0, 2),
                  "rss": {name: tree_rss(p.pid) for name, p in self.fleet.procs.items()}}
        self.samples.append(sample)
        self._scrapes.append(asyncio.get_running_loop().create_task(self._gauges(sample)))

    async def _gauges(self, sample: dict) -> None:
        def scrape_all() -> dict:
            out = {}
            for name in self.fleet.metrics_ports:
                try:
                    page = self.fleet.scrape(name, timeout_s=30)
                except OSError as exc:
                    out[name] = {"error": str(exc)}
                    continue
                out[name] = {k: v for k, v in page.items() if k.split("{")[0] in GAUGES}
            return out

        sample["gauges"] = await asyncio.to_thread(scrape_all)

    async def finish(self, settle_s: float = 15.0) -> None:
        """Wait for the scrapes. The last sample, taken with nothing in flight, is scraped again
        until every session table is empty or ``settle_s`` passes: a session's producer gets its
        answer before the orchestrator's EndSession reaches the workers, so the last session's
        KV can still be held for a moment when its answer arrives (the soak's final scrape once
        read one session's KV in ``specsplit:worker_kv_bytes``). What is still held after
        ``settle_s`` is what the sample reports."""
        await asyncio.gather(*self._scrapes)
        last = self.samples[-1] if self.samples else None
        if last is None or last["in_flight"] != 0:
            return
        t0 = time.monotonic()
        while busy(last["gauges"]) and time.monotonic() - t0 < settle_s:
            await asyncio.sleep(0.2)
            await self._gauges(last)
        last["settled_s"] = round(time.monotonic() - t0, 2)


def busy(gauges: dict) -> bool:
    """Whether scraped gauges show any session, KV byte or request still held (or a scrape failed)."""
    return any("error" in page or any(v for v in page.values()) for page in gauges.values())


async def soak(fleet, prompts: list[list[int]], sessions: int, concurrency: int, max_new_tokens: int,
               sampler: Sampler) -> dict:
    """Run the sessions; returns what completed, what was lost or diverged, and the timings."""
    from specsplit.client import SpecSplitClient

    slots = asyncio.Semaphore(concurrency)
    state = {"done": 0, "in_flight": 0, "max_in_flight": 0}
    answers: dict[int, list[int]] = {}
    lost, diverged, latencies = [], [], []

    async def one(k: int) -> None:
        p = k % len(prompts)
        async with slots:
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                r = await client.generate(prompts[p], max_new_tokens=max_new_tokens)
            except Exception as exc:  # noqa: BLE001 -- every failure is a lost session, counted
                lost.append(f"{k}: {type(exc).__name__}: {exc}"[:300])
                r = None
            finally:
                state["in_flight"] -= 1
        if r is not None and (r.finish_reason != "length" or len(r.token_ids) != max_new_tokens):
            lost.append(f"{k}: finish_reason={r.finish_reason} tokens={len(r.token_ids)}")
        elif r is not None:
            latencies.append(r.elapsed_s)
            if answers.setdefault(p, r.token_ids) != r.token_ids:
                diverged.append(k)
        state["done"] += 1
        sampler.completed(state["done"], state["in_flight"])

    async with SpecSplitClient(fleet.orchestrator, timeout_s=1800) as client:
        deadline = time.monotonic() + 120
        while not await client.ping(timeout_s=2.0):
            if time.monotonic() > deadline:
                raise TimeoutError("the fleet's orchestrator did not answer")
        t0, sampler.t0 = time.perf_counter(), time.monotonic()
        await asyncio.gather(*(one(k) for k in range(sessions)))
        wall = time.perf_counter() - t0
        await sampler.finish()
    latencies.sort()
    return {"completed": sessions - len(lost), "lost": len(lost), "lost_examples": lost[:10],
            "diverged": len(diverged), "max_in_flight": state["max_in_flight"], "wall_s": round(wall, 2),
            "tok_s": round((sessions - len(lost)) * max_new_tokens / wall, 1),
            "p50_latency_s": round(latencies[len(latencies) // 2], 3) if latencies else None,
            "max_latency_s": round(latencies[-1], 3) if latencies else None}


def rss_check(samples: list[dict], rss_from: int, rss_to: int, tolerance: float) -> dict:
    """Per process: RSS (MiB) at ``rss_from`` and ``rss_to`` completed sessions and its peak in
    between; ``rss_ratio`` = RSS at ``rss_to`` / at ``rss_from``, ``rss_peak_ratio`` = that
    peak / RSS at ``rss_from``. Flat: every checked role's peak ratio within ``tolerance`` (so
    memory freed by the time the last session ends cannot hide growth in between)."""
    by = {s["sessions"]: s["rss"] for s in samples}
    a, b = by[rss_from], by[rss_to]
    window = [s["rss"] for s in samples if rss_from <= s["sessions"] <= rss_to]
    peak = {name: max(w[name] for w in window) for name in a}
    ratios = {name: round(b[name] / a[name], 4) if a[name] else None for name in a}
    peaks = {name: round(peak[name] / a[name], 4) if a[name] else None for name in a}

    def flat(names) -> bool:
        return all(peaks.get(n) is not None and peaks[n] <= 1.0 + tolerance for n in names if n in peaks)

    return {"rss_mib": {name: {"at_from": round(a[name] / 2**20, 1), "at_to": round(b[name] / 2**20, 1),
                               "peak": round(peak[name] / 2**20, 1)} for name in a},
            "rss_ratio": ratios, "rss_peak_ratio": peaks, "rss_flat": flat(CHECKED), "routers_flat": flat(ROUTERS)}


def table(samples: list[dict]) -> str:
    names = list(samples[0]["rss"])
    lines = ["| sessions done | in flight | " + " | ".join(f"{n} MiB" for n in names) + " |",
             "|" + "---|" * (len(names) + 2)]
    for s in samples:
        lines.append(f"| {s['sessions']} | {s['in_flight']} | "
                     + " | ".join(f"{s['rss'][n] / 2**20:.1f}" for n in names) + " |")
    return "\n".join(lines)


def parse(argv):
    p = argparse.ArgumentParser(prog="specsplit bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--distinct", type=int, default=100, help="distinct prompts, cycled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-from", type=int, default=200, help="the warm sample: RSS after this many sessions")
    p.add_argument("--sample-every", type=int, default=100)
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed RSS growth from --rss-from to the end")
    p.add_argument("--env-file", default=None,
                   help="the fleet's default settings (default: ./.env, which every specsplit command applies, "
                        "else the repository's; 'none': only what the command applied, and "
                        "SPECSPLIT_ENV_FILE= keeps it from applying ./.env)")
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    if not 0 < args.rss_from < args.sessions or args.concurrency < 1 or args.sample_every < 1 or args.distinct < 1:
        p.error("needs 0 < --rss-from < --sessions, --concurrency, --sample-every and --distinct >= 1")
    return args


def main(argv=None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: stop the fleet
    args = parse(argv)
    from specsplit.bench.fleetenv import fleet_defaults, fleet_env
    from specsplit.launch import Fleet
    from specsplit.logs import configure_logging

    configure_logging("WARNING")
    defaults = fleet_defaults(args.env_file)
    at = {*range(args.sample_every, args.sessions + 1, args.sample_every), args.rss_from, args.sessions}
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-bench-soak-"))
    fleet = Fleet.create(tmp, preset=args.preset, metrics=True, **fleet_env(defaults)).start(1, 1)
    log(f"fleet starting (logs in {tmp})")
    out = None
    try:
        fleet.wait_ready(timeout_s=900)
        sampler = Sampler(fleet, at)
        out = asyncio.run(soak(fleet, random_prompts(args.distinct, args.seed), args.sessions, args.concurrency,
                               args.max_new_tokens, sampler))
    finally:
        codes = fleet.stop()
        if out is None:
            log(f"fleet logs kept in {tmp}")
    samples = sorted(sampler.samples, key=lambda s: s["sessions"])
    check = rss_check(samples, args.rss_from, args.sessions, args.tolerance)
    ok = out["lost"] == 0 and out["diverged"] == 0 and check["rss_flat"]
    print(table(samples))
    print(f"\nsessions: {out['completed']}/{args.sessions} completed, {out['lost']} lost, {out['diverged']} diverged "
          f"({out['tok_s']} tok/s, {out['wall_s']} s); RSS at session {args.sessions} / at {args.rss_from}: "
          + ", ".join(f"{n} {r}" for n, r in check["rss_ratio"].items())
          + "; peak in between / at start: " + ", ".join(f"{n} {r}" for n, r in check["rss_peak_ratio"].items())
          + f" -> {'flat' if check['rss_flat'] else 'NOT flat'} (workers and orchestrator within "
            f"{100 * args.tolerance:g}%)")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in vars(args).items()} | {"env_file_defaults": defaults, "cpu_count": os.cpu_count(),
                                                         "exit_codes": codes}
        Path(args.json_path).write_text(json.dumps({"config": config, **out, **check, "ok": ok,
                                                    "samples": samples}, indent=2))
        log(f"wrote {args.json_path}")
    if ok:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        log(f"fleet logs kept in {tmp}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
