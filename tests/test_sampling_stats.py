"""Statistical oracles at the rule level: speculative sampling must leave the target's
distribution unchanged (the engines' oracles: tests/test_sampling_engines.py).

Every test draws the first 1-3 generated tokens many times (one seed per draw) and compares the
empirical counts with the target's exact distribution by a chi-square goodness-of-fit test at
ALPHA = 1e-3 (cells with expected count < 5 are pooled; tests/sampling_oracle.py): the joint of
all tokens and every shorter prefix must fit. All draws are seeded, so each test is
deterministic. The power tests run deliberately wrong rules through the same harness (same
draws, same fits) and assert that they are rejected.

DRAWS (10,000 for the reference case, 5,000 for the others): a toy "model" whose logits are a
pure function of the token path (same prefix -> same logits) for target and draft; trees are
built here (chains, full branching trees, data-dependent frontiers, siblings that carry the same
token, deterministic point-mass proposals), verified by ``verify_sampling`` exactly as the
target engine calls it, round after round until enough tokens are out. A draw costs about one
``verify_sampling`` call per round (~0.5 ms of small tensor ops, the floor); the harness around it
is host floats: per-context distributions computed once, i.i.d. children drawn by inverse CDF
from uniforms taken in one call from the draw's own generator, the wrong rules walked on host
floats, all in inference mode.

Why these draw counts suffice (power). A wrong rule's chi-square grows linearly with the draws;
with the seeds used here (min p over the fits): the gross rules (resample from p; no sibling
residual) are rejected at p < 1e-190 in every case where they are wrong; the subtle one (skip a
sibling repeating a rejected token) at p ~ 1e-9 on the reference case (10,000 draws: its effect
there is small, chi2 ~ 4 per 1,000 draws on the first token, hence the reference case's larger
count) and ~ 1e-14 on the EAGLE frontier case (5,000). Rules that are not wrong for a case (the
sibling rules on a chain; skipping a repeated point mass) are not asserted there. All but the
reference case and chi2_sf are marked slow.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

import pytest
import torch

from schemas import FlatTree, SamplingSpec
from specsplit.engine import sampling as S
from specsplit.engine.verify import verify_sampling
from specsplit.tree import validate_tree
from tests.sampling_oracle import (
    ALPHA,
    Fit,
    assert_fits,
    chi2_fit,
    chi2_sf,
    hf_probs,
    marginal,
    wrong_no_sibling_residual,
    wrong_resample_from_p,
    wrong_skip_repeated_siblings,
)
from tests.test_sampling import sparse

DRAWS = {"reference": 10_000, "chain_3_tokens": 5_000, "eagle_frontier_3_tokens": 5_000,
         "duplicate_siblings_topk_topp": 5_000, "point_mass_duplicates_topp": 5_000, "min_p": 5_000}  # per rule-level case
V = 8  # rule-level vocabulary


# ---- rule level: a toy model and trees built here ------------------------------------------
class QDist:
    """A draft's processed distribution at one context, ready for cheap seeded draws: q [V], its
    support (ids by decreasing probability, their probs), log q per id, and the CDF with, per
    index, the last id with mass at or before it (``S.inverse_cdf``'s rule, on host floats)."""

    def __init__(self, q: torch.Tensor):
        self.q = q
        self.ids, self.probs = sparse(q)
        self.logq = q.log().tolist()
        self.cdf = list(accumulate(q.tolist()))
        last, acc = [], -1
        for i, x in enumerate(q.tolist()):
            acc = i if x > 0 else acc
            last.append(acc)
        self.last = last

    def draw(self, u: float) -> int:
        """The id at uniform u in [0, 1) by inverse CDF (never one without mass)."""
        i = min(bisect_right(self.cdf, u * self.cdf[-1]), len(self.cdf) - 1)
        return self.last[i] if self.last[i] >= 0 else i


class PathLM:
    """Logits [V] as a pure function of the token context; ``pinned`` fixes some contexts,
    ``base`` (another PathLM) is added so a draft can resemble its target. Everything per
    context is computed once (logits, a draft's QDist)."""

    def __init__(self, seed: int, scale: float = 1.5, base: PathLM | None = None, pinned=None):
        self.seed, self.scale, self.base = seed, scale, base
        self.cache: dict[tuple, torch.Tensor] = dict(pinned or {})
        self.qcache: dict = {}

    def __call__(self, ctx: tuple[int, ...]) -> torch.Tensor:
        if ctx not in self.cache:
            x = torch.randn(V, generator=S.make_generator(self.seed, 0, repr(ctx)), dtype=torch.float64) * self.scale
            self.cache[ctx] = x if self.base is None else self.base(ctx) + x
        return self.cache[ctx]

    def q(self, ctx: tuple[int, ...], sampling: SamplingSpec) -> QDist:
        """As a draft: its processed distribution at ctx (``probs_from_logits``, as the engine)."""
        key = (ctx, sampling)
        if key not in self.qcache:
            self.qcache[key] = QDist(S.probs_from_logits(self(ctx)[None], sampling)[0])
        return self.qcache[key]


@dataclass(frozen=True)
class Case:
    """branch[d]: children per expanded node at depth d+1; expand: 0 expands every new node,
    k > 0 only the k best by cumulative draft log-prob (data-dependent, as the draft engine).
    proposals: 'iid' (children i.i.d. from q, carried in the tree) or 'dup' (deterministic point
    masses [top1, ..., top1, top2] of q: a repeated token, then a distinct one)."""

    branch: tuple[int, ...]
    n_tokens: int
    target: SamplingSpec
    draft: SamplingSpec
    proposals: str = "iid"
    expand: int = 0

    def uniforms(self, depth: int) -> int:
        """How many uniforms a tree of ``depth`` levels may draw (its i.i.d. children)."""
        if self.proposals != "iid":
            return 0
        total, frontier = 0, 1
        for b in self.branch[:depth]:
            total += frontier * b
            frontier = frontier * b if not self.expand else min(self.expand, frontier * b)
        return total


def build_tree(draft: PathLM, ctx: tuple[int, ...], case: Case, depth: int,
               u: list[float]) -> tuple[FlatTree, list[tuple]]:
    """A draft tree of ``depth`` levels under ctx; i.i.d. children are drawn from q with the
    uniforms ``u`` (in order), point-mass proposals take none."""
    iid = case.proposals == "iid"
    tokens, parents, ctxs, scores = [ctx[-1] if ctx else 0], [-1], [ctx], [0.0]
    dist_ids, dist_probs = [[]], [[]]
    frontier, k = [0], 0
    for b in case.branch[:depth]:
        new = []
        for f in frontier:
            d = draft.q(ctxs[f], case.draft)
            if iid:
                kids = [d.draw(x) for x in u[k : k + b]]
                k += b
                dist_ids[f], dist_probs[f] = d.ids, d.probs
            else:
                kids = [d.ids[0]] * (b - 1) + [d.ids[1]]
            cf, sf = ctxs[f], scores[f]
            for t in kids:
                new.append(len(tokens))
                tokens.append(t)
                parents.append(f)
                ctxs.append(cf + (t,))
                scores.append(sf + d.logq[t])
                dist_ids.append([])
                dist_probs.append([])
        frontier = new if not case.expand else heapq.nlargest(case.expand, new, key=lambda i: (scores[i], -i))
    assert k <= len(u), "Case.uniforms must cover every i.i.d. child"
    kw = {"child_dist_ids": dist_ids, "child_dist_probs": dist_probs} if iid and depth else {}
    return FlatTree(token_ids=tokens, parents=parents, **kw), ctxs


def rule_draw(target: PathLM, draft: PathLM, case: Case, seed: int, rule) -> tuple[int, ...]:
    """One seeded generation of case.n_tokens tokens, round after round, with ``rule`` verifying.
    One generator per draw (seed): each round takes its tree's uniforms from it in one call,
    then ``rule`` draws from it."""
    g = S.make_generator(seed, 0, "rule")
    out: list[int] = []
    while len(out) < case.n_tokens:
        depth = case.n_tokens - len(out) - 1
        m = case.uniforms(depth)
        u = torch.rand(m, generator=g, dtype=torch.float64).tolist() if m else []
        tree, ctxs = build_tree(draft, tuple(out), case, depth, u)
        layout = validate_tree(tree, vocab_size=V, max_nodes=256, max_depth=64)
        logits = torch.stack([target(c) for c in ctxs])  # [N, V]
        verdict = rule(tree, layout, logits, case.target, g)
        out += [tree.token_ids[i] for i in verdict.path[1:]] + [verdict.bonus]
    return tuple(out[: case.n_tokens])


def exact(target: PathLM, sampling: SamplingSpec, n: int) -> dict[tuple, float]:
    """The target's exact distribution of its first n tokens (enumerated over the support)."""
    dist = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for ctx, pr in dist.items():
            p = hf_probs(target(ctx)[None], sampling)[0]
            for t in torch.nonzero(p).flatten().tolist():
                nxt[ctx + (t,)] = pr * float(p[t])
        dist = nxt
    return dist


def rule_counts(target, draft, case: Case, rule, draws: int) -> Counter:
    """Counts of ``draws`` seeded generations (seeds 0..draws-1). Inference mode changes no
    number; it only spares every small tensor op autograd's bookkeeping (~18% of a draw)."""
    with torch.inference_mode():
        return Counter(rule_draw(target, draft, case, seed, rule) for seed in range(draws))


def rule_fits(target, case: Case, counts: Counter) -> list[tuple[str, Fit, Counter, dict]]:
    """The harness's verdict on counts: the fit of the joint of all n_tokens and of every
    shorter prefix, as (what, fit, counts, exact probs). A rule passes if every fit passes."""
    out = []
    for n in range(case.n_tokens, 0, -1):
        c, p = marginal(counts, n), exact(target, case.target, n)
        out.append((f"first {n} of {case.n_tokens} tokens", chi2_fit(c, p), c, p))
    return out


# The reference case: target [0.6, 0.3, 0.1] at the root, a draft that prefers token 1, three
# i.i.d. siblings (duplicates are common), each expanded again.
REF_P = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3), dtype=torch.float64)
REF_Q = torch.tensor([0.15, 0.6, 0.05, 0.2] + [0.0] * (V - 4), dtype=torch.float64)
T1 = SamplingSpec(temperature=1.0)


