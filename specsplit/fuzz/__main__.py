"""``python -m specsplit.fuzz [--seed N] [--count N] [--dir PATH]``: start a tiny fleet (real
processes, ``specsplit.launch``), generate a few fixed prompts greedily, fuzz every socket,
then check that no process died or restarted and that the same prompts give the same tokens.
Seed and count default to ``SPECSPLIT_FUZZ_SEED`` (random when unset) and
``SPECSPLIT_FUZZ_COUNT`` (10000). Exit 0 when everything held, 1 otherwise.

``--target http [--url http://127.0.0.1:PORT] [--case I ...]``: fuzz a running ``specsplit api``
over HTTP instead (``specsplit.fuzz.http``; its limits are read from the same settings as the
API's, SPECSPLIT_API_*); ``--case`` reruns only the named cases of the seed."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specsplit.fuzz.run import FleetAddrs, Fuzzer, Report

PROMPTS = ([3, 14, 15, 92, 65, 35, 89, 79], [2, 7, 1, 8, 2, 8], [100, 200, 300, 42])
MAX_NEW = 16
_STARTED = re.compile(r"role_started role=\S+ pid=(\d+)")


def default_seed() -> int:
    raw = os.environ.get("SPECSPLIT_FUZZ_SEED", "")
    return int(raw) if raw else random.SystemRandom().randrange(2**32)


def default_count() -> int:
    return int(os.environ.get("SPECSPLIT_FUZZ_COUNT", "10000"))


@dataclass
class FleetFuzz:
    report: Report
    before: list[list[int]]
    after: list[list[int]]
    problems: list[str] = field(default_factory=list)  # crashed / restarted processes, changed output
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.report.failures


def child_pids(log: str) -> list[int]:
    """PIDs of the role's working children, one per (re)start, from the supervisor's log lines."""
    return [int(m) for m in _STARTED.findall(log)]


def process_problems(fleet, children: dict[str, list[int]]) -> list[str]:
    out = []
    for name, proc in fleet.procs.items():
        log = fleet.log(name)
        if proc.poll() is not None:
            out.append(f"{name} (pid {proc.pid}) exited with {proc.returncode}:\n{log[-1500:]}")
        now = child_pids(log)
        if now != children[name] or "role_died" in log:
            out.append(f"{name}'s child restarted: pids {children[name]} -> {now}:\n{log[-1500:]}")
        for pid in now[-1:]:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                out.append(f"{name}'s child {pid} is gone")
    return out


def generate(fleet) -> list[list[int]]:
    from specsplit.launch import generate_all

    async def run():
        return await asyncio.wait_for(generate_all(fleet.orchestrator, list(PROMPTS), MAX_NEW), 120)

    return [r.token_ids for r in asyncio.run(run())]


def fuzz_fleet(tmp: Path, seed: int, count: int, deadline_s: float = 60.0) -> FleetFuzz:
    """Start a fleet in ``tmp``, fuzz it with ``count`` messages from ``seed``, stop it."""
    from specsplit.launch import Fleet

    t0 = time.monotonic()
    fleet = Fleet.create(tmp, SPECSPLIT_RPC_TIMEOUT_S=5, SPECSPLIT_MAX_ATTEMPTS=8)
    fleet.start(drafts=1, targets=1)
    try:
        fleet.wait_ready(drafts=1, targets=1, timeout_s=120)
        timings = {"start_s": time.monotonic() - t0}
        before = generate(fleet)
        children = {name: child_pids(fleet.log(name)) for name in fleet.procs}
        vocab = int(re.search(r"vocab=(\d+)", fleet.log("draft0")).group(1))
        addrs = FleetAddrs(draft_fe=fleet.addr("draft_fe"), draft_be=fleet.addr("draft_be"),
                           target_fe=fleet.addr("target_fe"), target_be=fleet.addr("target_be"),
                           orchestrator=fleet.orchestrator, worker_ids={"draft": b"draft-0", "target": b"target-0"},
                           secret=fleet.secret())
        t1 = time.monotonic()
        report = Fuzzer(addrs, seed, count, vocab=vocab, deadline_s=deadline_s).run()
        timings["fuzz_s"] = time.monotonic() - t1
        problems = process_problems(fleet, children)
        after = generate(fleet)
        problems += process_problems(fleet, children)
        if after != before:
            problems.append(f"greedy output changed by the fuzz run: {before} -> {after}")
        timings["total_s"] = time.monotonic() - t0
        return FleetFuzz(report, before, after, problems, timings)
    finally:
        fleet.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specsplit.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--count", type=int, default=None)
    ap.add_argument("--dir", type=Path, default=None, help="where the fleet's logs go (default: a temp dir)")
    ap.add_argument("--target", choices=("fleet", "http"), default="fleet",
                    help="fleet: start a tiny fleet and fuzz its ZeroMQ sockets; http: fuzz a running API over HTTP")
    ap.add_argument("--url", default=None, help="http: the API, http://127.0.0.1:PORT (default: SPECSPLIT_API_PORT's)")
    ap.add_argument("--case", type=int, action="append", default=None, help="http: only this case (repeatable)")
    args = ap.parse_args(argv)
    seed = default_seed() if args.seed is None else args.seed
    count = default_count() if args.count is None else args.count
    if args.target == "http":
        return http_main(args.url, seed, count, args.case)
    os.environ.setdefault("SPECSPLIT_PRESET", "tiny")
    print(f"fuzz seed={seed} count={count} (SPECSPLIT_FUZZ_SEED={seed} reproduces it)", flush=True)
    tmp = args.dir or Path(tempfile.mkdtemp(prefix="specsplit-fuzz-"))
    res = fuzz_fleet(tmp, seed, count)
    print(res.report.summary())
    print(f"timings={res.timings} logs={tmp}")
    for line in res.problems + res.report.failures[:50]:
        print("FAIL", line)
    return 0 if res.ok else 1


def http_main(url: str | None, seed: int, count: int, cases: list[int] | None) -> int:
    from specsplit.api.settings import ApiSettings
    from specsplit.fuzz.http import ApiLimits, fuzz_api

    settings = ApiSettings()
    url = url or f"http://127.0.0.1:{settings.api_port}"
    what = f"cases={cases}" if cases else f"count={count}"
    print(f"http fuzz of {url} seed={seed} {what} (SPECSPLIT_FUZZ_SEED={seed} reproduces it)", flush=True)
    res = fuzz_api(url, seed, count, ApiLimits.of(settings), cases=cases)
    print(res.report.summary())
    print(f"timings={res.timings}")
    for line in res.problems + res.report.failures:
        print("FAIL", line)
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
