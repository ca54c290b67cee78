"""Statistical oracles: speculative sampling must leave the target's distribution unchanged.

Every test draws the first 1-3 generated tokens many times (one seed per draw) and compares the
empirical counts with the target's exact distribution by a chi-square goodness-of-fit test at
ALPHA = 1e-3 (cells with expected count < 5 are pooled): the joint of all tokens and every
shorter prefix must fit. All draws are seeded, so each test is deterministic; ALPHA is the
chance that a correct sampler fails one fit for a fresh choice of seeds. The power tests run
deliberately wrong rules through the same harness (same draws, same fits) and assert that they
are rejected.

Two levels:
- Rule level (DRAWS: 10,000 for the reference case, 5,000 for the others): a toy "model" whose
  logits are a pure function of the token path (same prefix -> same logits) for target and
  draft; trees are built here (chains, full branching trees, data-dependent frontiers, siblings
  that carry the same token, deterministic point-mass proposals), verified by
  ``verify_sampling`` exactly as the target engine calls it, round after round until enough
  tokens are out. A draw costs about one ``verify_sampling`` call per round (~0.5 ms of small
  tensor ops, the floor); the harness around it is host floats: per-context distributions
  computed once, i.i.d. children drawn by inverse CDF from uniforms taken in one call from the
  draw's own generator, the wrong rules walked on host floats, all in inference mode.
- Engines (tiny random Llama, vocabulary 12): the first token over ENGINE_DRAWS (3,000) one-round
  draws through the batched request path a worker takes under load (``draft_batch``, then
  ``verify_batch``: 50 sessions' trees verified in one fused target forward; sampled drafts are
  served one by one there, as in the fleet), and the first two tokens over GENERATE_DRAWS
  (1,200) draws through ``specsplit.local.generate`` (the single-session path). The exact
  reference comes from the target's own full-context forward and transformers' logits warpers.
  Both record what the target verified (trees, logits, seeds) and replay the wrong rules on it.

Why these draw counts suffice (power). A wrong rule's chi-square grows linearly with the draws;
with the seeds used here (min p over the fits):
- the gross rules (resample from p; no sibling residual) are rejected at p < 1e-50 in every
  harness where they are wrong (rule level < 1e-190, engines 0, generate ~1e-78 / 1e-53);
- the subtle one (skip a sibling repeating a rejected token) at p ~ 1e-9 on the reference case
  (10,000 draws: its effect there is small, chi2 ~ 4 per 1,000 draws on the first token, hence
  the reference case's larger count), ~ 1e-14 on the EAGLE frontier case (5,000) and ~ 1e-20
  through the engines (3,000).
Rules that are not wrong for a case (the sibling rules on a chain; skipping a repeated point
mass) are not asserted there. Cost: about 70 s on 2 CPU cores (20,000 rule-level and 20,000
engine draws took ~400 s); all but the reference case and chi2_sf are marked slow.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from schemas import CacheSync, DraftRequest, EndSession, FlatTree, SamplingSpec, TreeSpec, VerifyRequest
from specsplit.local import RoundStats, generate
from specsplit.engine import sampling as S
from specsplit.engine.draft import DraftEngine
from specsplit.engine.base import EngineLimits
from specsplit.engine.target import TargetEngine
from specsplit.tree import validate_tree
from specsplit.engine.verify import Verdict, verify_sampling
from tests.conftest import on_device, tiny_model
from tests.test_sampling import sparse

ALPHA = 1e-3
DRAWS = {"reference": 10_000, "chain_3_tokens": 5_000, "eagle_frontier_3_tokens": 5_000,
         "duplicate_siblings_topk_topp": 5_000, "point_mass_duplicates_topp": 5_000}  # per rule-level case
V = 8  # rule-level vocabulary


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
    """The reference distribution: transformers' warpers (temperature, top-k, top-p) + softmax.
    logits [N, V] -> [N, V] float64."""
    x = TemperatureLogitsWarper(sampling.temperature)(None, logits.to(torch.float64))
    if sampling.top_k > 0:
        x = TopKLogitsWarper(sampling.top_k)(None, x)
    if sampling.top_p < 1.0:
        x = TopPLogitsWarper(sampling.top_p)(None, x)
    return torch.softmax(x, dim=-1)


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
}


def assert_fits(fit: Fit, counts: Counter, probs: dict, what: str) -> None:
    top = sorted(probs, key=probs.get, reverse=True)[:4]
    n = sum(counts.values())
    detail = ", ".join(f"{k}: {counts.get(k, 0) / n:.4f} vs {probs[k]:.4f}" for k in top)
    assert fit.df >= 2, f"{what}: only {fit.df + 1} cells, the test would be vacuous"
    assert fit.impossible == 0, f"{what}: {fit.impossible} draws of zero-probability outcomes"
    assert fit.p_value > ALPHA, f"{what}: chi2={fit.stat:.1f} df={fit.df} p={fit.p_value:.2e} ({detail})"


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


# ---- power: wrong rules must be rejected by the same statistic ------------------------------
def _draw(dist: list[float], u: float) -> int:
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
                return Verdict(path, _draw(p, next(u)))
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
                return Verdict(path, _draw(resid, next(u)))
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


# ---- through the engines: a tiny random Llama ----------------------------------------------
EV = 12  # engine-level vocabulary
PROMPT = [3, 1, 4, 1, 5]


def tiny_llama(seed: int, scale: float = 0.1):
    return tiny_model("llama", seed=seed, scale=scale, attn="eager", vocab=EV, hidden=32, layers=1)


@pytest.fixture(scope="module")
def llama_pair():
    """(target, draft): the draft is the target with noise on every matrix (agrees sometimes)."""
    target, draft = tiny_llama(21), tiny_llama(21)
    g = torch.Generator().manual_seed(22)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return target, draft


@torch.no_grad()
def model_exact(model, prompt: list[int], sampling: SamplingSpec, n: int) -> dict[tuple, float]:
    """Exact distribution of the first n tokens from full-context forwards of the model."""
    dist = {(): 1.0}
    for _ in range(n):
        ctxs = list(dist)
        device = next(model.parameters()).device
        logits = model(torch.tensor([prompt + list(c) for c in ctxs], device=device)).logits[:, -1].cpu()  # [C, V]
        probs = hf_probs(logits, sampling)
        dist = {
            c + (t,): dist[c] * float(probs[i, t])
            for i, c in enumerate(ctxs)
            for t in torch.nonzero(probs[i]).flatten().tolist()
        }
    return dist


WRONG_RULES = (wrong_resample_from_p, wrong_no_sibling_residual, wrong_skip_repeated_siblings)


class Recorder:
    """Wraps a TargetEngine's ``decide`` (where the verification rule runs on the target's
    logits) and keeps each call's inputs, so the wrong rules can be replayed on exactly what the
    engine verified: (tree, layout, logits [N, V] on the engine's device, sampling, round).
    Replays draw from the engine's own per-(seed, round) generator on that device."""

    def __init__(self, engine: TargetEngine):
        self.calls: list[tuple] = []
        self._probs: list | None = None
        decide = engine.decide

        def recording(req, layout, logits, visible):
            self.calls.append((req.tree, layout, logits.detach().clone(), req.sampling, req.round))
            return decide(req, layout, logits, visible)

        engine.decide = recording

    @classmethod
    def merged(cls, recorders: list[Recorder]) -> Recorder:
        """One recorder holding the calls of several (generate builds a target per call)."""
        out = cls.__new__(cls)
        out.calls, out._probs = [c for r in recorders for c in r.calls], None
        return out

    def first_tokens(self, rule, rnd: int = 0, limit: int | None = None) -> Counter:
        """First generated token of the recorded rounds ``rnd`` (the first ``limit`` of them)
        verified by ``rule``, with the engine's per-(seed, round) generator."""
        if isinstance(rule, WrongRule) and self._probs is None:  # p per round, shared by the wrong rules
            self._probs = [S.probs_from_logits(lg, sp).tolist() for _, _, lg, sp, _ in self.calls]
        out = Counter()
        calls = [(i, c) for i, c in enumerate(self.calls) if c[4] == rnd][:limit]
        for i, (tree, layout, logits, sp, r) in calls:
            g = S.make_generator(sp.seed, r, "target", logits.device)
            v = rule.walk(tree, layout, self._probs[i], g) if isinstance(rule, WrongRule) else rule(
                tree, layout, logits, sp, g)
            out[(tree.token_ids[v.path[1]] if len(v.path) > 1 else v.bonus,)] += 1
        return out


def assert_wrong_rules_rejected(rec: Recorder, probs: dict, draws: int, what: str, rules=WRONG_RULES) -> dict[str, Fit]:
    """Power at the engine level: each wrong rule replayed on the recorded first rounds (the
    same draws, trees and logits) must be rejected by the same first-token fit."""
    fits = {}
    for rule in rules:
        counts = rec.first_tokens(rule)
        assert sum(counts.values()) == draws
        fits[rule.__name__] = fit = chi2_fit(counts, probs)
        assert fit.p_value < ALPHA, f"{what}: {rule.__name__} not detected: chi2={fit.stat:.1f} p={fit.p_value:.3g}"
    return fits


ENGINE_DRAWS = 3_000
ENGINE_BATCH = 50  # sessions whose VerifyRequests share one target forward
REPLAY_CHECK = 200  # engine draws replayed with verify_sampling to check the recording


@pytest.mark.slow
def test_engines_first_token_matches_target(llama_pair, device):
    """ENGINE_DRAWS one-round draws through DraftEngine/TargetEngine as a worker serves requests
    queued together (``draft_batch``, ``verify_batch``): ENGINE_BATCH fresh sessions per batch,
    each with its own seed; their trees are verified in ONE target forward (the fused path,
    checked by ``batch_size``); sampled drafts are served one by one, as ``draft_batch`` does.
    4 i.i.d. siblings (repeats are common), top-k and top-p at both ends. The first generated
    token must follow the target's distribution, and the wrong rules replayed on the very
    logits and trees the engine verified must be rejected by the same fit."""
    target, draft = (on_device(m, device) for m in llama_pair)
    sampling = SamplingSpec(temperature=0.8, top_k=8, top_p=0.9)
    tree = TreeSpec(max_nodes=5, max_depth=1, branch=4)
    limits = EngineLimits(max_sessions=ENGINE_BATCH, max_session_tokens=64, max_tree_nodes=8, max_tree_depth=2)
    d_eng, t_eng = DraftEngine(draft, limits), TargetEngine(target, limits)
    rec = Recorder(t_eng)
    sync = CacheSync(base_len=0, append_token_ids=PROMPT[:-1])
    firsts, accepted, repeats = [], 0, 0
    for start in range(0, ENGINE_DRAWS, ENGINE_BATCH):
        sps = {f"s{seed}": sampling.model_copy(update={"seed": seed}) for seed in range(start, start + ENGINE_BATCH)}
        drafts = d_eng.draft_batch([DraftRequest(session_id=sid, round=0, sync=sync, root=PROMPT[-1], tree=tree,
                                                 sampling=sp) for sid, sp in sps.items()])
        verdicts = t_eng.verify_batch([VerifyRequest(session_id=d.session_id, round=0, sync=sync, tree=d.tree,
                                                     sampling=sps[d.session_id]) for d in drafts])
        for sid in sps:
            d_eng.handle(EndSession(session_id=sid))
            t_eng.handle(EndSession(session_id=sid))
        for d, v in zip(drafts, verdicts):
            assert v.batch_size == ENGINE_BATCH, v  # one fused forward for the whole batch
            firsts.append(([*v.accepted_token_ids, v.bonus_token_id])[0])
            accepted += len(v.accepted_token_ids)
            repeats += len(set(d.tree.token_ids[1:])) < d.tree.num_nodes - 1
    counts, probs = Counter((t,) for t in firsts), model_exact(target, PROMPT, sampling, 1)
    assert 0.1 < accepted / ENGINE_DRAWS < 0.95, "the draft should be accepted sometimes, rejected sometimes"
    assert repeats > ENGINE_DRAWS // 4, "most trees should carry a repeated sibling"
    # the replay is faithful: verify_sampling replayed on the recorded rounds gives the engine's draws
    replayed, n = rec.first_tokens(verify_sampling, limit=REPLAY_CHECK), min(REPLAY_CHECK, ENGINE_DRAWS)
    assert replayed == Counter((t,) for t in firsts[:n]), "the replay must reproduce the engine's own draws"
    assert_fits(chi2_fit(counts, probs), counts, probs, "engines: first token")
    assert_wrong_rules_rejected(rec, probs, ENGINE_DRAWS, "engines")


GENERATE_DRAWS = 1_200
# skipping a repeated sibling changes this first token too little for 1,200 draws (its chi2
# excess is ~ 3 per 1,000 draws here); that rule's power at the engine level is in the test above
GENERATE_WRONG_RULES = (wrong_resample_from_p, wrong_no_sibling_residual)


@pytest.mark.slow
def test_generate_first_two_tokens_match_target(llama_pair, device):
    """GENERATE_DRAWS draws of specsplit.local.generate (the single-session path, engines built per
    call), one seed each: a 3-sibling i.i.d. tree, then a second round whenever the first ends
    early. The joint of the two tokens and the first token must fit; the gross wrong rules,
    replayed on the recorded first rounds, must be rejected by the first-token fit."""
    target, draft = (on_device(m, device) for m in llama_pair)
    sampling = SamplingSpec(temperature=1.0, top_p=0.95)
    tree = TreeSpec(max_nodes=4, max_depth=2, branch=3)
    recorders = []

    def recorded_target(model, limits):  # generate's hook for the verifier: a TargetEngine, recorded
        engine = TargetEngine(model, limits)
        recorders.append(Recorder(engine))
        return engine

    counts, stats = Counter(), RoundStats()
    for seed in range(GENERATE_DRAWS):
        sp = sampling.model_copy(update={"seed": seed})
        out = generate(draft, target, PROMPT, max_new_tokens=2, tree=tree, sampling=sp, stats=stats,
                       make_target_engine=recorded_target)
        counts[tuple(out)] += 1
    assert 0.1 * GENERATE_DRAWS < stats.accepted < stats.rounds, "acceptance should be neither rare nor certain"
    for n in (2, 1):
        probs = model_exact(target, PROMPT, sampling, n)
        assert_fits(chi2_fit(marginal(counts, n), probs), marginal(counts, n), probs, f"generate: first {n} tokens")
    assert_wrong_rules_rejected(Recorder.merged(recorders), model_exact(target, PROMPT, sampling, 1), GENERATE_DRAWS,
                                "generate", rules=GENERATE_WRONG_RULES)
