"""Logit processing and seeded sampling shared by the draft and the target, on any device.

``probs_from_logits`` applies temperature, top-k and top-p exactly as the target alone would
sample (the reference distribution); ``make_generator`` derives a per-(seed, round, role) RNG on
the engine's device so outputs do not depend on which worker served a round or how many workers
there are (for workers of one device type). Everything is batched over rows: callers take one
host copy of the results per request or per tree level, never one per node.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from schemas import SamplingSpec
from specsplit.engine.infill import InfillVocab


def prob_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (exact inverse CDFs and residuals), else float32 (MPS)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64, on ``x``'s device; the first index of a row's maximum, NaN
    counting as the maximum). For float32/float64 rows on the CPU it is numpy's, which is
    vectorized where torch 2.13's CPU argmax is not (a large vocabulary's rows add up over a
    16-node verify: docs/results.md, commit 7f2db8d); elsewhere torch's."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        return torch.from_numpy(np.asarray(x.numpy().argmax(axis=-1), dtype=np.int64))
    return x.argmax(dim=-1)


def make_generator(seed: int, round: int, role: str, device: torch.device | str = "cpu") -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{round}:{role}".encode(), digest_size=8).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return g


def probs_from_logits(logits: torch.Tensor, sampling: SamplingSpec, max_support: int = 0,
                      infill: InfillVocab | None = None) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] (float64 where the device has it) after temperature,
    top-k, top-p and min-p (and, with ``infill``, llama.cpp's infill sampler: ``apply_infill``).

    max_support > 0 additionally caps the support (the draft uses it so its distribution fits
    in a message). The four steps are transformers' TemperatureLogitsWarper, TopKLogitsWarper
    (ties with the k-th logit survive), TopPLogitsWarper and MinPLogitsWarper, in generate's
    order and computed the same way: top-p drops the tokens whose ascending cumulative
    probability is <= 1 - top_p (the largest always survives), min-p those less probable than
    min_p x the most probable, so results agree with transformers even at exact mass boundaries.
    With ``sampling.temperature_last`` the temperature comes after the other three (llama.cpp's
    default sampler chain).
    """
    if sampling.temperature <= 0:
        raise ValueError("probs_from_logits needs temperature > 0")
    k = sampling.top_k
    if max_support and (k == 0 or k > max_support):
        k = max_support
    if 0 < k < logits.shape[-1]:
        within = top_k_rows(logits, k, sampling, infill)
        if within is not None:
            probs, ids = within
            out = torch.zeros(logits.shape, dtype=probs.dtype, device=logits.device)
            return out.scatter_(-1, ids, probs)
    x = logits.to(prob_dtype(logits.device))  # [N, V]
    if not sampling.temperature_last:
        x = x / sampling.temperature
    if 0 < k < x.shape[-1]:
        kth = torch.topk(x, k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1)  # ascending
        drop_sorted = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        drop_sorted[..., -1] = False
        x = x.masked_fill(drop_sorted.scatter(-1, idx, drop_sorted), float("-inf"))
    if sampling.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < sampling.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if infill is not None:  # on the candidates alone (one host sync for their count)
        m = max(1, int((x > float("-inf")).sum(dim=-1).max()))
        vals, idx = torch.topk(x, m, dim=-1)
        vals, idx = apply_infill(vals, idx, infill)
        x = torch.full_like(x, float("-inf")).scatter_(-1, idx, vals)
    if sampling.temperature_last:  # llama.cpp's order: the survivors' logits scaled last
        x = x / sampling.temperature
    return torch.softmax(x, dim=-1)


