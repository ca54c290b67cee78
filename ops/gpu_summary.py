"""The issue's GPU bars from one ``ops/gpu_check.sh run``'s JSON files, in one table (what a
session lent a device reads first: its minutes are few).

    python3 ops/gpu_summary.py DIR          # DIR: the run's $OUT (gpu-cost-*.json, gpu-replay-*.json)

Per ``specsplit bench gpu`` file: its graph body and each check against its bar (the 1-token
forward over the floor, 16 nodes over 1, 16 sessions x 4 over one session's), and the 1-token
milliseconds (and the GEMM tiles tuning chose, each with its speed-up over the default tile); per ``specsplit bench replay`` file: tokens a round and the fleet over the target
alone (verify only; with the draft replayed serially; grown during verify, the fleet's case where
the draft runs on its own device, judged against the bar; without a replayed draft, as for prompt
lookup alone, verify only is the fleet's; through the fleet's processes, ``--fleet``, its measured
rounds); from ``ops/fleet_cpu.py``'s file, the host's CPU and round trips a round. Standard
library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPLAY_BAR = 2.5  # the replayed HumanEval fleet over the target alone (issue 45)


def cost_rows(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    argv = data.get("command", "").split()
    body = "eager" if "--no-cuda-graphs" in argv else (
        argv[argv.index("--graph-body") + 1] if "--graph-body" in argv else "default")
    context = data.get("config", {}).get("context")
    one = {(r["tokens"], r["batch"]): r for r in data.get("grid", {}).get("target", []) if r.get("status") == "done"}
    ms = one.get((1, 1), {}).get("ms")
    rows = [f"| {path.name} | {body} | {context} | 1-token ms | {ms} | | |"]
    tiles = data.get("models", {}).get("target", {}).get("graphs", {}).get("gemm_tiles", {})
    rows += [f"| {path.name} | {body} | {context} | tile {kind} | {tile} | | |" for kind, tile in sorted(tiles.items())]
    for c in data.get("checks", []):
        rows.append(f"| {path.name} | {body} | {context} | {c['check']} | {c['value']} | {c['bar']} | {c['result']} |")
    return rows


def replay_rows(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    rows = []
    for trace, s in data.get("summary", {}).items():
        # the fleet's figure: grown during verify where the draft was replayed; else (prompt lookup
        # alone: no draft worker) verify only. The others bound it.
        # Through the fleet's processes (``--fleet``) its measured rounds are the figure.
        fleet = next(k for k in ("fleet_vs_alone", "grown_during_verify_vs_alone", "verify_only_vs_alone")
                     if k in s or k == "verify_only_vs_alone")
        processes = data.get("config", {}).get("processes", "")
        measured = "one process, two streams" if processes.startswith("one") else \
            "fleet processes, both roles in one worker (pair)" if "both roles" in processes else "fleet processes"
        for name, key in (("verify only", "verify_only_vs_alone"),
                          ("with replayed draft", "with_replayed_draft_vs_alone"),
                          ("grown during verify", "grown_during_verify_vs_alone"),
                          ("grown during verify, the draft re-rooting first", "grown_during_verify_draft_reroots_vs_alone"),
                          (measured, "fleet_vs_alone"),
                          (f"{measured}, alone's round trips", "fleet_vs_alone_wall")):
            if key in s:
                value = s[key]
                result = ("PASS" if value >= REPLAY_BAR else "FAIL") if key == fleet else "(bound)"
                rows.append(f"| {path.name} | {Path(trace).name} | {s.get('tokens_per_round')} | {name} / alone | "
                            f"{value} | {REPLAY_BAR} | {result} |")
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    print("| file | body | context | figure | value | bar | result |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(out.glob("gpu-cost*.json")):
        print("\n".join(cost_rows(path)))
    print()
    print("| file | trace | tokens a round | figure | value | bar | result |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(out.glob("gpu-replay*.json")):
        print("\n".join(replay_rows(path)))
    host = out / "fleet-cpu.json"
    if host.exists():  # ops/fleet_cpu.py: what the fleet replay leaves out, on this machine's CPUs
        data = json.loads(host.read_text())
        print()
        print("| fleet-cpu.json (tiny fleet, host CPUs) | ms a round |")
        print("|---|---:|")
        for name, ms in data.get("cpu_ms_per_round", {}).items():
            print(f"| CPU of {name} | {ms} |")
        for part, ms in data.get("wall_split_mean_ms", {}).items():
            print(f"| wall: {part} | {ms} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
