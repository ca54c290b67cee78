"""A/B of the first round's overlap (``SPECSPLIT_OVERLAP_PREFILL``) on one fleet, in one run.

One fleet as people start it (``honcho start``, the repository's Procfile and .env, the default
real pair), plus a second orchestrator on the same routers and workers that differs in one
setting (``--a-env``, ``--b-env``: by default the overlap on and off). Every prompt goes to both orchestrators, greedy,
the order alternating prompt by prompt so that the machine's drift weighs on both alike. The
workers' prefix caches are off (``SPECSPLIT_*_PREFIX_CACHE_GB=0``): each door meets each prompt
cold, as a new conversation does. Per door: time to first token (the orchestrator's
``first_token_ms``, from the request's arrival), the whole answer's time and tokens, and whether
the two doors' answers are identical (greedy: they must be; the exit code is 1 otherwise).

    python ops/first_round_ab.py --prompts humaneval --limit 10 --json ops/results/first-round-ab.json
    python ops/first_round_ab.py --prompts chat10 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default="humaneval", help="humaneval, or a named set / JSONL file (chat10)")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1, help="passes over the prompts (each prompt twice per pass)")
    p.add_argument("--a-env", default="SPECSPLIT_OVERLAP_PREFILL=true",
                   help="comma list of KEY=VALUE: door A's orchestrator settings (the fleet's own orchestrator)")
    p.add_argument("--b-env", default="SPECSPLIT_OVERLAP_PREFILL=false",
                   help="comma list of KEY=VALUE: door B's orchestrator settings (a second one on the same workers)")
    p.add_argument("--fleet-env", default="", help="comma list of KEY=VALUE: settings of the whole fleet (both doors)")
    p.add_argument("--pin", action="store_true",
                   help="pin the draft worker to core 0 and the target worker to core 1 (every thread), as if each "
                        "had a machine of its own; give both one thread (--fleet-env SPECSPLIT_THREADS=1,...)")
    p.add_argument("--nice-draft", type=int, default=0,
                   help="renice the draft worker (every thread) by this much once it runs (an experiment)")
    p.add_argument("--json", dest="json_path")
    return p.parse_args(argv)


async def ask(addr: str, ids: list[int], max_new: int, stop: list[int]) -> dict:
    from specsplit.client import SpecSplitClient

    async with SpecSplitClient(addr, timeout_s=600.0) as client:
        r = await client.generate(ids, max_new_tokens=max_new, stop_token_ids=stop)
    return {"tokens": list(r.token_ids), "first_token_ms": r.orchestrator_first_token_ms,
            "elapsed_ms": r.elapsed_s * 1e3, "rounds": r.rounds, "finish": r.finish_reason}


async def ready(addr: str, fleet, timeout_s: float = 900.0) -> None:
    """Until the orchestrator at ``addr`` answers a one-token request (workers loaded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        fleet.check()
        try:
            await asyncio.wait_for(ask(addr, [1, 2, 3], 1, []), 60)
            return
        except Exception:  # not up yet: retry until the deadline
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(2)


def main(argv=None) -> int:
    a = parse(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from specsplit.bench.fleetenv import environ_with, fleet_defaults
    from specsplit.bench.honcho import HonchoFleet
    from specsplit.bench.systems import humaneval_prompts, jsonl_prompts
    from specsplit.launch import free_ports
    from specsplit.models import ModelSettings, resolve_model_paths
    from specsplit.produce import PromptCodec

    defaults = fleet_defaults(None)
    with environ_with(defaults):
        paths = resolve_model_paths(ModelSettings())
    codec = PromptCodec(paths.target)
    texts = (humaneval_prompts() if a.prompts == "humaneval" else jsonl_prompts(a.prompts))[a.offset:a.offset + a.limit]
    prompts = [codec.encode(t) for t in texts]
    a_env, b_env = (dict(kv.split("=", 1) for kv in e.split(",") if kv) for e in (a.a_env, a.b_env))
    tmp = Path(tempfile.mkdtemp(prefix="first-round-ab-"))
    cold = {"SPECSPLIT_TARGET_PREFIX_CACHE_GB": "0", "SPECSPLIT_DRAFT_PREFIX_CACHE_GB": "0"}
    fleet_env = dict(kv.split("=", 1) for kv in a.fleet_env.split(",") if kv)
    fleet = HonchoFleet(tmp, ModelSettings().preset, defaults, **cold, **fleet_env, **a_env).start()
    (b_port,) = free_ports(1)
    b_addr = f"tcp://127.0.0.1:{b_port}"
    fleet.beside("orchestrator", "b", SPECSPLIT_ORCHESTRATOR=b_addr, **b_env)
    doors = {"A": fleet.orchestrator, "B": b_addr}
    rows: list[dict] = []
    bad = 0
    try:
        loop = asyncio.new_event_loop()
        for name, addr in doors.items():
            loop.run_until_complete(ready(addr, fleet))
            print(f"door {name} ready ({addr})", flush=True)
        if a.nice_draft:
            draft_pid = fleet.child("draft.1")
            for tid in os.listdir(f"/proc/{draft_pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), a.nice_draft)
        if a.pin:
            for core, slot in enumerate(("draft.1", "target.1")):
                subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(fleet.child(slot))], check=True,
                               stdout=subprocess.DEVNULL)
        for rep in range(a.repeat):
            for i, ids in enumerate(prompts):
                order = ("A", "B") if (i + rep) % 2 == 0 else ("B", "A")
                got = {d: loop.run_until_complete(ask(doors[d], ids, a.max_new_tokens, codec.stop_token_ids))
                       for d in order}
                same = got["A"]["tokens"] == got["B"]["tokens"]
                bad += not same
                rows.append({"prompt": a.offset + i, "pass": rep, "prompt_tokens": len(ids), "order": "".join(order),
                             "identical": same, **{f"{d}_{k}": v for d in "AB" for k, v in got[d].items() if k != "tokens"},
                             "new_tokens": len(got["A"]["tokens"])})
                r = rows[-1]
                print(f"prompt {r['prompt']:3d} ({r['prompt_tokens']:4d} tok) first token A {r['A_first_token_ms']:7.1f} ms "
                      f"B {r['B_first_token_ms']:7.1f} ms | answer A {r['A_elapsed_ms']:7.1f} ms "
                      f"B {r['B_elapsed_ms']:7.1f} ms | {'same' if same else 'DIFFERENT'}", flush=True)
    finally:
        fleet.stop()

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows if r[key] is not None)

    summary = {
        "first_token_ms": {"A": med("A_first_token_ms"), "B": med("B_first_token_ms")},
        "elapsed_ms": {"A": med("A_elapsed_ms"), "B": med("B_elapsed_ms")},
        "first_token_ratio_B_over_A": statistics.median(r["B_first_token_ms"] / r["A_first_token_ms"] for r in rows),
        "elapsed_ratio_B_over_A": statistics.median(r["B_elapsed_ms"] / r["A_elapsed_ms"] for r in rows),
        "identical": f"{len(rows) - bad}/{len(rows)}",
    }
    print("\n| door | settings | first token (median ms) | answer (median ms) |\n|---|---|---|---|")
    print(f"| A | {a.a_env} | {summary['first_token_ms']['A']:.0f} | {summary['elapsed_ms']['A']:.0f} |")
    print(f"| B | {a.b_env} | {summary['first_token_ms']['B']:.0f} | {summary['elapsed_ms']['B']:.0f} |")
    print(f"\nper prompt, median B/A: first token {summary['first_token_ratio_B_over_A']:.2f}x, "
          f"answer {summary['elapsed_ratio_B_over_A']:.2f}x; identical {summary['identical']}")
    if a.json_path:
        from specsplit.bench.api import machine_info

        out = {"machine": machine_info(), "args": vars(a), "fleet_settings": fleet_env, "summary": summary, "rows": rows}
        Path(a.json_path).write_text(json.dumps(out, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
