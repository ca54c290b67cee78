"""A/B of the int8 target's prompt attention, one worker engine, in one run: before (one sdpa call
per prompt chunk; a prefix cache reuses prompt-path positions in whole 1,024-token chunks) against
after (``specsplit.models.attention.prompt_attention``: blocks of 64 positions; reuse in whole
blocks). Per trial and side, alternating: a fresh random prompt of ``--context`` tokens prefilled
(its first verify), then an agent's next turn: the same prompt and ``--turn`` tokens more (a tool's
output), whose first verify takes what the prefix cache gives. Prints each side's prefill and
next-turn seconds and the tokens reused; exit code 1 if a side's next turn answers another token
than a target with no prefix cache (greedy: both must agree).

    SPECSPLIT_TARGET_QUANTIZE=int8 OMP_WAIT_POLICY=PASSIVE python ops/prompt_reuse_ab.py --json FILE
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=3000, help="tokens of each trial's first prompt")
    p.add_argument("--turn", type=int, default=200, help="tokens the next turn adds")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--json", dest="json_path")
    a = p.parse_args()

    from schemas import CacheSync, EndSession, ErrorReply, FlatTree, VerifyRequest
    from specsplit.config import WorkerSettings
    from specsplit.models import ModelSettings
    from specsplit.models.attention import register_gqa_attention
    from specsplit.workers import build_engine

    settings = WorkerSettings().model_copy(update={"max_session_tokens": a.context + a.turn + 64})
    engine, hello = build_engine("target", settings, ModelSettings())
    if engine.prefix_cache is None:
        raise SystemExit("the target's prefix cache is off (SPECSPLIT_TARGET_PREFIX_CACHE_GB)")
    print(f"target: {engine.backend.describe()}", flush=True)
    after = engine._prompt_attn()
    if after is None:
        raise SystemExit("no prompt attention: run with SPECSPLIT_TARGET_QUANTIZE=int8")
    before = register_gqa_attention()
    lo, hi = min(100, hello.vocab_size // 8), min(hello.vocab_size, 20000)
    rng = random.Random(0)

    def verify(sid: str, prompt: list[int], *, reuse: bool = True) -> tuple[float, int, int]:
        sync = CacheSync(base_len=0, append_token_ids=prompt[:-1], prompt_len=len(prompt))
        req = VerifyRequest(session_id=sid, round=0, sync=sync, tree=FlatTree(token_ids=[prompt[-1]], parents=[-1]))
        cache = engine.prefix_cache
        reused = cache.reused_tokens
        if not reuse:
            engine.prefix_cache = None
        try:
            t0 = time.perf_counter()
            reply = engine.handle(req)
            took = time.perf_counter() - t0
        finally:
            engine.prefix_cache = cache
        if isinstance(reply, ErrorReply):
            raise SystemExit(f"target answered {reply.code}: {reply.message}")
        engine.handle(EndSession(session_id=sid))
        return took, cache.reused_tokens - reused, reply.bonus_token_id

    rows, ok = [], True
    for trial in range(a.trials):
        for side, attention, blockwise in (("before", before, False), ("after", after, None)):
            engine._prompt_attention, engine._rows_independent = attention, blockwise
            first = [rng.randrange(lo, hi) for _ in range(a.context)]
            second = first + [rng.randrange(lo, hi) for _ in range(a.turn)]
            prefill_s, _, _ = verify(f"{side}-{trial}-1", first)
            turn_s, reused, token = verify(f"{side}-{trial}-2", second)
            _, _, want = verify(f"{side}-{trial}-2-plain", second, reuse=False)
            same = token == want
            ok &= same
            rows.append({"trial": trial, "side": side, "prefill_s": round(prefill_s, 2),
                         "next_turn_s": round(turn_s, 2), "reused_tokens": reused,
                         "next_turn_forwarded": len(second) - 1 - reused, "same_token": same})
            print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for side in ("before", "after"):
        mine = [r for r in rows if r["side"] == side]
        summary[side] = {k: statistics.median(r[k] for r in mine)
                         for k in ("prefill_s", "next_turn_s", "reused_tokens", "next_turn_forwarded")}
    print(f"{'side':8} {'prefill s':>10} {'next turn s':>12} {'reused':>8} {'forwarded':>10}")
    for side, s in summary.items():
        print(f"{side:8} {s['prefill_s']:10.2f} {s['next_turn_s']:12.2f} {s['reused_tokens']:8.0f} "
              f"{s['next_turn_forwarded']:10.0f}")
    print(f"next turn {summary['before']['next_turn_s'] / summary['after']['next_turn_s']:.2f}x sooner after; "
          f"prefill {summary['before']['prefill_s'] / summary['after']['prefill_s']:.2f}x; every answer the same: {ok}")
    if a.json_path:
        Path(a.json_path).write_text(json.dumps({
            "about": "ops/prompt_reuse_ab.py: the int8 target's prompt attention, one sdpa call per chunk (before) "
                     "against blocks of 64 positions (after), and the prefix cache's reuse of an agent's next turn",
            "args": vars(a), "target": engine.backend.describe(), "rows": rows, "summary": summary,
            "same_tokens": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
