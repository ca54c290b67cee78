"""``specsplit bench gpu``: what one forward of the target and of the draft costs on a device,
against the floor its weight bytes set.

A grid of tokens per forward x sessions per forward, every session holding ``--context`` cached
tokens, through the engine code the workers run:
- target: one session verifies a tree of N nodes (``TargetEngine.handle``); B sessions each
  verify one, all in one forward (``verify_batch``). The tree: chains of at most 6 nodes from the
  root (N <= 7: one chain);
- draft: one session drafts a tree of up to N nodes in the fleet's default shape (branch 2, depth
  up to 6: a root forward, then best-first steps; ``DraftEngine.handle``); B sessions draft in
  lockstep, one forward per step for all of them (``draft_batch``). A draft takes several
  forwards, counted per cell.
Each cell is the median of ``--repeats`` after a warm-up; every request ends in the engine's one
host copy, so wall time includes the device's work. ``--max-seconds`` bounds the run: a cell
starts only within it, the rest are marked skipped.

The floor: a forward reads each weight once, so it takes at least weight bytes / the device's
memory bandwidth. The bytes are the weights of the model as the backend runs it (int8 Linear
layers: a byte a weight; embedding tables left out: a forward reads only its tokens' rows, a tied
output head counts once); the bandwidth is measured (a large copy on the
device, or in host memory on CPU at the role's threads: bytes read + written / time, the best of
several). ratio = ms / floor, per forward for the draft. Three checks with the issue's bars (for
an H200): a 1-token target forward within 2x the floor, a 16-node verify within 1.3x the 1-token
forward, 16 sessions x 4 nodes within 2x one session's.

Models: the preset's weights when pulled (looked up, never downloaded), else random weights of its
config.json; ``--target-config`` / ``--draft-config DIR``: random weights of DIR/config.json (on a
machine without the models: ``ops/gpu_check.sh prepare`` copies them under .whl/cfg).
Device and dtype as the workers': the role's backend (CPU: threads, packed weights, int8 from the
SPECSPLIT_* settings); dtype bf16 on accelerators, the role's setting on CPU.
CUDA graphs: on CUDA the engines keep their sessions in a KV pool (``--kv-pool-gb``) and replay
a graph per shape bucket (``specsplit.engine.graphs``), as workers with SPECSPLIT_*_KV_POOL_GB do;
each bucket is captured on its first use (a cell's warm-up), and ``capture_ms`` sums the captures.
``--no-cuda-graphs`` (or CPU): eager forwards, ``capture_ms`` null with the reason.

    specsplit bench gpu --json runs/gpu.json
    specsplit bench gpu --device cpu --tokens 1,4,16 --batch 1,4 --repeats 3
    specsplit bench gpu --target-config .whl/cfg/target --draft-config .whl/cfg/draft --json FILE
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specsplit.openmp import set_worker_openmp

ROLES = ("target", "draft")
EAGER = "eager: the engines run no CUDA graphs, nothing is captured"
CHAIN_DEPTH = 6  # the target's trees: chains of at most this many nodes from the root
# (name, numerator cell, denominator cell or None for the floor, bar): the bars, for an H200
CHECKS = (
    ("1-token forward / floor", (1, 1), None, 2.0),
    ("16-node verify / 1-token forward", (16, 1), (1, 1), 1.3),
    ("16 sessions x 4 nodes / 1 session x 4 nodes", (4, 16), (4, 1), 2.0),
)


def ints(text: str) -> list[int]:
    values = sorted({int(x) for x in text.split(",") if x.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"want a comma list of positive integers, got {text!r}")
    return values


def parse(argv):
    p = argparse.ArgumentParser(prog="specsplit bench gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="model preset (default: SPECSPLIT_PRESET or qwen-coder)")
    p.add_argument("--target-config", default=None, help="random weights of DIR/config.json for the target")
    p.add_argument("--draft-config", default=None, help="random weights of DIR/config.json for the draft")
    p.add_argument("--random-weights", action="store_true", help="random weights even where the preset's are pulled")
    p.add_argument("--roles", default="target,draft", help="comma list of target, draft")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="both roles' dtype (default: bfloat16 on an accelerator, the role's setting on CPU)")
    p.add_argument("--tokens", type=ints, default=ints("1,2,4,8,16,32,64"), help="tokens per forward (tree nodes)")
    p.add_argument("--batch", type=ints, default=ints("1,4,16"), help="sessions per forward")
    p.add_argument("--context", type=int, default=512, help="cached tokens per session")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per cell, after one warm-up")
    p.add_argument("--copy-mib", type=int, default=None, help="the bandwidth probe's copy (default: 1024, CPU 256)")
    p.add_argument("--kv-pool-gb", type=float, default=None,
                   help="each role's KV pool (default: 64 on CUDA, capped at the grid's sessions; 0 on CPU)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="eager forwards on CUDA (SPECSPLIT_CUDA_GRAPHS=false)")
    p.add_argument("--graph-body", choices=["triton_gemm", "triton", "fused", "transformers"], default="fused",
                   help="what the CUDA graphs replay (SPECSPLIT_CUDA_GRAPH_BODY)")
    p.add_argument("--max-seconds", type=float, default=540.0, help="no cell starts after this many seconds")
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    roles = [r for r in args.roles.split(",") if r]
    if not roles or set(roles) - set(ROLES):
        p.error(f"--roles: a comma list of {', '.join(ROLES)}")
    args.roles = roles
    return args


@dataclass(frozen=True)
class ModelSource:
    """Where a role's model comes from: ``path`` holds its config.json (and its weights when
    ``weights`` is "real")."""

    path: Path
    weights: str  # "real" (the directory's own) or "random" (seeded, of its config.json)


def model_source(role: str, ms, config_dir: str | None, random_weights: bool) -> ModelSource:
    """The role's model, found without downloading: DIR when given; an explicit model directory
    (SPECSPLIT_<ROLE>_MODEL); the preset's when pulled (the tiny pair: built here from its seed);
    else the preset's config.json where a model dir or .whl/cfg/<role> holds one."""
    from specsplit.models.presets import TINY_NAME, get_preset
    from specsplit.models.pull import is_provisioned

    if config_dir:
        return ModelSource(Path(config_dir), "random")
    weights = "random" if random_weights else "real"
    override = getattr(ms, f"{role}_model")
    if override and (Path(override).expanduser() / "config.json").is_file():
        return ModelSource(Path(override).expanduser(), weights)
    preset = get_preset(ms.preset)
    if preset.is_tiny:
        from specsplit.models.tiny import build_tiny_pair

        return ModelSource(getattr(build_tiny_pair(ms.cache_dir / "models" / TINY_NAME), role), weights)
    source = getattr(preset, role)
    path = ms.cache_dir / "models" / source.name
    if is_provisioned(path, source.gguf_sha256):
        return ModelSource(path, weights)
    for where in (path, Path(".whl/cfg") / role):
        if (where / "config.json").is_file():
            return ModelSource(where, "random")
    raise SystemExit(f"specsplit bench gpu: preset {preset.name}: no pulled {role} in {path} and no config.json "
                     f"there or in .whl/cfg/{role}; pass --{role}-config DIR or run `specsplit models pull`")


