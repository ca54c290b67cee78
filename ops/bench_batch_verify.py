"""Micro-measurement (issue 15): ONE batched verification of k sessions vs k verifications one at
a time, on the same engine code the target worker runs (not a timed test).

Each session holds ``--context`` cached tokens (varied by +-25%) and sends a ``--nodes``-node
branching tree; the same VerifyRequests are re-sent every repeat (a retry of the same round does
the same work). Reports the median and min ms of ``TargetEngine.verify_batch(reqs)`` and of
``[TargetEngine.handle(r) for r in reqs]``, per k, with 1 torch thread (a 2-core box's target).

    python ops/bench_batch_verify.py --model tiny --json ops/results/batch-verify-tiny-cpu2.json
    python ops/bench_batch_verify.py --model mid          # a random 8-layer, 512-wide Qwen2 (fp32)
    python ops/bench_batch_verify.py --model tiny --int8  # RowInt8Linear + float64 attention
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from schemas import CacheSync, FlatTree, VerifyReply, VerifyRequest
from specsplit.engine.base import EngineLimits
from specsplit.engine.target import TargetEngine

MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=448),  # the tiny preset's shape
    "mid": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=32000),
}


def build(name: str, int8: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(max_position_embeddings=8192, tie_word_embeddings=False, **MODELS[name],
                                         attn_implementation="sdpa")).eval()
    if int8:
        from specsplit.models.int8 import quantize_int8

        model = quantize_int8(model)
    return model


def requests(engine: TargetEngine, k: int, context: int, nodes: int, rng: random.Random) -> list[VerifyRequest]:
    vocab, out = engine.vocab_size, []
    parents = [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, nodes)]  # a bushy, deep-ish tree
    for i in range(k):
        sid = f"s{i}"
        prompt = [rng.randrange(vocab) for _ in range(int(context * rng.uniform(0.75, 1.25)))]
        r = engine.handle(VerifyRequest(session_id=sid, round=0, sync=CacheSync(base_len=0, append_token_ids=prompt),
                                        tree=FlatTree(token_ids=[rng.randrange(vocab)], parents=[-1])))
        assert isinstance(r, VerifyReply), r
        out.append(VerifyRequest(session_id=sid, round=1, sync=CacheSync(base_len=r.cache_len),
                                 tree=FlatTree(token_ids=[rng.randrange(vocab) for _ in range(nodes)],
                                               parents=parents)))
    return out


def timings_ms(fns, repeats: int) -> list[dict]:
    """Per fn: median and min ms over ``repeats`` runs, the fns interleaved (a shared box's load
    then weighs on both alike)."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return [dict(median=round(statistics.median(t), 2), min=round(min(t), 2)) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--int8", action="store_true")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build(args.model, args.int8)
    rows = []
    for k in (int(x) for x in args.ks.split(",")):
        engine = TargetEngine(model, EngineLimits(max_sessions=64, max_session_tokens=2 * args.context + 64,
                                                  max_tree_nodes=args.nodes))
        reqs = requests(engine, k, args.context, args.nodes, random.Random(k))
        alone, batched = timings_ms([lambda: [engine.handle(r) for r in reqs], lambda: engine.verify_batch(reqs)],
                                    args.repeats)
        rows.append(dict(k=k, one_at_a_time_ms=alone, batched_ms=batched,
                         speedup_median=round(alone["median"] / batched["median"], 2),
                         speedup_min=round(alone["min"] / batched["min"], 2)))
        print(rows[-1], flush=True)
    result = dict(model=args.model, int8=args.int8, context=args.context, nodes=args.nodes, threads=1,
                  repeats=args.repeats, cpu_count=os.cpu_count(), load_avg=list(os.getloadavg()), rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
