"""``specsplit bench netem``: tok/s of a fleet spread over network namespaces (CURVE on) with a
netem delay on the target host's link, relative to the same fleet on one host (loopback).

Needs root and iproute2 (specsplit.netns); the delay is a netem qdisc where the kernel has
sch_netem, else ``specsplit.delayrelay`` (a userspace TCP relay in the target's namespace that
delays what the target sends; ``--link-delay`` picks). First a one-host fleet
(loopback, no CURVE) runs the prompts; then the namespaced fleet (routers, draft, target,
orchestrator and producer each in its own namespace) runs them once per delay, the delay applied
to everything the target host sends (so each target round trip gets that much longer). Each run
is preceded by one warm-up request. Greedy, so every run must give the one-host tokens
(``same_output``). Prints a markdown table; ``--json FILE`` writes the rows.

    specsplit bench netem --delays 0,1,5,15                     # the real pair (SPECSPLIT_PRESET)
    specsplit bench netem --preset tiny --delays 0,1 --max-new-tokens 16   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case.",
    "Write a Python class for a fixed-size LRU cache with get and put methods.",
    "Write a Python function that merges two sorted lists into one sorted list.",
)


def _prompt_ids(preset: str, n: int) -> list[list[int]]:
    """The prompts, tokenized by the preset's target tokenizer (random ids if it has none)."""
    try:
        from specsplit.models import ModelSettings, resolve_model_paths
        from specsplit.produce import PromptCodec

        codec = PromptCodec(resolve_model_paths(ModelSettings(preset=preset)).target)
        return [codec.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]
    except (OSError, ValueError) as exc:
        print(f"bench netem: no tokenizer for preset {preset} ({exc}); random prompts", file=sys.stderr)
        rng = random.Random(0)
        return [[rng.randrange(400) for _ in range(12)] for _ in range(n)]


def _one_host(tmp: Path, preset: str, threads: int, prompts, max_new_tokens: int, env: dict) -> dict:
    from specsplit.launch import Fleet, generate_all

    fleet = Fleet.create(tmp / "one-host", preset=preset, threads=threads, **env)
    try:
        fleet.start().wait_ready(timeout_s=900)
        asyncio.run(generate_all(fleet.orchestrator, prompts[:1], 4))  # warm-up
        t0 = time.perf_counter()
        results = asyncio.run(generate_all(fleet.orchestrator, prompts, max_new_tokens))
        wall = time.perf_counter() - t0
    finally:
        fleet.stop()
    return {"wall_s": wall, "tokens": sum(len(r.token_ids) for r in results),
            "token_ids": [r.token_ids for r in results]}


def run(delays: list[float], preset: str, threads: int, n_prompts: int, max_new_tokens: int,
        link_delay: str = "auto") -> list[dict]:
    from specsplit.netns import NetnsFleet, NetnsLab, netem_unavailable, netns_unavailable

    why = netns_unavailable()
    if why:
        raise SystemExit(f"specsplit bench netem: {why}")
    no_netem = netem_unavailable() if any(d > 0 for d in delays) else None
    if link_delay == "netem" and no_netem:
        raise SystemExit(f"specsplit bench netem: {no_netem} (--link-delay relay emulates the delay in userspace)")
    relay = link_delay == "relay" or (link_delay == "auto" and no_netem is not None)
    if relay and no_netem:
        print(f"bench netem: {no_netem}; the target's link delay is emulated by specsplit.delayrelay",
              file=sys.stderr, flush=True)
    from specsplit.bench.fleetenv import fleet_defaults, fleet_env

    env = fleet_env(fleet_defaults())  # both fleets run the operator's .env kernels (int8 by default)
    prompts = _prompt_ids(preset, n_prompts)
    rows = []
    with tempfile.TemporaryDirectory(prefix="specsplit-netem-") as tmp:
        tmp = Path(tmp)
        base = _one_host(tmp, preset, threads, prompts, max_new_tokens, env)
        base_tok_s = base["tokens"] / base["wall_s"]
        rows.append({"setup": "one host (loopback)", "delay_ms": None, "tok_s": base_tok_s, "relative": 1.0,
                     "same_output": True, "tokens": base["tokens"]})
        with NetnsLab(net=random.randrange(1, 250)) as lab:
            fleet = NetnsFleet(lab, tmp / "netns", preset=preset, threads=threads, relay=relay, **env)
            try:
                fleet.start().wait_ready(timeout_s=900)
                fleet.produce(prompts[:1], 4)  # warm-up
                for delay in delays:
                    fleet.set_target_delay(delay)
                    out = fleet.produce(prompts, max_new_tokens, timeout_s=1800)
                    tok_s = out["tokens"] / out["wall_s"]
                    same = [r["token_ids"] for r in out["results"]] == base["token_ids"]
                    setup = "namespaces + CURVE" + (" + delay relay" if relay else "")
                    rows.append({"setup": setup, "delay_by": "relay" if relay else "netem", "delay_ms": delay,
                                 "tok_s": tok_s,
                                 "relative": tok_s / base_tok_s, "same_output": same, "tokens": out["tokens"]})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            finally:
                fleet.stop()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| setup | target link delay | tok/s | vs one host | same output |", "|---|---|---|---|---|"]
    for r in rows:
        delay = "-" if r["delay_ms"] is None else f"{r['delay_ms']:g} ms"
        lines.append(f"| {r['setup']} | {delay} | {r['tok_s']:.2f} | {r['relative']:.2f}x | {r['same_output']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specsplit bench netem", description=__doc__.split("\n\n")[0])
    p.add_argument("--delays", default="0,1,5,15", help="netem delays on the target host's link, ms (comma list)")
    p.add_argument("--preset", default=os.environ.get("SPECSPLIT_PRESET", "qwen-coder"))
    p.add_argument("--threads", type=int, default=1, help="SPECSPLIT_THREADS of each worker")
    p.add_argument("--prompts", type=int, default=4, help="prompts, run concurrently")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--link-delay", choices=["auto", "netem", "relay"], default="auto",
                   help="how the delay is made: tc netem, the userspace specsplit.delayrelay (for kernels without "
                        "sch_netem; the target reaches its router through it at every delay, 0 included), or "
                        "netem where the kernel has it (auto)")
    p.add_argument("--json", dest="json_out", help="write the rows here")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: fleets, namespaces
    try:
        delays = [float(d) for d in args.delays.split(",") if d.strip()]
    except ValueError:
        p.error(f"--delays: numbers in ms, got {args.delays!r}")
    if any(d < 0 for d in delays):
        p.error("--delays must be >= 0")
    rows = run(delays, args.preset, args.threads, args.prompts, args.max_new_tokens, args.link_delay)
    print(table(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["same_output"] for r in rows) else 1
