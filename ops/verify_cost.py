"""What a verification and a decoding step of the fleet's target cost at a long context, measured
as its worker runs them (engine-level), optionally under several glibc malloc policies in turn.

The target is loaded as its worker runs it (the role's CPU backend: int8 and float64 attention
by default) and driven through ``TargetEngine.handle`` as the worker does: the prompt (random
token ids) is prefilled once, then each measured request re-verifies the same tree on it (its
sync crops the cache back first): a chain of ``--tree-nodes`` nodes and a 1-node decoding step,
``--repeat`` of each per block, blocks alternating over ``--malloc`` policies (and over
``--attention`` functions: ``blocked``, the float32 batch-invariant attention the int8 target runs
where its check passes, and ``fp64``, the float64 one it had) so that the machine's drift hits
them alike:
- ``default``: the process as started (glibc's dynamic policy);
- ``glibc``: glibc's policy once warm (buffers over 32 MB mapped afresh and unmapped on free);
- ``keep``: freed buffers up to ``--keep-mb`` reused (mallopt M_MMAP_THRESHOLD / M_TRIM_THRESHOLD).
In isolation (``ops/attention_cost.py``) the float64 attention's K/V conversion at 16K tokens costs
~50 ms a layer under ``glibc`` and ~6 ms under ``keep``; in the engine a prompt's prefill leaves
the heap with free regions that large, so the two measured alike (``ops/results/verify-cost-*``).
Prints a markdown table and writes JSON with --json.

    python ops/verify_cost.py --context 16896 --malloc glibc,keep --json FILE
    python ops/verify_cost.py --context 8192 --attention fp64,blocked --json FILE
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import time

GLIBC_MMAP_MAX = 32 << 20  # glibc's dynamic mmap threshold's ceiling on 64-bit


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def _policy(name: str, keep_mb: int) -> None:
    if name == "default":
        return
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    size = (keep_mb << 20) if name == "keep" else GLIBC_MMAP_MAX
    if not (mallopt(M_MMAP_THRESHOLD, size) == 1 and mallopt(M_TRIM_THRESHOLD, 2 * size) == 1):
        raise SystemExit("mallopt refused the policy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=16896, help="prompt tokens prefilled (the cached context)")
    p.add_argument("--tree-nodes", type=int, default=16, help="nodes of the verified chain (root included)")
    p.add_argument("--repeat", type=int, default=3, help="requests of each kind per block")
    p.add_argument("--blocks", type=int, default=3, help="blocks per policy, alternating")
    p.add_argument("--malloc", default="default", help="comma list of default, glibc, keep (see above)")
    p.add_argument("--keep-mb", type=int, default=256)
    p.add_argument("--attention", default="", help="comma list of blocked, fp64 (empty: as the target loads)")
    p.add_argument("--quantize", choices=["none", "int8"], default="int8",
                   help="the target's Linear layers (int8: as the repository's .env runs the fleet)")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args()

    from schemas import CacheSync, ErrorReply, FlatTree, VerifyRequest
    from specsplit.backends import build_backend
    from specsplit.config import WorkerSettings
    from specsplit.engine.base import EngineLimits
    from specsplit.engine.target import TargetEngine
    from specsplit.models import ModelSettings, load_model, resolve_model_paths
    from specsplit.workers import model_dtype

    ms = ModelSettings()
    settings = WorkerSettings(target_quantize=a.quantize)
    backend = build_backend("target", ms.target_device, settings)
    model, _ = load_model(resolve_model_paths(ms).target, dtype=backend.load_dtype(model_dtype("target", ms)),
                          device=ms.target_device)
    model = backend.prepare(model)
    limits = EngineLimits(max_sessions=1, session_ttl_s=1e9, max_session_tokens=a.context + 4 * a.tree_nodes)
    engine = TargetEngine(model, limits, backend=backend)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 20000) for _ in range(a.context)]
    chain = [prompt[-1]] + [rng.randrange(100, 20000) for _ in range(a.tree_nodes - 1)]
    trees = {"verify": FlatTree(token_ids=chain, parents=list(range(-1, a.tree_nodes - 1))),
             "decode": FlatTree(token_ids=chain[:1], parents=[-1])}

    def request(rnd: int, sync: CacheSync, tree: FlatTree) -> float:
        t0 = time.perf_counter()
        reply = engine.handle(VerifyRequest(session_id="s", round=rnd, sync=sync, tree=tree))
        if isinstance(reply, ErrorReply):
            raise SystemExit(f"target answered {reply.code}: {reply.message}")
        return (time.perf_counter() - t0) * 1e3

    t0 = time.perf_counter()
    request(0, CacheSync(base_len=0, append_token_ids=prompt[:-1], prompt_len=len(prompt)), trees["decode"])
    prefill_s = time.perf_counter() - t0
    print(f"prefilled {a.context} tokens in {prefill_s:.0f} s; threads {backend.threads}", flush=True)
    kept = CacheSync(base_len=a.context - 1, prompt_len=len(prompt))
    from specsplit.models.blocked import BLOCKED_ATTENTION
    from specsplit.models.int8 import FP64_ATTENTION, use_fp64_attention

    loaded = model.config._attn_implementation
    names = {"blocked": BLOCKED_ATTENTION, "fp64": FP64_ATTENTION}
    if "fp64" in a.attention:
        use_fp64_attention(model)  # registers it
    variants = [(m, att) for m in a.malloc.split(",") for att in (a.attention.split(",") if a.attention else [""])]
    policies = [f"{m}/{att}" if att else m for m, att in variants]
    samples = {(pol, kind): [] for pol in policies for kind in trees}
    rnd = 1
    for _ in range(a.blocks):
        for pol, (malloc, att) in zip(policies, variants):
            _policy(malloc, a.keep_mb)
            model.set_attn_implementation(names[att] if att else loaded)
            for kind, tree in trees.items():
                request(rnd, kept, tree)  # warm: the policy's first request settles the heap
                rnd += 1
                for _ in range(a.repeat):
                    samples[(pol, kind)].append(request(rnd, kept, tree))
                    rnd += 1
            print(pol, {k: round(statistics.median(samples[(pol, k)][-a.repeat:])) for k in trees}, flush=True)
    rows = [{"malloc": pol.split("/")[0], "attention": pol.split("/")[1] if "/" in pol else loaded, "request": kind, "context": a.context, "nodes": len(trees[kind].token_ids),
             "median_ms": statistics.median(v), "min_ms": min(v), "samples": len(v)}
            for (pol, kind), v in samples.items()]
    print("\n| request | context | nodes | " + " | ".join(f"{pol} ms" for pol in policies) + " |")
    print("|---|---|---|" + "---|" * len(policies))
    for kind in trees:
        ms = [statistics.median(samples[(pol, kind)]) for pol in policies]
        print(f"| {kind} | {a.context} | {len(trees[kind].token_ids)} | " + " | ".join(f"{m:.0f}" for m in ms) + " |")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"config": vars(a), "threads": backend.threads, "prefill_s": prefill_s,
                       "describe": backend.describe(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
