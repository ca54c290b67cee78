"""One layer's attention for a few queries against a long cache, on an accelerator: torch's sdpa
as transformers' sdpa attention calls it (cuDNN off as CudaBackend sets it; grouped KV heads
repeated, or one query's heads packed: with a mask torch's sdpa takes ``enable_gqa`` only
through its math kernel) against ``specsplit.models.attention.grouped_attention`` (the grouped matmuls
``gqa_attention`` runs for trees on an accelerator), with probabilities x values as one matmul
and split into chunks of ACCEL_VALUE_CHUNK keys, for the real pair's head shapes, bf16, a fresh
key length every call (a serving cache grows every round). Prints a row per case and writes
JSON: median ms of 11 calls after the first, and each output's largest difference from a
float32 reference; then a profile of each grouped variant at the longest context.

    python ops/gpu_attention.py cuda FILE.json
"""
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specsplit.models.attention import ACCEL_VALUE_CHUNK, grouped_attention

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
lengths = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "4096,16384,65536").split(",")]
if dev.startswith("cuda"):
    torch.backends.cuda.enable_cudnn_sdp(False)
sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
dt = torch.bfloat16
SHAPES = {"target-1.5B": (12, 2, 128), "draft-0.5B": (14, 2, 64)}  # query heads, KV heads, head dim


def mask_for(m: int, length: int) -> torch.Tensor:
    """A tree forward's additive mask: the prefix visible, the new tokens causal among themselves."""
    mask = torch.zeros(1, 1, m, length, dtype=dt, device=dev)
    mask[..., length - m:] = torch.triu(torch.full((m, m), torch.finfo(dt).min, device=dev, dtype=dt), 1)
    return mask


class Layer(torch.nn.Module):  # what transformers' sdpa function reads of an attention module
    is_causal = True

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.eval()


def sdpa(q, k, v, mask):
    return sdpa_attention_forward(Layer(q.shape[1] // k.shape[1]), q, k, v, mask)[0]


def grouped(q, k, v, mask):
    return grouped_attention(q, k, v, mask, None, q.dtype)


def grouped_split(q, k, v, mask):
    return grouped_attention(q, k, v, mask, None, q.dtype, ACCEL_VALUE_CHUNK)


VARIANTS = (("sdpa", sdpa), ("grouped", grouped), ("grouped_split", grouped_split))


rows = []
g = torch.Generator(device=dev).manual_seed(0)
for shape, (hq, hkv, d) in SHAPES.items():
    lmax = max(lengths) + 64
    K = torch.randn(1, hkv, lmax, d, dtype=dt, device=dev, generator=g)
    V = torch.randn(1, hkv, lmax, d, dtype=dt, device=dev, generator=g)
    for length in lengths:
        for m in (1, 17, 64):
            q = torch.randn(1, hq, m, d, dtype=dt, device=dev, generator=g)
            k, v, mask = K[:, :, :length], V[:, :, :length], mask_for(m, length)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(),
                                                 enable_gqa=True).transpose(1, 2)
            row = {"shape": shape, "keys": length, "queries": m}
            for name, fn in VARIANTS:
                err = (fn(q, k, v, mask).float() - ref).abs().max().item()
                ms = []
                for i in range(12):
                    n = length - 12 + i  # a fresh length every call
                    kk, vv, mk = K[:, :, :n], V[:, :, :n], mask_for(m, n)
                    sync()
                    t0 = time.perf_counter()
                    fn(q, kk, vv, mk)
                    sync()
                    ms.append((time.perf_counter() - t0) * 1e3)
                row[f"{name}_ms"] = round(statistics.median(ms[1:]), 3)
                row[f"{name}_max_err"] = err
            row["speedup"] = round(row["sdpa_ms"] / row["grouped_ms"], 2)
            row["split_speedup"] = round(row["sdpa_ms"] / row["grouped_split_ms"], 2)
            rows.append(row)
            print(row, flush=True)
profiles = {}
if dev.startswith("cuda"):
    from torch.profiler import ProfilerActivity, profile

    hq, hkv, d = SHAPES["target-1.5B"]
    length = max(lengths)
    K = torch.randn(1, hkv, length, d, dtype=dt, device=dev, generator=g)
    V = torch.randn(1, hkv, length, d, dtype=dt, device=dev, generator=g)
    for m in (1, 17):
        q, mask = torch.randn(1, hq, m, d, dtype=dt, device=dev, generator=g), mask_for(m, length)
        for name, fn in VARIANTS:
            fn(q, K, V, mask)
            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn(q, K, V, mask)
                sync()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=8)
            profiles[f"{name}-{m}q-{length}"] = table
            print(f"--- {name}, {m} queries, {length} keys, 5 calls\n{table}", flush=True)
out = {"device": dev, "name": torch.cuda.get_device_name() if dev.startswith("cuda") else dev,
       "torch": torch.__version__, "dtype": str(dt), "value_chunk": ACCEL_VALUE_CHUNK, "rows": rows,
       "profiles": profiles}
if len(sys.argv) > 2:
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
