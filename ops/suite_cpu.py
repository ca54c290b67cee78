#!/usr/bin/env python3
"""Where the test suite's CPU goes: runs ``./ops/test.sh`` (or reads a record already made) with
every Python process it starts recording, as it exits, its CPU seconds, argv and the test that
started it (pytest's PYTEST_CURRENT_TEST, inherited). Prints the machine's busy CPU over the run
(/proc/stat: containers and other tenants' load included) and tables by role and by test file,
and writes them as JSON.

    python3 ops/suite_cpu.py [--json F] [-- PYTEST ARGS]     # runs ./ops/test.sh
    python3 ops/suite_cpu.py --record procs.jsonl [--json F]  # summarizes a record

A process killed with SIGKILL records nothing (the kill tests' victims), nor do containers; the
machine-wide figure counts both. Figures: docs/results.md, "The test suite".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# imported by every Python process started with this folder on PYTHONPATH (site's sitecustomize)
RECORDER = '''import atexit, json, os, resource, sys, time
_t0 = time.time()
def _record():
    r = resource.getrusage(resource.RUSAGE_SELF)
    row = {"pid": os.getpid(), "argv": sys.argv[:8], "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
           "wall_s": round(time.time() - _t0, 3), "cpu_s": round(r.ru_utime + r.ru_stime, 3)}
    try:
        with open(os.environ["SPECSPLIT_SUITE_CPU_RECORD"], "a") as f:
            f.write(json.dumps(row) + "\\n")
    except OSError:
        pass
atexit.register(_record)
'''
ROLES = ("router", "draft", "target", "orchestrator", "api", "produce", "bench", "models", "config")


def busy_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every CPU since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def role(argv: list[str]) -> str:
    """A ``specsplit ROLE`` process's role (its supervisor counts with it), else what ran."""
    args = " ".join(argv)
    if "specsplit" in args and "pytest" not in args:
        for name in ROLES:
            if f" {name}" in f" {args} ":
                return name
    if "pytest" in args or args.startswith("-c"):  # the pytest process and its xdist workers
        return "tests in-process"
    return "other"


def summarize(rows: list[dict]) -> dict:
    by_role, by_file = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for r in rows:
        name = role(r["argv"])
        by_role[name][0] += 1
        by_role[name][1] += r["cpu_s"]
        if name != "tests in-process":
            test_file = r["test"].split("::")[0] or "(no test)"
            by_file[test_file][0] += 1
            by_file[test_file][1] += r["cpu_s"]
    order = lambda d: {k: {"processes": n, "cpu_s": round(c, 1)} for k, (n, c) in sorted(d.items(), key=lambda kv: -kv[1][1])}
    return {"processes": len(rows), "cpu_s": round(sum(r["cpu_s"] for r in rows), 1),
            "by_role": order(by_role), "started_by_test_file": order(by_file)}


def table(title: str, data: dict, top: int = 25) -> str:
    lines = [f"| {title} | processes | CPU s |", "|---|---:|---:|"]
    lines += [f"| {k} | {v['processes']} | {v['cpu_s']} |" for k, v in list(data.items())[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", help="summarize this record instead of running the suite")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("pytest_args", nargs="*", help="after --: passed to ./ops/test.sh")
    args = p.parse_args(argv)
    run = {}
    if args.record:
        record = Path(args.record)
    else:
        folder = Path(tempfile.mkdtemp(prefix="suite-cpu-"))
        (folder / "sitecustomize.py").write_text(RECORDER)
        record = folder / "procs.jsonl"
        env = {**os.environ, "SPECSPLIT_SUITE_CPU_RECORD": str(record),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
        (b0, t0), w0 = busy_ticks(), time.monotonic()
        rc = subprocess.run([str(REPO / "ops" / "test.sh"), *args.pytest_args], env=env, check=False).returncode
        (b1, t1), wall = busy_ticks(), time.monotonic() - w0
        hz = os.sysconf("SC_CLK_TCK")
        run = {"rc": rc, "wall_s": round(wall, 1), "machine_busy_cpu_s": round((b1 - b0) / hz, 1),
               "machine_busy_fraction": round((b1 - b0) / max(1, t1 - t0), 3), "cpus": os.cpu_count()}
        print(f"\n./ops/test.sh: rc {rc}, {wall:.0f} s; the machine's CPUs busy {run['machine_busy_cpu_s']:.0f} s "
              f"({run['machine_busy_fraction']:.0%} of {run['cpus']} CPUs)")
    rows = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    summary = {**run, **summarize(rows), "record": str(record)}
    print(f"\n{summary['processes']} Python processes recorded {summary['cpu_s']} CPU s\n")
    print(table("role", summary["by_role"]) + "\n")
    print(table("processes started by", summary["started_by_test_file"]))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return run.get("rc", 0)


if __name__ == "__main__":
    sys.exit(main())
