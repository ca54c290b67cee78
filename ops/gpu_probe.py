"""Where a graphed target forward's time goes on a CUDA device (issue 45): per shape (sessions x
new tokens, 512 cached tokens each) the engine's request, the runner's forward (host fill +
replay), the graph's replay alone (CUDA events) and the same body run eagerly; the kernels of one
replay (torch.profiler); then the body compiled by torch.compile (inductor, static shapes) and
captured in the same kind of graph: compile time, replay time, logits against the uncompiled body.

    python3 ops/gpu_probe.py --target-config .whl/cfg/target --json $OUT/gpu-probe.json

Random weights of the config (bf16); each part is written to the JSON as soon as it is measured.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specsplit.backends import CudaBackend  # noqa: E402
from specsplit.bench.gpu import cell_call, prefill, random_model  # noqa: E402
from specsplit.engine.base import EngineLimits  # noqa: E402
from specsplit.engine.batch import Segment  # noqa: E402
from specsplit.engine.graphs import BODIES  # noqa: E402
from specsplit.engine.kvpool import GB, pool_shape  # noqa: E402
from specsplit.engine.masks import causal  # noqa: E402
from specsplit.engine.target import TargetEngine  # noqa: E402

SHAPES = ((1, 1), (1, 16), (16, 1), (16, 4))
CONTEXT = 512


def wall(fn, n: int) -> float:
    fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(ms), 3)


def events(fn, n: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / n, 4)


def host_profile(fn, n: int, top: int = 15) -> list:
    """Where the host spends ``n`` calls of ``fn`` (cProfile, by own time): the request path of a
    batched verify took ~6 ms more than its replay on the H200 (docs/results.md, GPU), where the
    same Python on a CPU box takes ~0.5 ms."""
    import cProfile
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [(f"{Path(f).name}:{line}({name})", calls, round(own * 1e3 / n, 3), round(cum * 1e3 / n, 3))
            for (f, line, name), (_, calls, own, cum, _) in rows]


def kernels(fn, top: int = 12) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    return {"kernels": sum(e.count for e in rows), "device_ms": round(sum(e.device_time_total for e in rows) / 1e3, 3),
            "top": [(e.key[:80], e.count, round(e.device_time_total / 1e3, 3)) for e in rows[:top]]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target-config", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--compile-shapes", default="1x1,16x4")
    p.add_argument("--body", default="fused", choices=list(BODIES), help="what the graphs replay")
    args = p.parse_args()
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "context": CONTEXT,
                 "body": args.body}

    def save():
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")

    model = CudaBackend(torch.device("cuda")).prepare(random_model(args.target_config, "cuda", "bfloat16"))
    shape = pool_shape(model, 1024, torch.bfloat16)
    engine = TargetEngine(model, EngineLimits(max_sessions=17, max_session_tokens=1024, max_tree_nodes=64,
                                              kv_pool_gb=18 * shape.slot_bytes / GB, graphs="cuda",
                                              graph_body=args.body))
    runner = engine.graphs
    rng = random.Random(0)
    prompts, _ = prefill(engine, "target", 16, CONTEXT, rng)
    kvs = [engine.store.get(f"s{i}").kv for i in range(16)]
    out["shapes"] = {}
    for b, t in SHAPES:
        row = out["shapes"][f"{b}x{t}"] = {}
        call = cell_call(engine, "target", prompts[:b], t, random.Random(t))
        row["request_ms"] = wall(call, 20)
        if (b, t) == (16, 4):  # (function, calls, own ms a request, cumulative ms a request)
            row["host_profile"] = host_profile(call, 20)
        items = [Segment(kv, [1] * t, torch.arange(CONTEXT, CONTEXT + t, device="cuda"),
                      causal(t, CONTEXT, torch.device("cuda")), t) for kv in kvs[:b]]

        def run_forward(items=items, b=b):
            for kv in kvs[:b]:
                kv.crop_to(CONTEXT)
            return runner.forward(items)

        row["runner_forward_ms"] = wall(run_forward, 20)
        key = runner.bucket(items)
        graph, inp = runner._graphs[key], runner._inputs[key[:2]]
        row["bucket"] = key
        row["replay_ms"] = events(graph.replay, 50)
        row["eager_body_ms"] = wall(lambda inp=inp, key=key: runner._body(inp, *key), 10)
        row["replay_kernels"] = kernels(graph.replay)
        if (b, t) == (1, 1):
            row["eager_kernels"] = kernels(lambda inp=inp, key=key: runner._body(inp, *key))
        print(json.dumps({f"{b}x{t}": {k: v for k, v in row.items() if "kernels" not in k}}), flush=True)
        save()
    out["compiled"] = {}
    body = torch.compile(runner._body, dynamic=False) if args.compile_shapes else None
    for spec in [s for s in args.compile_shapes.split(",") if s]:
        b, t = (int(x) for x in spec.split("x"))
        key = (b, t, 1024, False)
        inp = runner._inputs[(b, t)]
        with torch.no_grad():
            runner._body(inp, *key)
            ref = inp.logits.float().clone()
            t0 = time.perf_counter()
            body(inp, *key)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            got = inp.logits.float()
            diff = float((got - ref).abs().max())
            same_argmax = bool((got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.99)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body(inp, *key)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            t1 = time.perf_counter()
            with torch.cuda.graph(g):
                body(inp, *key)
            capture_ms = (time.perf_counter() - t1) * 1e3
        row = out["compiled"][spec] = {"compile_s": round(compile_s, 1), "capture_ms": round(capture_ms, 1),
                                       "replay_ms": events(g.replay, 50), "max_abs_diff": diff,
                                       "argmax_agree": same_argmax}
        row["replay_kernels"] = kernels(g.replay)
        print(json.dumps({f"compiled {spec}": {k: v for k, v in row.items() if "kernels" not in k}}), flush=True)
        save()
    print("\n| shape | request | runner forward | replay | eager body | kernels/replay | compiled replay |")
    print("|---|---|---|---|---|---|---|")
    for name, row in out["shapes"].items():
        c = out["compiled"].get(name, {})
        print(f"| {name} | {row['request_ms']} | {row['runner_forward_ms']} | {row['replay_ms']} | {row['eager_body_ms']} "
              f"| {row['replay_kernels']['kernels']} | {c.get('replay_ms', '-')} |")
    for name in ("1x1",):
        print(name, "replay top kernels:", json.dumps(out["shapes"][name]["replay_kernels"]["top"][:8]))
    print("16x4 request, host top (own ms a request):",
          json.dumps([(f, own) for f, _, own, _ in out["shapes"]["16x4"].get("host_profile", [])[:6]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