def random_model(config_dir, device: str, dtype: str, seed: int = 0):
    """A model of ``config_dir``/config.json with seeded random weights on ``device`` (timings
    do not depend on the values), sdpa attention, in eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    return model.eval()


def weight_bytes(model, int8: bool = False) -> tuple[int, int]:
    """(bytes of every parameter as loaded, bytes a forward reads). A forward reads every Linear
    weight once (one byte each where the backend makes them ``int8``, which turns the rest to
    float32) and the other weights, except an embedding table: only its tokens' rows (a tied
    output head is a Linear, counted as one)."""
    import torch

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    read, seen = 0, set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                linear_weight = isinstance(module, torch.nn.Linear) and name == "weight"
                read += p.numel() * ((1 if linear_weight else 4) if int8 else p.element_size())
    return total, read


def copy_bandwidth(device: str, nbytes: int, repeats: int = 8) -> dict:
    """Bytes read + written per second by copies of an ``nbytes`` buffer on ``device``: the best
    and the median of ``repeats`` after a warm-up, in GB/s (1e9)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = {"cuda": torch.cuda.synchronize, "mps": torch.mps.synchronize}.get(src.device.type, lambda: None)
    dst.copy_(src)  # warm-up: pages touched, kernels chosen
    seconds = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        seconds.append(time.perf_counter() - t0)
    del src, dst
    rate = [2 * nbytes / s / 1e9 for s in seconds]
    return {"copy_bytes": nbytes, "repeats": repeats, "gb_s": round(max(rate), 2),
            "median_gb_s": round(statistics.median(rate), 2), "torch_threads": torch.get_num_threads()}


def device_name(device: str, machine: dict) -> str:
    """torch's name of an accelerator, or the CPU's model name (``machine``: ``machine_info()``)."""
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    if kind == "cpu":
        return f"{machine['cpu_model'] or 'cpu'} ({machine['cpu_count']} CPUs)"
    return kind


