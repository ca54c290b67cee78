"""What one attention layer costs the int8 target at long contexts: float64 (the batch-invariant
attention it had, ``specsplit.models.int8.fp64_attention``), the part of it that converts the cached
keys/values to float64, the same on a cache already in float64, float32 (not batch-invariant),
and the blocked float32 attention it runs now (``specsplit.models.blocked``). Random tensors,
Qwen2.5 1.5B shapes (12 query heads, 2 KV heads, 128 dims); prints a markdown table, and writes
JSON with --json. Run as ``python ops/attention_cost.py --threads 1 --json FILE``."""

from __future__ import annotations

import argparse
import json
import time

import torch

from specsplit.models.attention import grouped_attention
from specsplit.models.blocked import blocked_attention


def _ms(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="8192,16384")
    p.add_argument("--queries", default="1,16,34", help="query tokens of the forward (1: a decode step)")
    p.add_argument("--heads", default="12,2,128", help="query heads, KV heads, head dim")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", dest="json_path")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    rows = []
    print("| cached tokens | queries | float64 ms | K/V to float64 ms | float64 on a float64 cache ms | float32 ms |"
          f" blocked float32 ms | float64 x {a.layers} layers ms | blocked x {a.layers} layers ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length in (int(x) for x in a.contexts.split(",")):
        for m in (int(x) for x in a.queries.split(",")):
            # keys/values as the cache holds them: a view of a buffer reserved in 256-token chunks
            cap = -(-length // 256) * 256
            q = torch.randn(1, hq, m, d)
            k, v = (torch.randn(1, hkv, cap, d)[:, :, :length] for _ in range(2))
            visible = torch.ones(m, length, dtype=torch.bool).tril(length - m)  # a chain on the cache
            mask = torch.zeros(1, 1, m, length).masked_fill_(~visible, torch.finfo(torch.float32).min)
            k64, v64 = k.double(), v.double()
            row = {
                "context": length, "queries": m,
                "fp64_ms": _ms(lambda: grouped_attention(q, k, v, mask, None, torch.float64), a.repeat),
                "convert_ms": _ms(lambda: (k.to(torch.float64), v.to(torch.float64)), a.repeat),
                "fp64_cache_ms": _ms(lambda: grouped_attention(q, k64, v64, mask, None, torch.float64), a.repeat),
                "fp32_ms": _ms(lambda: grouped_attention(q, k, v, mask, None, torch.float32), a.repeat),
                "blocked_ms": _ms(lambda: blocked_attention(None, q, k, v, mask), a.repeat),
            }
            rows.append(row)
            print(f"| {length} | {m} | {row['fp64_ms']:.1f} | {row['convert_ms']:.1f} | {row['fp64_cache_ms']:.1f} "
                  f"| {row['fp32_ms']:.1f} | {row['blocked_ms']:.1f} | {a.layers * row['fp64_ms']:.0f} "
                  f"| {a.layers * row['blocked_ms']:.0f} |")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"config": vars(a), "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
