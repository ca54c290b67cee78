"""Logit processing and seeded sampling shared by the draft and the target.

``probs_from_logits`` applies temperature, top-k and top-p exactly as the target alone would
sample (the reference distribution); ``make_generator`` derives a per-(seed, round, role) RNG so
outputs do not depend on which worker served a round or how many workers there are.
"""

from __future__ import annotations

import hashlib

import torch

from schemas import SamplingSpec


def make_generator(seed: int, round: int, role: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{round}:{role}".encode(), digest_size=8).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return g


def probs_from_logits(logits: torch.Tensor, sampling: SamplingSpec, max_support: int = 0) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] (float64) after temperature, top-k and top-p.

    max_support > 0 additionally caps the support (the draft uses it so its distribution fits
    in a message). The three steps are transformers' TemperatureLogitsWarper, TopKLogitsWarper
    (ties with the k-th logit survive) and TopPLogitsWarper, computed the same way in float64:
    top-p drops the tokens whose ascending cumulative probability is <= 1 - top_p (the largest
    always survives), so results agree with transformers even at exact mass boundaries.
    """
    if sampling.temperature <= 0:
        raise ValueError("probs_from_logits needs temperature > 0")
    x = logits.to(torch.float64) / sampling.temperature  # [N, V]
    k = sampling.top_k
    if max_support and (k == 0 or k > max_support):
        k = max_support
    if 0 < k < x.shape[-1]:
        kth = torch.topk(x, k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1)  # ascending
        drop_sorted = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        drop_sorted[..., -1] = False
        x = x.masked_fill(drop_sorted.scatter(-1, idx, drop_sorted), float("-inf"))
    return torch.softmax(x, dim=-1)


def sample_from(probs: torch.Tensor, g: torch.Generator, n: int = 1) -> list[int]:
    """n i.i.d. draws from a probability vector [V] (float64 inverse CDF, exact and seeded)."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=0)
    u = torch.rand(n, generator=g, dtype=torch.float64) * cdf[-1]
    idx = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[0] - 1)  # [n]
    # searchsorted may land on a zero-probability id only at the float edge (u rounding up to the
    # total); step back to the nearest id with mass, vectorized (no per-draw tensor indexing).
    ids = torch.arange(probs.shape[0])
    last_with_mass = torch.cummax(torch.where(probs > 0, ids, -1), dim=0).values  # [V]
    out = last_with_mass[idx]
    return torch.where(out < 0, idx, out).tolist()


def uniform(g: torch.Generator) -> float:
    return float(torch.rand(1, generator=g, dtype=torch.float64))


def sparse(probs: torch.Tensor) -> tuple[list[int], list[float]]:
    """Probability vector [V] -> (ids, probs) of its support, highest first."""
    ids = torch.nonzero(probs > 0).flatten()
    vals = probs[ids]
    order = torch.argsort(vals, descending=True)
    return ids[order].tolist(), vals[order].tolist()


def dense(ids: list[int], probs: list[float], vocab_size: int) -> torch.Tensor:
    """(ids, probs) -> probability vector [V] float64."""
    out = torch.zeros(vocab_size, dtype=torch.float64)
    if ids:
        out[torch.tensor(ids, dtype=torch.long)] = torch.tensor(probs, dtype=torch.float64)
    return out
