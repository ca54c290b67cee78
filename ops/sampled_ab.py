"""Sampled decoding's speed on the real pair, this checkout's code against another's: two default
fleets side by side (``honcho start``), the same sampled requests (llama-server's default chain
of top-k 40, top-p 0.95, min-p 0.05 at temperature 0.8, a fixed seed each) through the
``openai`` client to each in turn, the first fleet alternating: fill-in-the-middle gaps and
chat questions. Prints per request the tokens, seconds and tokens a round of each, and the
rounds' draft and verify milliseconds from the orchestrators' logs; writes JSON. Answers are
compared, not required to be equal (a distribution computed in another order may differ in its
last bit, and a draw at that edge goes the other way).

    git worktree add /tmp/before COMMIT
    python ops/sampled_ab.py --ref-source /tmp/before --json ops/results/sampled-ab-qwen-coder-cpu2-amx.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.api_fim_real_pair import GAPS
from ops.api_real_pair import start_fleet, stop_fleet, wait_health

SAMPLING = {"temperature": 0.8, "top_p": 0.95, "extra_body": {"top_k": 40, "min_p": 0.05}}
QUESTIONS = ["Write a Python function that checks whether a string is a palindrome, with a docstring.",
             "Explain what a Python generator is, with a short example.",
             "Write a function that merges two sorted lists into one sorted list."]


def ask(client, model: str, task, max_new: int, seed: int) -> dict:
    t0 = time.perf_counter()
    if isinstance(task, tuple):
        res = client.completions.create(model=model, prompt=task[0], suffix=task[1], max_tokens=max_new, seed=seed,
                                        **SAMPLING)
        text = res.choices[0].text
    else:
        res = client.chat.completions.create(model=model, messages=[{"role": "user", "content": task}],
                                             max_tokens=max_new, seed=seed, **SAMPLING)
        text = res.choices[0].message.content
    wall = time.perf_counter() - t0
    spec = res.choices[0].model_extra.get("speculative") or {}
    return {"text": text, "tokens": res.usage.completion_tokens, "wall_s": wall,
            "tokens_per_round": spec.get("mean_accepted_length")}


def rounds(log: Path) -> dict:
    """The orchestrator's ``round_done`` lines: how many, tokens accepted, draft and verify ms."""
    rows = [dict(re.findall(r"(\w+)=([-\d.]+)", line)) for line in log.read_text(errors="replace").splitlines()
            if "round_done" in line]

    def mean(key):
        return round(sum(float(r.get(key, 0)) for r in rows) / max(1, len(rows)), 2)

    return {"rounds": len(rows), "accepted": mean("accepted"), "draft_ms": mean("draft_ms"),
            "verify_ms": mean("verify_ms")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref-source", required=True, help="the second fleet runs this checkout's code")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from openai import OpenAI

    tasks = [*GAPS, *QUESTIONS]
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-sampled-ab-"))
    fleets, rows = {}, []
    try:
        for name, settings in (("this", {}), ("ref", {"repo": Path(args.ref_source).resolve()})):
            (tmp / name).mkdir()
            fleets[name] = start_fleet(tmp / name, SPECSPLIT_LOOKUP_CACHE_KEYS="0", **settings)
        clients = {}
        for name, (proc, url) in fleets.items():
            wait_health(url, proc)
            clients[name] = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
        model = httpx.get(f"{fleets['this'][1]}/v1/models", timeout=10).json()["data"][0]["id"]
        for i, task in enumerate(tasks):
            order = ["this", "ref"] if i % 2 == 0 else ["ref", "this"]
            row = {"task": task if isinstance(task, str) else task[0][:60],
                   **{name: ask(clients[name], model, task, args.max_new_tokens, 1000 + i) for name in order}}
            row["identical"] = row["this"]["text"] == row["ref"]["text"]
            rows.append(row)
            a, b = row["this"], row["ref"]
            print(f"{row['task'][:40]!r:44s} this {a['tokens']:3d} tok {a['wall_s']:6.2f} s  "
                  f"ref {b['tokens']:3d} tok {b['wall_s']:6.2f} s  identical={row['identical']}", flush=True)
    finally:
        for proc, _ in fleets.values():
            stop_fleet(proc)
    tok_s = {n: sum(r[n]["tokens"] for r in rows) / sum(r[n]["wall_s"] for r in rows) for n in ("this", "ref")}
    report = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d"), "ref": args.ref_source, "sampling": SAMPLING,
              "max_new_tokens": args.max_new_tokens, "rows": rows, "tok_s": tok_s,
              "speedup": tok_s["this"] / tok_s["ref"], "identical": sum(r["identical"] for r in rows),
              "rounds": {n: rounds(tmp / n / "fleet.log") for n in ("this", "ref")}}
    print(f"tok/s this {tok_s['this']:.2f}, ref {tok_s['ref']:.2f}: {report['speedup']:.3f}x; identical "
          f"{report['identical']}/{len(rows)}; rounds {report['rounds']} (fleet logs: {tmp})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
