"""A/B of the blocked attention's plan memo in one process (issue 15, stop 41; not a timed test).

A batched verify (``specsplit.engine.batch``) calls every attention layer once per session, each
with that session's mask. ``specsplit.models.blocked`` keeps one plan per live mask
(``MEMO_PLANS`` entries); cut to 1 it keeps only the last mask, as before stop 41, and every
session's plan is recomputed in every layer. This builds the fleet's target as the worker does
(``specsplit.workers.build_engine``: ``SPECSPLIT_TARGET_*`` settings; the fleet's .env runs
``SPECSPLIT_TARGET_QUANTIZE=int8``), prefills ``--sessions`` sessions of about ``--context``
tokens, then times ``verify_batch`` of ``--tokens``-token chains, the two settings interleaved so
that the machine's drift hits both alike, and checks that both accept the same tokens.

    OMP_WAIT_POLICY=PASSIVE SPECSPLIT_TARGET_QUANTIZE=int8 python ops/plan_memo_ab.py --sessions 16 --tokens 1,4 --json F
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--tokens", default="1,4", help="comma list: chain tokens per session (root included)")
    p.add_argument("--context", type=int, default=300, help="cached tokens per session (session i: + 7 i)")
    p.add_argument("--repeat", type=int, default=7, help="measured forwards per setting and size")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args()

    import specsplit.models.blocked as blocked
    from schemas import CacheSync, FlatTree, VerifyReply, VerifyRequest
    from specsplit.config import WorkerSettings
    from specsplit.models import ModelSettings
    from specsplit.workers import build_engine

    sizes = [int(x) for x in a.tokens.split(",")]
    settings = WorkerSettings()
    settings = settings.model_copy(update={"worker_max_sessions": max(settings.worker_max_sessions, a.sessions),
                                           "max_tree_nodes": max(settings.max_tree_nodes, max(sizes)),
                                           "max_tree_depth": max(settings.max_tree_depth, max(sizes))})
    engine, hello = build_engine("target", settings, ModelSettings())
    describe = engine.backend.describe()
    print(f"target: {describe}", flush=True)
    lo, hi = min(100, hello.vocab_size // 8), min(hello.vocab_size, 20000)
    rng = random.Random(0)
    prompts = [[rng.randrange(lo, hi) for _ in range(a.context + 7 * s)] for s in range(a.sessions)]
    chains = {k: [[rng.randrange(lo, hi) for _ in range(k - 1)] for _ in prompts] for k in sizes}
    rounds = [0] * a.sessions

    def request(s: int, sync: CacheSync, tokens: list[int]) -> VerifyRequest:
        rounds[s] += 1
        return VerifyRequest(session_id=f"s{s}", round=rounds[s], sync=sync,
                             tree=FlatTree(token_ids=tokens, parents=list(range(-1, len(tokens) - 1))))

    for s, prompt in enumerate(prompts):
        engine.handle(request(s, CacheSync(base_len=0, append_token_ids=prompt[:-1], prompt_len=len(prompt)), [prompt[-1]]))

    def forward(k: int) -> tuple[float, list]:
        reqs = [request(s, CacheSync(base_len=len(pr) - 1, prompt_len=len(pr)), [pr[-1]] + chains[k][s])
                for s, pr in enumerate(prompts)]
        t0 = time.perf_counter()
        replies = engine.verify_batch(reqs)
        ms = (time.perf_counter() - t0) * 1e3
        bad = [r for r in replies if not isinstance(r, VerifyReply)]
        if bad:
            raise SystemExit(f"target answered {bad[0]}")
        return ms, [r.accepted_token_ids for r in replies]

    settings_ab = {"per-mask memo": blocked.MEMO_PLANS, "last mask only": 1}
    samples = {(name, k): [] for name in settings_ab for k in sizes}
    accepted = {}
    try:
        for i in range(a.repeat + 1):  # the first round warms up
            for k in sizes:
                for name, cap in settings_ab.items():
                    blocked.MEMO_PLANS = cap
                    ms, acc = forward(k)
                    if i:
                        samples[name, k].append(ms)
                    if accepted.setdefault(k, acc) != acc:
                        raise SystemExit(f"{name} accepted other tokens at {k} tokens per session")
    finally:
        blocked.MEMO_PLANS = settings_ab["per-mask memo"]
    rows = [{"sessions": a.sessions, "tokens_per_session": k, "setting": name,
             "median_ms": round(statistics.median(samples[name, k]), 1),
             "samples_ms": [round(x, 1) for x in samples[name, k]]} for k in sizes for name in settings_ab]
    print("\n| sessions | tokens each | setting | median ms |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['sessions']} | {r['tokens_per_session']} | {r['setting']} | {r['median_ms']:.1f} |")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"config": {**vars(a), "backend": describe, "cpu_count": os.cpu_count(),
                                  "machine": platform.processor() or platform.machine()},
                       "rows": rows, "same_accepted_tokens": True}, f, indent=1)
        print(f"wrote {a.json_path}")


if __name__ == "__main__":
    main()