def worker_settings(args):
    """The workers' settings (SPECSPLIT_*), with session limits that fit the grid."""
    from specsplit.config import WorkerSettings

    widest = max(args.tokens)
    pool = args.kv_pool_gb if args.kv_pool_gb is not None else (64.0 if args.device.startswith("cuda") else 0.0)
    return WorkerSettings(worker_max_sessions=max(args.batch) + 1, session_ttl_s=1e9, cuda_graphs=args.cuda_graphs,
                          cuda_graph_body=args.graph_body,
                          target_kv_pool_gb=pool, draft_kv_pool_gb=pool,
                          max_tree_nodes=max(WorkerSettings.model_fields["max_tree_nodes"].default, widest),
                          max_session_tokens=64 * math.ceil((args.context + 2 * widest + 64) / 64))


def load_engine(role: str, args, ms, settings):
    """(engine, description) for ``role`` as ``specsplit.workers.build_engine`` builds a worker's:
    the device's backend prepares the model (the bytes a forward reads are counted before, as the
    backend will run the weights)."""
    import torch

    from specsplit.backends import build_backend
    from specsplit.engine.draft import DraftEngine
    from specsplit.engine.target import TargetEngine
    from specsplit.models import load_model
    from specsplit.models.settings import model_dtype
    from specsplit.workers import role_engine

    backend = build_backend(role, args.device, settings)
    accelerator = torch.device(args.device).type != "cpu"
    dtype = backend.load_dtype(args.dtype or ("bfloat16" if accelerator else model_dtype(role, ms)))
    src = model_source(role, ms, getattr(args, f"{role}_config"), args.random_weights)
    t0 = time.perf_counter()
    if src.weights == "real":
        model = load_model(src.path, dtype=dtype, device=args.device)[0]
    else:
        model = random_model(src.path, args.device, dtype)
    total, read = weight_bytes(model, int8=getattr(backend, "quantize", "none") == "int8")
    engine = role_engine(role, settings, backend.prepare(model), backend, DraftEngine, TargetEngine)
    return engine, {"source": str(src.path), "weights": src.weights, "dtype": dtype,
                    "load_s": round(time.perf_counter() - t0, 1), "param_bytes": total, "floor_bytes": read,
                    "batched_forward": engine.batched_forward_supported(), "backend": backend.describe(),
                    "kv_pool_slots": engine.kv_pool.slots if engine.kv_pool else None,
                    "capture_ms": None, "capture_note": EAGER}


def timed(fn, repeats: int) -> dict:
    fn()  # warm-up (kernels chosen, allocator grown)
    ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    return {"ms": round(statistics.median(ms), 3), "min_ms": round(min(ms), 3), "samples": len(ms)}


@contextmanager
def counted_forwards(engine):
    """A list whose length is the number of forwards the engine runs (alone or batched) while
    open: every forward tells its backend first (``before_forward``)."""
    backend, seen = engine.backend, []
    plain = backend.before_forward

    def before_forward(new_tokens: int) -> None:
        seen.append(new_tokens)
        plain(new_tokens)

    backend.before_forward = before_forward
    try:
        yield seen
    finally:
        del backend.before_forward  # the class's method again


def answered(replies):
    from schemas import ErrorReply

    for reply in replies:
        if isinstance(reply, ErrorReply):
            raise SystemExit(f"specsplit bench gpu: the engine answered {reply.code}: {reply.message}")
    return replies


def chain_parents(nodes: int) -> list[int]:
    """A root with chains of at most CHAIN_DEPTH nodes: ceil((nodes - 1) / CHAIN_DEPTH) of them.
    ``chain_parents(5) == [-1, 0, 1, 2, 3]``; ``chain_parents(9) == [-1, 0, 0, 1, 2, 3, 4, 5, 6]``."""
    width = max(1, math.ceil((nodes - 1) / CHAIN_DEPTH))
    return [-1] + [max(0, i - width) for i in range(1, nodes)]


def draft_spec(nodes: int):
    """A tree of up to ``nodes`` nodes in the fleet's default shape (TreeSpec's branch and depth)."""
    from schemas import TreeSpec

    default = TreeSpec()
    return TreeSpec(max_nodes=nodes, max_depth=min(default.max_depth, nodes - 1), branch=default.branch)