def ref_models():
    target = PathLM(1, pinned={(): REF_P.log()})
    draft = PathLM(2, base=target, scale=1.0, pinned={(): REF_Q.log()})
    return target, draft


REF_CASE = Case(branch=(3, 2), n_tokens=2, target=T1, draft=T1)

CASES = {
    # name: (seed, target logit scale, draft noise, case); draft logits = target's + noise * N(0, 1)
    "chain_3_tokens": (11, 1.5, 1.0, Case(branch=(1, 1, 1), n_tokens=3, target=T1, draft=T1)),
    "eagle_frontier_3_tokens": (13, 1.5, 1.5, Case(branch=(3, 2, 2), n_tokens=3, target=T1, draft=T1, expand=2)),
    "duplicate_siblings_topk_topp": (
        14, 1.5, 1.0,
        Case(branch=(4, 3), n_tokens=2, target=SamplingSpec(temperature=0.8, top_k=5, top_p=0.9),
             draft=SamplingSpec(temperature=1.2, top_k=2)),  # q has 2 tokens: siblings repeat
    ),
    "point_mass_duplicates_topp": (  # proposals [a, a, b], then [a, b]: no q is carried
        16, 1.0, 1.0,
        Case(branch=(3, 2), n_tokens=2, target=SamplingSpec(temperature=1.0, top_p=0.95), draft=T1, proposals="dup"),
    ),
    "min_p": (  # p and q each cut by min-p (q more): the draft proposes from a smaller support
        17, 1.5, 1.0,
        Case(branch=(3, 2), n_tokens=2, target=SamplingSpec(temperature=1.0, min_p=0.05),
             draft=SamplingSpec(temperature=0.9, min_p=0.2)),
    ),
}