def top_k_rows(logits: torch.Tensor, k: int, sampling: SamplingSpec,
               infill: InfillVocab | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``probs_from_logits`` computed over each row's k largest logits only, as (probabilities
    [N, k], their token ids [N, k]), least probable first: top-p sorts k values, not the
    vocabulary (a 152K vocabulary's sort is most of a sampled round's cost on a CPU). The same
    survivors and values as the full path: the logits' order and ties are the same in their own
    dtype as after the exact conversion and the division by the temperature. None when a row's
    k-th logit is tied past k (the full path keeps every tie)."""
    vals, idx = torch.topk(logits, k, dim=-1)  # [N, k] descending
    if bool(((logits >= vals[..., -1:]).sum(dim=-1) > k).any()):  # (one host sync a call)
        return None
    x, idx = vals.flip(-1).to(prob_dtype(logits.device)), idx.flip(-1)  # ascending
    if not sampling.temperature_last:
        x = x / sampling.temperature
    if sampling.top_p < 1.0:
        drop = torch.softmax(x, dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        drop[..., -1] = False
        x = x.masked_fill(drop, float("-inf"))
    if sampling.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < sampling.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if infill is not None:
        x, idx = apply_infill(x, idx, infill)
    if sampling.temperature_last:
        x = x / sampling.temperature
    return torch.softmax(x, dim=-1), idx


def apply_infill(x: torch.Tensor, ids: torch.Tensor, infill: InfillVocab) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's infill sampler (``specsplit.engine.infill``) on rows of candidates: logits
    ``x`` [N, M] (-inf: not a candidate) of tokens ``ids`` [N, M] -> the same with the tokens it
    drops at -inf; a row it ends is its EOT alone (in that token's column, else in the row's
    most probable one, its id replaced). One host copy of the rows."""
    probs = torch.softmax(x, dim=-1)
    host_p, host_ids = probs.cpu().numpy(), ids.cpu().numpy()
    keep, forced = infill.keep(host_ids, host_p)
    x = x.masked_fill(~torch.from_numpy(keep).to(x.device), float("-inf"))
    if forced.any():
        ids = ids.clone()
        for r in np.flatnonzero(forced):
            at = np.flatnonzero(host_ids[r] == infill.eot)
            c = int(at[0]) if at.size else int(host_p[r].argmax())
            x[r] = float("-inf")
            x[r, c] = 0.0
            ids[r, c] = infill.eot
    return x, ids


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draws by inverse CDF: probs [R, V] (rows need not be normalized), u [R, n] uniforms in
    [0, 1) -> ids [R, n] on the same device. Never returns an id without mass."""
    cdf = torch.cumsum(probs, dim=-1)  # [R, V]
    target = (u.to(cdf.dtype) * cdf[:, -1:]).contiguous()  # [R, n]
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)  # [R, n]
    # searchsorted may land on a zero-probability id only at the float edge (u rounding up to the
    # total); step back to the nearest id with mass.
    ids = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
    last_with_mass = torch.cummax(torch.where(probs > 0, ids, -1), dim=-1).values  # [R, V]
    out = last_with_mass.gather(-1, idx)
    return torch.where(out < 0, idx, out)


def sample_rows(probs: torch.Tensor, g: torch.Generator, n: int = 1) -> torch.Tensor:
    """n i.i.d. draws from each row of probs [R, V] -> ids [R, n] (seeded, exact)."""
    u = torch.rand(probs.shape[0], n, generator=g, dtype=probs.dtype, device=probs.device)
    return inverse_cdf(probs, u)


def dense_rows(ids: list[list[int]], probs: list[list[float]], vocab_size: int, *, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """Sparse (ids, probs) per row -> [R, V] probability rows, each renormalized (the wire
    tolerates sums off by 1e-3), built with one scatter."""
    rows = [r for r, row in enumerate(ids) for _ in row]
    out = torch.zeros(len(ids), vocab_size, dtype=dtype, device=device)
    if rows:
        cols = [t for row in ids for t in row]
        vals = [p for row in probs for p in row]
        out[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = torch.tensor(
            vals, dtype=dtype, device=device)
    total = out.sum(-1, keepdim=True)
    return torch.where(total > 0, out / torch.where(total > 0, total, 1.0), out)