def prefill(engine, role: str, count: int, context: int, rng: random.Random) -> tuple[list[list[int]], float]:
    """Sessions s0..s{count-1}, each holding a random prompt of ``context`` tokens (round 0);
    (the prompts, the median ms of one session's prefill)."""
    from schemas import CacheSync, DraftRequest, FlatTree, VerifyRequest

    prompts, ms = [], []
    for i in range(count):
        prompt = [rng.randrange(engine.vocab_size) for _ in range(context)]
        sync = CacheSync(base_len=0, append_token_ids=prompt[:-1])
        if role == "target":
            root = FlatTree(token_ids=prompt[-1:], parents=[-1])
            req = VerifyRequest(session_id=f"s{i}", round=0, sync=sync, tree=root)
        else:
            req = DraftRequest(session_id=f"s{i}", round=0, sync=sync, root=prompt[-1], tree=draft_spec(1))
        t0 = time.perf_counter()
        answered([engine.handle(req)])
        ms.append((time.perf_counter() - t0) * 1e3)
        prompts.append(prompt)
    return prompts, round(statistics.median(ms), 1)


def cell_call(engine, role: str, prompts: list[list[int]], nodes: int, rng: random.Random):
    """The cell's work as a function: the first len(prompts) sessions' round 1 (resent each call:
    its sync crops each cache back to the prompt, so every call does the same work)."""
    from schemas import CacheSync, DraftRequest, FlatTree, VerifyRequest

    reqs = []
    for i, prompt in enumerate(prompts):
        sync = CacheSync(base_len=len(prompt) - 1)
        if role == "target":
            tree = FlatTree(token_ids=prompt[-1:] + [rng.randrange(engine.vocab_size) for _ in range(nodes - 1)],
                            parents=chain_parents(nodes))
            reqs.append(VerifyRequest(session_id=f"s{i}", round=1, sync=sync, tree=tree))
        else:
            reqs.append(DraftRequest(session_id=f"s{i}", round=1, sync=sync, root=prompt[-1], tree=draft_spec(nodes)))
    if len(reqs) == 1:
        return lambda: answered([engine.handle(reqs[0])])
    batched = engine.verify_batch if role == "target" else engine.draft_batch
    return lambda: answered(batched(reqs))


def measure_cell(engine, role: str, prompts, nodes: int, floor_ms: float, repeats: int) -> dict:
    """One cell: the median ms, the forwards per call and ms / (floor x forwards)."""
    call = cell_call(engine, role, prompts, nodes, random.Random(nodes))
    with counted_forwards(engine) as seen:
        cell = timed(call, repeats)
    forwards = len(seen) / (repeats + 1)
    return {**cell, "status": "done", "forwards": round(forwards, 2),
            "tokens_per_forward": round(sum(seen) / len(seen), 1),
            "ratio": round(cell["ms"] / (floor_ms * forwards), 2)}


def measure_role(role: str, args, ms, settings, deadline: float, out: dict, save) -> None:
    """Load the role's engine, measure the bandwidth and the floor, prefill, then the grid
    (cells in order of tokens, then sessions, until the deadline)."""
    engine, info = load_engine(role, args, ms, settings)
    out["models"][role] = info
    cpu = engine.device.type == "cpu"
    bandwidth = copy_bandwidth(args.device, (args.copy_mib or (256 if cpu else 1024)) << 20)
    floor_ms = info["floor_bytes"] / (bandwidth["gb_s"] * 1e9) * 1e3
    info.update(bandwidth=bandwidth, floor_ms=round(floor_ms, 4))
    prompts, info["prefill_ms"] = prefill(engine, role, max(args.batch), args.context, random.Random(0))
    save()
    grid = out["grid"][role]
    for nodes in args.tokens:
        for batch in args.batch:
            cell = {"tokens": nodes, "batch": batch, "status": "skipped"}
            if time.monotonic() < deadline:
                cell.update(measure_cell(engine, role, prompts[:batch], nodes, floor_ms, args.repeats))
            grid.append(cell)
            print(f"{role} {json.dumps(cell)}", file=sys.stderr, flush=True)
            if engine.graphs is not None:
                info.update(capture_ms=round(engine.graphs.capture_ms, 1), capture_note=None,
                            graphs=engine.graphs.describe())
            save()


def checks(grid: list[dict], bars=CHECKS) -> list[dict]:
    """The issue's three bars over the target's cells: PASS, FAIL, or SKIP where a cell is missing."""
    cells = {(c["tokens"], c["batch"]): c for c in grid if c["status"] == "done"}
    rows = []
    for name, num, den, bar in bars:
        if num not in cells or (den is not None and den not in cells):
            rows.append({"check": name, "value": None, "bar": bar, "result": "SKIP"})
            continue
        value = cells[num]["ratio"] if den is None else round(cells[num]["ms"] / cells[den]["ms"], 2)
        rows.append({"check": name, "value": value, "bar": bar, "result": "PASS" if value <= bar else "FAIL"})
    return rows


