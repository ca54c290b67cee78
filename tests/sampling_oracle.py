"""The statistics shared by the sampling oracles (tests/test_sampling_stats.py, rule level;
tests/test_sampling_engines.py, through the engines): the chi-square goodness-of-fit test, the
target's reference distribution by transformers' warpers, and deliberately wrong verification
rules run through the same harness to show the fits have power. ALPHA = 1e-3 is the chance that a
correct sampler fails one fit for a fresh choice of seeds."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from schemas import FlatTree, SamplingSpec
from specsplit.engine import sampling as S
from specsplit.engine.verify import Verdict

ALPHA = 1e-3


# ---- statistics -----------------------------------------------------------------------------
def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularized upper incomplete gamma function."""
    half = torch.tensor([df / 2, stat / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


@dataclass(frozen=True)
class Fit:
    stat: float
    df: int
    p_value: float
    impossible: int  # draws of outcomes the target gives probability 0


def chi2_fit(counts: Counter, probs: dict[tuple, float]) -> Fit:
    """Goodness of fit of counts to probs. Cells are visited by increasing expected count and
    pooled until each pooled cell expects at least 5 draws (a short tail joins the last cell)."""
    n = sum(counts.values())
    impossible = sum(c for k, c in counts.items() if probs.get(k, 0.0) <= 0.0)
    cells, pool_e, pool_o = [], 0.0, 0
    for k in sorted((k for k in probs if probs[k] > 0), key=lambda k: probs[k]):
        pool_e, pool_o = pool_e + n * probs[k], pool_o + counts.get(k, 0)
        if pool_e >= 5.0:
            cells.append((pool_o, pool_e))
            pool_e, pool_o = 0.0, 0
    if pool_e > 0 and cells:
        o, e = cells.pop()
        cells.append((o + pool_o, e + pool_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    p = 0.0 if impossible else (chi2_sf(stat, df) if df > 0 else 1.0)
    return Fit(stat, df, p, impossible)


def marginal(counts: Counter, n: int) -> Counter:
    out = Counter()
    for k, c in counts.items():
        out[k[:n]] += c
    return out


def hf_probs(logits: torch.Tensor, sampling: SamplingSpec) -> torch.Tensor:
    """The reference distribution: transformers' warpers (temperature, top-k, top-p, min-p) + softmax,
    the temperature's last with ``temperature_last`` (llama.cpp's chain). logits [N, V] -> [N, V] float64."""
    x = logits.to(torch.float64)
    if not sampling.temperature_last:
        x = TemperatureLogitsWarper(sampling.temperature)(None, x)
    if sampling.top_k > 0:
        x = TopKLogitsWarper(sampling.top_k)(None, x)
    if sampling.top_p < 1.0:
        x = TopPLogitsWarper(sampling.top_p)(None, x)
    if sampling.min_p > 0.0:
        x = MinPLogitsWarper(sampling.min_p)(None, x)
    if sampling.temperature_last:
        x = TemperatureLogitsWarper(sampling.temperature)(None, x)
    return torch.softmax(x, dim=-1)



def assert_fits(fit: Fit, counts: Counter, probs: dict, what: str) -> None:
    top = sorted(probs, key=probs.get, reverse=True)[:4]
    n = sum(counts.values())
    detail = ", ".join(f"{k}: {counts.get(k, 0) / n:.4f} vs {probs[k]:.4f}" for k in top)
    assert fit.df >= 2, f"{what}: only {fit.df + 1} cells, the test would be vacuous"
    assert fit.impossible == 0, f"{what}: {fit.impossible} draws of zero-probability outcomes"
    assert fit.p_value > ALPHA, f"{what}: chi2={fit.stat:.1f} df={fit.df} p={fit.p_value:.2e} ({detail})"



# ---- deliberately wrong verification rules (power) ------------------------------------------
def draw(dist: list[float], u: float) -> int:
    """Inverse CDF on host floats (rows need not be normalized); never an id without mass."""
    t, acc, last = u * sum(dist), 0.0, -1
    for i, x in enumerate(dist):
        if x > 0:
            acc, last = acc + x, i
            if acc > t:
                return i
    return last


class WrongRule:
    """A deliberately wrong verification rule with ``verify_sampling``'s signature, run on host
    floats: p at every node from the same ``probs_from_logits``, uniforms from the draw's
    generator ``g`` (one call per round). ``pick(p, qs, children tokens, uniforms)`` decides at
    one node: (index of the accepted child or -1, the distribution the bonus is drawn from)."""

    def __init__(self, pick):
        self.pick, self.__name__, self.__doc__ = pick, pick.__name__, pick.__doc__

    def __call__(self, tree: FlatTree, layout, logits, sampling, g) -> Verdict:
        return self.walk(tree, layout, S.probs_from_logits(logits, sampling).tolist(), g)

    def walk(self, tree: FlatTree, layout, probs: list[list[float]], g) -> Verdict:
        """The walk from the root; probs [N][V] are the target's processed probabilities."""
        vocab, n = len(probs[0]), len(probs)
        # at most N-1 child tests and one bonus draw
        u = iter(torch.rand(n + 1, generator=g, dtype=S.prob_dtype(g.device), device=g.device).tolist())
        path, v = [0], 0
        while True:
            p, kids = probs[v], layout.children[v]
            if not kids:
                return Verdict(path, draw(p, next(u)))
            if tree.sampled:
                q = [0.0] * vocab
                for t, x in zip(tree.child_dist_ids[v], tree.child_dist_probs[v]):
                    q[t] = x
                total = sum(q)
                qs = [[x / total for x in q]] * len(kids)
            else:
                qs = [[float(t == tree.token_ids[c]) for t in range(vocab)] for c in kids]
            j, resid = self.pick(p, qs, [tree.token_ids[c] for c in kids], u)
            if j < 0:
                return Verdict(path, draw(resid, next(u)))
            v = kids[j]
            path.append(v)


@WrongRule
def wrong_resample_from_p(p, qs, toks, u):
    """WRONG: accept each child with min(1, p/q) against the unchanged p; if all fail, draw from p."""
    for j, (q, x) in enumerate(zip(qs, toks)):
        if next(u) * q[x] < p[x]:
            return j, p
    return -1, p


@WrongRule
def wrong_no_sibling_residual(p, qs, toks, u):
    """WRONG: siblings are all tested against the original p (no residual update between them);
    the bonus comes from the single-draft residual normalize(max(p - q, 0))."""
    for j, (q, x) in enumerate(zip(qs, toks)):
        if next(u) * q[x] < p[x]:
            return j, p
    resid = [max(a - b, 0.0) for a, b in zip(p, qs[0])]
    return -1, resid if sum(resid) > 0 else p


@WrongRule
def wrong_skip_repeated_siblings(p, qs, toks, u):
    """WRONG (subtle): the correct residual rule, but a sibling repeating an already rejected
    token is skipped. Its test would surely reject, yet its residual update is then lost."""
    r, seen = p, set()
    for j, (q, x) in enumerate(zip(qs, toks)):
        if x in seen:
            continue
        seen.add(x)
        if next(u) * q[x] < r[x]:
            return j, r
        resid = [max(a - b, 0.0) for a, b in zip(r, q)]
        total = sum(resid)
        r = [a / total for a in resid] if total > 0 else r
    return -1, r


WRONG_RULES = (wrong_resample_from_p, wrong_no_sibling_residual, wrong_skip_repeated_siblings)