def test_chi2_sf_reference_values():
    assert abs(chi2_sf(3.841458820694124, 1) - 0.05) < 1e-9
    assert abs(chi2_sf(18.307038053275146, 10) - 0.05) < 1e-9
    assert abs(chi2_sf(29.587843, 10) - 0.001) < 1e-6


def test_reference_case_matches_target():
    """The case an earlier implementation got wrong ([0.245, 0.70, 0.056] vs [0.6, 0.3, 0.1])."""
    target, draft, case = _case("reference")
    draws = DRAWS["reference"]
    counts = rule_counts(target, draft, case, verify_sampling, draws)
    for what, fit, c, p in rule_fits(target, case, counts):
        assert_fits(fit, c, p, f"reference: {what}")
    first, p1 = marginal(counts, 1), {(t,): float(REF_P[t]) for t in range(3)}
    # and a plain bound: 4 standard deviations of a frequency near 1/2 (0.02 at 10,000 draws)
    bound = 2 / draws**0.5
    assert max(abs(first[k] / draws - p1[k]) for k in p1) < bound, {k: first[k] / draws for k in p1}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_rule_level_matches_target(name):
    """DRAWS[name] draws per case; the joint of all n_tokens and every shorter prefix must fit."""
    target, draft, case = _case(name)
    counts = rule_counts(target, draft, case, verify_sampling, DRAWS[name])
    for what, fit, c, p in rule_fits(target, case, counts):
        assert_fits(fit, c, p, f"{name}: {what}")


def _case(name: str):
    if name == "reference":
        return (*ref_models(), REF_CASE)
    seed, scale, noise, case = CASES[name]
    target = PathLM(seed, scale=scale)
    return target, PathLM(seed + 100, scale=noise, base=target), case


# (case, wrong rule) pairs where the rule is wrong: on a chain (one child per node) the sibling
# rules are the correct single-draft rule, and for point-mass proposals skipping a repeated
# token loses nothing (its residual update is a no-op), so those pairs are left out.
POWER = [
    ("reference", wrong_resample_from_p),
    ("reference", wrong_no_sibling_residual),
    ("reference", wrong_skip_repeated_siblings),
    ("chain_3_tokens", wrong_resample_from_p),
    ("eagle_frontier_3_tokens", wrong_skip_repeated_siblings),
    ("duplicate_siblings_topk_topp", wrong_no_sibling_residual),
    ("point_mass_duplicates_topp", wrong_no_sibling_residual),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, rule", POWER, ids=[f"{n}-{r.__name__}" for n, r in POWER])
def test_wrong_rules_are_rejected(name, rule):
    """Power: the same harness (DRAWS[name] draws, the same fits at ALPHA) must reject a wrong rule."""
    target, draft, case = _case(name)
    fits = rule_fits(target, case, rule_counts(target, draft, case, rule, DRAWS[name]))
    what, fit, _, _ = min(fits, key=lambda f: f[1].p_value)
    assert fit.p_value < ALPHA, (f"{name}: {rule.__name__} not detected: best fit ({what}) chi2={fit.stat:.1f} "
                                 f"p={fit.p_value:.3g}")


