"""Would 4-bit weights make the CPU target faster? torch's own int4 weight-only GEMM against the
int8 GEMM the target runs, on a whole forward's Linear layers, side by side in one run.

Issue 13's blocking note named "4-bit batch-invariant CPU GEMMs in torch" as what could bring the
exact torch target to llama.cpp's Q4 speed. torch ships one: ``aten._weight_int4pack_mm_for_cpu``
(4-bit codes in groups of ``--group`` input channels, a bf16 scale and offset per group, bf16
activations). This measures, for a model's Linear shapes (its ``config.json``: every layer's
q/k/v/o and MLP projections, distinct weights so they stream from memory as in a forward, and
the lm_head), a pass over all of them at ``M`` rows for:

- ``int8``: ``RowInt8Linear`` on the target's kernel (``specsplit.models.int8.default_kernel``);
- ``int4-gG``: the int4 GEMM with groups of G.

and checks that the int4 GEMM is batch-invariant (each row of an ``M``-row product bit-identical
to that row alone), the property an exact target needs. Passes alternate per round so the
machine's drift hits them alike. Prints a markdown table and writes JSON with --json.

    OMP_WAIT_POLICY=PASSIVE python ops/int4_gemm_ab.py --config ~/.cache/specsplit/models/qwen2.5-coder-1.5b-instruct --json FILE
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch


def linear_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of every Linear layer a forward runs, in order, from a transformers config."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    layer = [(heads * d, h), (kv * d, h), (kv * d, h), (h, heads * d), (inter, h), (inter, h), (h, inter)]
    return layer * layers + [(cfg["vocab_size"], h)]


def int4_pack(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, [K / group, N, 2] bf16 scales and offsets) of a float weight [N, K]:
    asymmetric 4-bit codes per group, dequantized by the kernel as (q - 8) * scale + offset."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return packed, torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().bfloat16()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a model directory (its config.json) or the file itself")
    p.add_argument("--rows", default="1,2,4,8,16", help="comma list: rows (tokens) per GEMM")
    p.add_argument("--groups", default="32,128", help="comma list: int4 group sizes")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the target's: 1 beside a draft)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", dest="json_path")
    a = p.parse_args()

    from specsplit.models.int8 import RowInt8Linear, default_kernel

    path = Path(a.config).expanduser()
    cfg = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    torch.set_num_threads(a.threads)
    shapes = linear_shapes(cfg)
    rows = [int(x) for x in a.rows.split(",")]
    groups = [int(x) for x in a.groups.split(",")]
    kernel = default_kernel()
    gen = torch.Generator().manual_seed(0)
    systems: dict[str, list] = {"int8": []}
    for g in groups:
        systems[f"int4-g{g}"] = []
    invariant = {}
    with torch.no_grad():
        for n, k in shapes:
            w = torch.randn(n, k, generator=gen) * 0.02
            lin = torch.nn.Linear(k, n, bias=False)
            lin.weight.data = w
            systems["int8"].append(RowInt8Linear(lin, kernel))
            for g in groups:
                packed, sz = int4_pack(w, g)
                systems[f"int4-g{g}"].append((k, g, packed, sz))
        widths = sorted({k for _, k in shapes})
        xs = {m: {k: torch.randn(m, k, generator=gen) for k in widths} for m in rows}

        def run(name: str, m: int) -> None:
            x = xs[m]
            if name == "int8":
                for layer in systems[name]:
                    layer(x[layer.in_features])
                return
            xb = {k: t.bfloat16() for k, t in x.items()}
            for k, g, packed, sz in systems[name]:
                torch.ops.aten._weight_int4pack_mm_for_cpu(xb[k], packed, g, sz)

        for g in groups:  # batch invariance: each row of a 16-row product against that row alone
            k, _, packed, sz = systems[f"int4-g{g}"][-2]  # the last layer's down projection
            x = torch.randn(16, k, generator=gen).bfloat16()
            full = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz)
            invariant[f"int4-g{g}"] = all(
                torch.equal(torch.ops.aten._weight_int4pack_mm_for_cpu(x[i:i + 1], packed, g, sz), full[i:i + 1])
                for i in range(16)) and torch.equal(torch.ops.aten._weight_int4pack_mm_for_cpu(x[3:9], packed, g, sz),
                                                    full[3:9])
        samples = {(s, m): [] for s in systems for m in rows}
        for s in systems:  # warm-up: oneDNN primitives, packed layouts
            for m in rows:
                run(s, m)
        for _ in range(a.rounds):
            for m in rows:
                for s in systems:
                    t0 = time.perf_counter()
                    run(s, m)
                    samples[s, m].append((time.perf_counter() - t0) * 1e3)

    weight_gb = sum(n * k for n, k in shapes) / 1e9
    out_rows = []
    print(f"{len(shapes)} Linear layers, {weight_gb:.2f} G weights, {a.threads} thread(s), int8 kernel {kernel}")
    print("\n| rows | " + " | ".join(f"{s} ms" for s in systems) + " | " +
          " | ".join(f"int8 / {s}" for s in systems if s != "int8") + " |")
    print("|---|" + "---|" * (2 * len(systems) - 1))
    for m in rows:
        med = {s: statistics.median(samples[s, m]) for s in systems}
        out_rows.append({"rows": m, "ms": {s: round(v, 3) for s, v in med.items()},
                         "int8_over": {s: round(med["int8"] / med[s], 3) for s in systems if s != "int8"},
                         "samples_ms": {s: [round(x, 3) for x in samples[s, m]] for s in systems}})
        print(f"| {m} | " + " | ".join(f"{med[s]:.1f}" for s in systems) + " | " +
              " | ".join(f"{med['int8'] / med[s]:.2f}x" for s in systems if s != "int8") + " |")
    print("int4 rows batch-invariant:", invariant)
    if a.json_path:
        doc = {"config": {**vars(a), "int8_kernel": kernel, "cpu_count": os.cpu_count(),
                          "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                          "model": cfg.get("_name_or_path") or cfg.get("model_type"), "layers": len(shapes),
                          "weight_params_g": round(weight_gb, 3)},
               "rows": out_rows, "int4_batch_invariant": invariant}
        Path(a.json_path).write_text(json.dumps(doc, indent=1))
        print(f"wrote {a.json_path}")


if __name__ == "__main__":
    main()
