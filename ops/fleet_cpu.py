"""The host's work in each round of a fleet: CPU ms per decoding round of every process (the
orchestrator, each router, each worker) and the rounds' wall split from the orchestrator's trace.

The tiny preset's fleet (a router per role, a draft and a target worker at one thread each, an
orchestrator; growth on, the defaults otherwise), one prompt at a time after a warm-up, so each
process's CPU over the run (its supervisor's and its child's, from /proc) divided by the decoding
rounds is its per-round host cost; the tiny models' forwards are a few ms, as a GPU's are. The
orchestrator's figure is what ``specsplit bench replay --fleet`` leaves out (it sends the rounds
itself): add it to the replayed fleet's rounds for a whole fleet on that host.

    python ops/fleet_cpu.py --json runs/fleet-cpu.json
    python ops/fleet_cpu.py --prompts 4 --tokens 64 SPECSPLIT_GROW=false   # settings for every process
    python ops/fleet_cpu.py --pair     # both workers in one process (specsplit pair): one interpreter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specsplit.launch import Fleet, generate_all

TICK_MS = 1e3 / os.sysconf("SC_CLK_TCK")


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (a role's supervisor and the child doing its work)."""
    out = [pid]
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            out += tree_pids(int(child))
    return out


def cpu_ms(pid: int) -> float:
    """User + system CPU ms of ``pid`` and its descendants so far."""
    total = 0.0
    for p in tree_pids(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) * TICK_MS
    return total


def measure(prompts: int, tokens: int, settings: dict[str, str], seed: int = 0, pair: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="specsplit-fleet-cpu-") as tmp:
        trace = Path(tmp) / "trace.jsonl"
        fleet = Fleet.create(Path(tmp), preset="tiny", threads=1, SPECSPLIT_TRACE_FILE=str(trace), **settings)
        if pair:  # both workers in one process (``specsplit pair``, Procfile.gpu's)
            fleet.start_routers()
            fleet.spawn("pair", "pair", env={"HONCHO_PROCESS_NAME": "pair.1"})
            fleet.spawn("orchestrator", "orchestrator")
        else:
            fleet.start()
        try:
            fleet.wait_ready()
            rng = random.Random(seed)
            texts = [[rng.randrange(3, 400) for _ in range(rng.randrange(24, 64))] for _ in range(prompts + 1)]
            asyncio.run(generate_all(fleet.orchestrator, texts[:1], 16))  # warm-up: first calls, allocators
            seen = len(trace.read_text().splitlines()) if trace.exists() else 0
            before = {name: cpu_ms(proc.pid) for name, proc in fleet.procs.items()}
            t0 = time.perf_counter()
            for text in texts[1:]:
                asyncio.run(generate_all(fleet.orchestrator, [text], tokens))
            wall_s = time.perf_counter() - t0
            after = {name: cpu_ms(proc.pid) for name, proc in fleet.procs.items()}
            lines = [json.loads(line) for line in trace.read_text().splitlines()[seen:]]
        finally:
            fleet.stop()
    rounds = [r for r in lines if r.get("kind") == "round"]
    clean = [r for r in rounds if r.get("clean")]
    if not rounds:
        raise SystemExit("fleet_cpu: the orchestrator traced no round")

    def med(key: str, rows=clean) -> float:
        return round(statistics.median(r[key] for r in rows), 3) if rows else 0.0

    other = [r["wall_ms"] - r["draft_ms"] - r["verify_ms"] for r in clean]

    def mean(fn) -> float:
        return round(statistics.fmean(fn(r) for r in clean), 3) if clean else 0.0

    # a clean round's wall on the orchestrator's clock, in parts that add up (means)
    split = {"draft (engine)": mean(lambda r: r["draft_ms"]),
             "draft round trip, lookups, merge, select": mean(lambda r: r["propose_ms"] - r["draft_ms"]),
             "verify (engine)": mean(lambda r: r["verify_ms"]),
             "verify round trip": mean(lambda r: r["verify_rpc_ms"] - r["verify_ms"]),
             "plan, commit, stream": mean(lambda r: r["wall_ms"] - r["propose_ms"] - r["verify_rpc_ms"])}
    drafted = [r for r in clean if r["drafted_nodes"] > 0]
    return {
        "rounds": len(rounds), "clean_rounds": len(clean), "wall_s": round(wall_s, 3),
        # clean rounds that drafted; re-rooted a grown tree here (SPECSPLIT_GROW_REROOT: no draft round trip)
        # or in the draft
        "drafted_rounds": len(drafted),
        "rerooted_here": sum(1 for r in drafted if r["reused"] > 0 and r["rerooted_here"]),
        "rerooted_by_draft": sum(1 for r in drafted if r["reused"] > 0 and not r["rerooted_here"]),
        "wall_ms_per_round": round(wall_s * 1e3 / len(rounds), 3),
        "tokens_per_round": round(statistics.fmean(len(r["accepted_token_ids"]) + 1 for r in clean), 3) if clean else 0,
        "cpu_ms_per_round": {name: round((after[name] - before[name]) / len(rounds), 3) for name in before},
        "trace_median_ms": {"wall": med("wall_ms"), "draft": med("draft_ms"), "verify": med("verify_ms"),
                            "other": round(statistics.median(other), 3) if other else 0.0},
        "wall_split_mean_ms": split,
        # learning, tracing and logging a round, and the sessions' starts and ends
        "between_rounds_mean_ms": round(wall_s * 1e3 / len(rounds) - statistics.fmean(r["wall_ms"] for r in rounds), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=128, help="new tokens a prompt")
    p.add_argument("--json", dest="json_path", metavar="FILE")
    p.add_argument("--pair", action="store_true", help="both workers in one process (specsplit pair), not one each")
    p.add_argument("settings", nargs="*", metavar="NAME=VALUE", help="SPECSPLIT_* settings for every process")
    args = p.parse_args(argv)
    settings = dict(s.split("=", 1) for s in args.settings)
    out = measure(args.prompts, args.tokens, settings, pair=args.pair)
    print(f"{out['rounds']} rounds, {out['tokens_per_round']} tokens a round, {out['wall_ms_per_round']} ms a round")
    print(f"{out['drafted_rounds']} clean drafted rounds: {out['rerooted_here']} re-rooted here (no draft round trip), "
          f"{out['rerooted_by_draft']} by the draft")
    print("| process | CPU ms a round |\n|---|---:|")
    for name, ms in out["cpu_ms_per_round"].items():
        print(f"| {name} | {ms:.2f} |")
    t = out["trace_median_ms"]
    print(f"trace medians: wall {t['wall']} ms = draft {t['draft']} + verify {t['verify']} + other {t['other']}")
    print("| a clean round's wall (mean) | ms |\n|---|---:|")
    for part, ms in out["wall_split_mean_ms"].items():
        print(f"| {part} | {ms:.2f} |")
    print(f"| (between rounds: learning, trace, log, sessions' ends) | {out['between_rounds_mean_ms']:.2f} |")
    if args.json_path:
        config = {"prompts": args.prompts, "tokens": args.tokens, "settings": settings, "pair": args.pair,
                  "cpus": os.cpu_count(),
                  "machine": platform.processor() or platform.machine(), "python": platform.python_version()}
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps({"config": config, **out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
