"""Scaled-dot-product attention with an additive mask (what a tree forward passes) at a fresh key
length every call vs the same length repeated, per SDPA backend (default choice, cuDNN,
memory-efficient, everything but cuDNN): ms per call, median of 11 after the first. Found on an
H200 (torch 2.11): the default choice there is cuDNN, which builds a plan per new shape, ~70 ms a
fresh length against 0.14-1.6 ms repeated; the memory-efficient kernel costs 0.3-3 ms either way
at 4K-64K keys (``ops/results/sdpa-fresh-length-*``). A serving cache grows every round, so CUDA
workers keep cuDNN's attention off (``specsplit.backends.CudaBackend``).

    python ops/sdpa_fresh_length.py cuda FILE.json
"""
import json, statistics, sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
dt = torch.bfloat16
H, N, D, LMAX = 12, 17, 128, 70000
g = torch.Generator(device=dev).manual_seed(0)
K = torch.randn(1, H, LMAX, D, dtype=dt, device=dev, generator=g)
V = torch.randn(1, H, LMAX, D, dtype=dt, device=dev, generator=g)
q = torch.randn(1, H, N, D, dtype=dt, device=dev, generator=g)
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
CONFIGS = {"default": None, "cudnn": [SDPBackend.CUDNN_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
           "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}
out = []
base = 0
for L0 in (4096, 16384, 65536):
    for name, backends in CONFIGS.items():
        base += 200
        for kind in ("fresh", "same"):
            ms, err = [], None
            for i in range(12):
                L = L0 + base + (i if kind == "fresh" else 0)
                mask = torch.zeros(1, 1, N, L, dtype=dt, device=dev)  # the prefix visible, the new tokens causal
                mask[..., L - N:] = torch.triu(torch.full((N, N), torch.finfo(dt).min, device=dev, dtype=dt), 1)
                k, v = K[:, :, :L], V[:, :, :L]
                sync(); t = time.perf_counter()
                try:
                    if backends is None:
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    else:
                        with sdpa_kernel(backends):
                            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    sync()
                except RuntimeError as e:
                    ms = [float("nan")]; err = str(e)[:80]; break
                ms.append((time.perf_counter() - t) * 1e3)
            row = {"L": L0, "backend": name, "kind": kind, "median_ms": round(statistics.median(ms[1:] or ms), 3),
                   "first_ms": round(ms[0], 3)} | ({"error": err} if err else {})
            out.append(row)
            print(row, flush=True)
try:
    L = 16384
    mask = torch.zeros(1, 1, N, L, dtype=dt, device=dev)
    print("default choice:", torch._fused_sdp_choice(q, K[:, :, :L], V[:, :, :L], mask, 0.0, False))
except Exception as e:
    print("choice unknown:", e)
if len(sys.argv) > 2:
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, indent=1)