def table(role: str, grid: list[dict], args) -> str:
    """Rows tokens, columns sessions; each cell ms (ratio to the floor; the draft: forwards too)."""
    cells = {(c["tokens"], c["batch"]): c for c in grid}
    what = "ms (ratio to the floor)" if role == "target" else "ms (forwards, ratio to the floor per forward)"
    columns = " | ".join(f"{b} session{'s' * (b > 1)}" for b in args.batch)
    lines = [f"{role}: {what}", "", f"| tokens | {columns} |", "|---|" + "---|" * len(args.batch)]
    for nodes in args.tokens:
        row = []
        for b in args.batch:
            c = cells.get((nodes, b), {"status": "skipped"})
            if c["status"] != "done":
                row.append(c["status"])
            elif role == "target":
                row.append(f"{c['ms']:.1f} ({c['ratio']:.2f}x)")
            else:
                row.append(f"{c['ms']:.1f} ({c['forwards']:g} fwd, {c['ratio']:.2f}x)")
        lines.append(f"| {nodes} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def report(out: dict, args) -> str:
    where = f"{out['device']['name']}, preset {out['config']['preset']}"
    parts = [f"{where}, context {args.context}, median of {args.repeats}"]
    for role in args.roles:
        m = out["models"].get(role)
        if not m:
            parts.append(f"\n{role}: not measured (--max-seconds)")
            continue
        int8 = ", int8 Linear layers" if m["backend"].get("quantize") == "int8" else ""
        parts.append(f"\n{role}: {m['weights']} weights ({m['source']}), {m['dtype']}{int8}; floor "
                     f"{m['floor_bytes'] / 1e6:.1f} MB / {m['bandwidth']['gb_s']:.1f} GB/s = {m['floor_ms']:.3f} ms; "
                     f"prefill {m['prefill_ms']:.0f} ms a session; " + (
                         f"capture_ms null ({m['capture_note']})" if m["capture_ms"] is None else
                         f"CUDA graphs: {m['graphs']['captures']} captured in {m['capture_ms']:.0f} ms, "
                         f"{m['graphs']['failed']} failed"))
        if role == "draft":
            parts.append("several sessions draft in lockstep (draft_batch): one forward per step for all"
                         + ("" if m["batched_forward"] else "; this model's attention cannot: one at a time"))
        parts.append("\n" + table(role, out["grid"][role], args))
    parts.append("\nchecks (the issue's bars, for an H200):\n\n| check | value | bar | result |\n|---|---|---|---|")
    parts += [f"| {c['check']} | {c['value'] if c['value'] is not None else '-'} | <= {c['bar']} | {c['result']} |"
              for c in out["checks"]]
    return "\n".join(parts)


def header(args, ms, argv) -> dict:
    import torch
    import transformers

    from specsplit.bench.api import machine_info

    machine = machine_info()
    config = {k: v for k, v in vars(args).items() if k != "json_path"} | {"preset": ms.preset}
    return {"command": "specsplit bench gpu " + " ".join(argv), "config": config,
            "device": {"name": device_name(args.device, machine), "torch": torch.__version__,
                       "transformers": transformers.__version__, **machine},
            "models": {}, "grid": {role: [] for role in args.roles}, "checks": [], "complete": False}


def main(argv=None) -> int:
    set_worker_openmp()  # the engines here stand for workers: their OpenMP wait, before torch loads
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    import gc

    import torch

    from specsplit.logs import configure_logging
    from specsplit.models import ModelSettings

    configure_logging("WARNING")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ms = ModelSettings(**({"preset": args.preset} if args.preset else {}),
                       target_device=args.device, draft_device=args.device)
    settings = worker_settings(args)
    deadline = time.monotonic() + args.max_seconds
    out = header(args, ms, argv)

    def save():  # after every cell: a run stopped from outside keeps what it measured
        if args.json_path:
            Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_path).write_text(json.dumps(out, indent=2) + "\n")

    for role in args.roles:
        if time.monotonic() < deadline:
            measure_role(role, args, ms, settings, deadline, out, save)
        else:
            out["grid"][role] = [{"tokens": n, "batch": b, "status": "skipped"}
                                 for n in args.tokens for b in args.batch]
        gc.collect()  # the role's engine and model, before the next one loads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out["checks"] = checks(out["grid"].get("target", []))
    out["complete"] = all(c["status"] == "done" for cells in out["grid"].values() for c in cells)
    save()
    print(report(out, args))
    if args.json_path:
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0
