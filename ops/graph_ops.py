"""Operations per decoder layer of the graphs' bodies (issue 45), on this machine's CPU with
random weights of the real pair's configs (2- and 4-layer cuts of them, bf16): the CPU-side proxy
for a CUDA replay's kernels (``specsplit.bench.opcount``: on CUDA RMSNorm is one kernel, where
the CPU count has six, and the score matmul takes bf16 inputs without casts). The Triton body's
kernels run in Triton's interpreter here (TRITON_INTERPRET=1, set below when there is no GPU).

    python ops/graph_ops.py --json ops/results/graph-ops-cpu-qwen2.5-coder-bf16.json

Prints a table (per body and shape: operations a layer adds, the rest of a forward's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the Triton body's kernels on CPU: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specsplit.bench.gpu import model_source  # noqa: E402
from specsplit.bench.opcount import ops_per_layer  # noqa: E402
from specsplit.engine.graphs import BODIES  # noqa: E402
from specsplit.models import ModelSettings  # noqa: E402

SHAPES = ((1, 1), (1, 16), (16, 4))  # sessions x new tokens


def cut(config_dir: Path, layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    args = p.parse_args()
    ms = ModelSettings()
    out: dict = {"torch": torch.__version__, "dtype": "bfloat16", "device": "cpu", "roles": {}}
    print("| role | body | sessions x tokens | ops a layer | ops outside the layers |")
    print("|---|---|---|---|---|")
    for role in ("target", "draft"):
        src = model_source(role, ms, None, True)
        rows = out["roles"][role] = {"config": src.path.name, "shapes": {}}
        for b, t in SHAPES:
            cell = rows["shapes"][f"{b}x{t}"] = {}
            for body in BODIES:
                per_layer, rest = ops_per_layer(lambda n: cut(src.path, n), body, b, t)
                cell[body] = {"per_layer": per_layer, "rest": rest}
                print(f"| {role} | {body} | {b} x {t} | {per_layer:g} | {rest} |", flush=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
