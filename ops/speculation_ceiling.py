"""How much speculation can pay on this machine at all: the target's verify forward costs, measured
as its worker runs them, and the speedups they allow even with a perfect, free draft.

A speculative round verifies ``k`` tokens per session (the root plus ``k - 1`` drafted nodes) in
one forward and delivers at most ``k`` of them. With every node accepted and drafting free, it
delivers ``k / ms(B, k)`` tokens per ms against plain decoding's ``1 / ms(B, 1)`` (``B`` sessions
sharing each forward in both), so ``ceiling(B, k) = k * ms(B, 1) / ms(B, k)`` bounds what any
draft, tree or cost model can reach at that load; ``break_even`` is the per-node acceptance at
which a chain of ``k`` tokens only pays for its forward (expected tokens ``(1 - a^k) / (1 - a)``
equal to ``ms(B, k) / ms(B, 1)``). Where a forward's cost grows with its tokens (a compute-bound
CPU), both bounds are low; where it is flat (a GPU at these sizes), speculation pays almost
whatever it drafts.

The target is the fleet's: ``SPECSPLIT_TARGET_ENGINE`` / ``SPECSPLIT_TARGET_THREADS`` /
``SPECSPLIT_TARGET_QUANTIZE`` as the worker reads them (``specsplit.workers.build_engine``). ``B``
sessions each prefill ``--context`` random tokens; each measured request re-verifies a chain of
random tokens on that prefix (its sync crops the cache back first), ``B`` of them in one
``verify_batch`` as the worker batches queued rounds; sizes run in rounds, interleaved, so that
the machine's drift hits them alike. Prints a markdown table and writes JSON with --json.

    OMP_WAIT_POLICY=PASSIVE python ops/speculation_ceiling.py --sessions 1,16 --json FILE
    SPECSPLIT_TARGET_ENGINE=llamacpp SPECSPLIT_TARGET_THREADS=2 python ops/speculation_ceiling.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time


def break_even(ratio: float, k: int) -> float | None:
    """The per-node acceptance ``a`` at which a chain of ``k`` tokens delivers ``ratio`` expected
    tokens ((1 - a^k) / (1 - a), bisection); None when even a = 1 delivers less."""
    if ratio <= 1.0:
        return 0.0
    if ratio > k:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a ** i for i in range(k)) < ratio:
            lo = a
        else:
            hi = a
    return hi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=300, help="prompt tokens each session prefills")
    p.add_argument("--sessions", default="1,16", help="comma list: sessions sharing each forward")
    p.add_argument("--tokens", default="1,2,3,4,5,6,8,12,16,24,32",
                   help="comma list: tokens each session's chain carries (root included)")
    p.add_argument("--repeat", type=int, default=5, help="measured forwards per size")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args()

    from schemas import CacheSync, ErrorReply, FlatTree, VerifyRequest
    from specsplit.config import WorkerSettings
    from specsplit.models import ModelSettings
    from specsplit.workers import build_engine

    settings, ms = WorkerSettings(), ModelSettings()
    levels = [int(x) for x in a.sessions.split(",")]
    sizes = sorted({int(x) for x in a.tokens.split(",")} | {1})
    settings = settings.model_copy(update={
        "worker_max_sessions": max(settings.worker_max_sessions, max(levels)),
        "max_tree_nodes": max(settings.max_tree_nodes, max(sizes)),
        "max_tree_depth": max(settings.max_tree_depth, max(sizes)),
    })
    engine, hello = build_engine("target", settings, ms)
    lo, hi = min(100, hello.vocab_size // 8), min(hello.vocab_size, 20000)  # ordinary ids, no specials
    describe = engine.backend.describe()
    print(f"target: {settings.engine_for('target')} {describe}", flush=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(lo, hi) for _ in range(a.context)] for _ in range(max(levels))]
    chains = {k: [rng.randrange(lo, hi) for _ in range(k - 1)] for k in sizes}
    rounds = [0] * len(prompts)

    def request(s: int, sync: CacheSync, k: int) -> VerifyRequest:
        rounds[s] += 1
        tokens = [prompts[s][-1]] + chains[k]
        return VerifyRequest(session_id=f"s{s}", round=rounds[s], sync=sync,
                             tree=FlatTree(token_ids=tokens, parents=list(range(-1, k - 1))))

    def forward(reqs: list[VerifyRequest]) -> float:
        t0 = time.perf_counter()
        replies = [engine.handle(reqs[0])] if len(reqs) == 1 else engine.verify_batch(reqs)
        ms_ = (time.perf_counter() - t0) * 1e3
        for r in replies:
            if isinstance(r, ErrorReply):
                raise SystemExit(f"target answered {r.code}: {r.message}")
        return ms_

    t0 = time.perf_counter()
    for s in range(len(prompts)):
        forward([request(s, CacheSync(base_len=0, append_token_ids=prompts[s][:-1], prompt_len=a.context), 1)])
    print(f"prefilled {len(prompts)} x {a.context} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
    kept = CacheSync(base_len=a.context - 1, prompt_len=a.context)
    samples: dict[tuple[int, int], list[float]] = {(b, k): [] for b in levels for k in sizes}
    for b in levels:
        for k in sizes:  # one warm-up forward per shape
            forward([request(s, kept, k) for s in range(b)])
    for _ in range(a.repeat):
        for b in levels:
            for k in sizes:
                samples[b, k].append(forward([request(s, kept, k) for s in range(b)]))

    rows = []
    for b in levels:
        plain = statistics.median(samples[b, 1])
        for k in sizes:
            ms_k = statistics.median(samples[b, k])
            ratio = ms_k / plain
            rows.append({"sessions": b, "tokens_per_session": k, "forward_tokens": b * k,
                         "forward_ms": round(ms_k, 3), "cost_vs_plain": round(ratio, 3),
                         "ceiling": round(k / ratio, 3), "break_even_acceptance":
                             None if (be := break_even(ratio, k)) is None else round(be, 3),
                         "samples_ms": [round(x, 3) for x in samples[b, k]]})
    print("\n| sessions | tokens each | forward ms | x plain forward | ceiling (all accepted, free draft) | break-even acceptance per node |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        be = "never" if r["break_even_acceptance"] is None else f"{r['break_even_acceptance']:.2f}"
        print(f"| {r['sessions']} | {r['tokens_per_session']} | {r['forward_ms']:.1f} | {r['cost_vs_plain']:.2f} "
              f"| {r['ceiling']:.2f}x | {be} |")
    best = {b: max((r for r in rows if r["sessions"] == b), key=lambda r: r["ceiling"]) for b in levels}
    for b, r in best.items():
        print(f"{b} session(s): at most {r['ceiling']:.2f}x plain decoding ({r['tokens_per_session']} tokens each)")
    if a.json_path:
        out = {"config": {**vars(a), "engine": settings.engine_for("target"), "backend": describe,
                          "threads": os.environ.get("SPECSPLIT_TARGET_THREADS"), "cpu_count": os.cpu_count(),
                          "machine": platform.processor() or platform.machine()},
               "rows": rows, "ceiling": {str(b): r["ceiling"] for b, r in best.items()},
               "ceiling_tokens": {str(b): r["tokens_per_session"] for b, r in best.items()}}
        with open(a.json_path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json_path}")


if __name__ == "__main__":
    main()
