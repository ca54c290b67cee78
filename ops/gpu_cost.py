"""What the engines' forwards cost on an accelerator: the inputs of the cost model for GPU workers.

A model of a real architecture (``--target-config`` / ``--draft-config``: a directory holding a
``config.json``, e.g. a pulled model's) with random weights (so that only the configs need to be
on the machine; timings do not depend on the values) is driven through the same engine code the
workers run (``TargetEngine.handle`` / ``verify_batch``, ``DraftEngine.handle``):
- verify: one session with ``--contexts`` cached tokens re-verifies a chain of ``--nodes`` nodes
  (the same round re-sent; its sync crops the cache back first), 1 node being a plain decode step;
- batch: ``--ks`` sessions (context ``--batch-context``, +-25 %) each with a 16-node branching
  tree, verified in one forward (``verify_batch``) and one at a time;
- draft: one 16-node, depth-6 draft tree (with ``--draft-config``).
Every request ends in the engine's one host copy, so wall time includes the device's work.
Prints markdown tables and writes JSON with --json.

    python ops/gpu_cost.py --device cuda --target-config DIR --draft-config DIR --json FILE
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from bench_batch_verify import requests as batch_requests  # (ops/ is the script's directory)


def build(config_dir: str, device: str, dtype: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    return model.eval()


def timed(fn, repeats: int) -> dict:
    fn()  # warm-up (kernels chosen, allocator grown)
    ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2), "samples": len(ms)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--target-config", required=True)
    p.add_argument("--draft-config")
    p.add_argument("--contexts", default="512,4096,16384")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64")
    p.add_argument("--ks", default="1,4,16,64")
    p.add_argument("--batch-context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", dest="json_path")
    a = p.parse_args()

    from schemas import CacheSync, DraftRequest, ErrorReply, FlatTree, TreeSpec, VerifyRequest
    from specsplit.backends import build_backend
    from specsplit.config import WorkerSettings
    from specsplit.engine.base import EngineLimits
    from specsplit.engine.draft import DraftEngine
    from specsplit.engine.target import TargetEngine

    contexts = [int(x) for x in a.contexts.split(",")]
    nodes = [int(x) for x in a.nodes.split(",")]
    ks = [int(x) for x in a.ks.split(",")]
    backend = build_backend("target", a.device, WorkerSettings())
    model = build(a.target_config, a.device, a.dtype)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    out = {"device": a.device, "name": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
           "dtype": a.dtype, "torch": torch.__version__, "target_config": model.config.to_diff_dict(),
           "verify": [], "batch": [], "draft": []}

    def save():  # after every row: a run stopped at its time limit keeps what it measured
        if a.json_path:
            with open(a.json_path, "w") as f:
                json.dump(out, f, indent=2)
                f.write("\n")

    def ok(reply):
        if isinstance(reply, ErrorReply):
            raise SystemExit(f"engine answered {reply.code}: {reply.message}")
        return reply

    widest = max(max(nodes), 16)
    limits = EngineLimits(max_sessions=max(ks) + 2, session_ttl_s=1e9, max_tree_nodes=widest, max_tree_depth=widest,
                          max_session_tokens=max(max(contexts), 2 * a.batch_context) + 4 * max(nodes))
    engine = TargetEngine(model, limits, backend=backend)
    for ctx in contexts:
        prompt = [rng.randrange(vocab) for _ in range(ctx)]
        t0 = time.perf_counter()
        ok(engine.handle(VerifyRequest(session_id="v", round=0, tree=FlatTree(token_ids=prompt[-1:], parents=[-1]),
                                       sync=CacheSync(base_len=0, append_token_ids=prompt[:-1]))))
        prefill_ms = (time.perf_counter() - t0) * 1e3
        kept = CacheSync(base_len=ctx - 1)
        for n in nodes:
            chain = FlatTree(token_ids=[prompt[-1]] + [rng.randrange(vocab) for _ in range(n - 1)],
                             parents=list(range(-1, n - 1)))
            req = VerifyRequest(session_id="v", round=1, sync=kept, tree=chain)
            row = {"context": ctx, "nodes": n, "prefill_ms": round(prefill_ms, 1), **timed(lambda: ok(engine.handle(req)), a.repeats)}
            out["verify"].append(row)
            print(row, flush=True)
            save()
        engine.store.end_session("v")

    for k in ks:
        eng = TargetEngine(model, limits, backend=backend)
        reqs = batch_requests(eng, k, a.batch_context, 16, rng)  # what ops/bench_batch_verify.py sends
        batched = timed(lambda: [ok(x) for x in eng.verify_batch(reqs)], a.repeats)
        alone = timed(lambda: [ok(eng.handle(r)) for r in reqs], max(3, a.repeats // 4))
        row = {"k": k, "nodes_each": 16, "context": a.batch_context, "batched": batched, "one_at_a_time": alone,
               "speedup": round(alone["median_ms"] / batched["median_ms"], 2)}
        out["batch"].append(row)
        print(row, flush=True)
        save()
        del eng

    if a.draft_config:
        del engine
        dmodel = build(a.draft_config, a.device, a.dtype)
        out["draft_config"] = dmodel.config.to_diff_dict()
        deng = DraftEngine(dmodel, limits, backend=build_backend("draft", a.device, WorkerSettings()))
        for ctx in contexts[:1]:
            prompt = [rng.randrange(vocab) for _ in range(ctx)]
            for spec in (TreeSpec(max_nodes=16, max_depth=6, branch=2), TreeSpec(max_nodes=7, max_depth=6, branch=1)):
                sync = CacheSync(base_len=0, append_token_ids=prompt[:-1])
                ok(deng.handle(DraftRequest(session_id=f"d{spec.max_nodes}", round=0, sync=sync, root=prompt[-1], tree=spec)))
                req = DraftRequest(session_id=f"d{spec.max_nodes}", round=1, sync=CacheSync(base_len=ctx - 1), root=prompt[-1], tree=spec)
                row = {"context": ctx, "max_nodes": spec.max_nodes, "max_depth": spec.max_depth, "branch": spec.branch,
                       **timed(lambda: ok(deng.handle(req)), a.repeats)}
                out["draft"].append(row)
                print(row, flush=True)
                save()

    print(f"\n{out['name']}, {a.dtype}, random weights of the given configs\n")
    print("| context | " + " | ".join(f"{n} node{'s' * (n > 1)} ms" for n in nodes) + " |")
    print("|---|" + "---|" * len(nodes))
    for ctx in contexts:
        cells = [r["median_ms"] for r in out["verify"] if r["context"] == ctx]
        print(f"| {ctx} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    print("\n| sessions x 16 nodes | one forward ms | one at a time ms | speedup |\n|---|---|---|---|")
    for r in out["batch"]:
        print(f"| {r['k']} | {r['batched']['median_ms']:.1f} | {r['one_at_a_time']['median_ms']:.1f} | {r['speedup']} |")
    for r in out["draft"]:
        print(f"draft tree {r['max_nodes']} nodes / depth {r['max_depth']} / branch {r['branch']} at {r['context']}: "
              f"{r['median_ms']:.1f} ms")
    save()


if __name__ == "__main__":
    main()
