"""Statistical oracles: speculative sampling must leave the target's distribution unchanged.

Every test draws the first 1-3 generated tokens many times (one seed per draw) and compares the
empirical counts with the target's exact distribution by a chi-square goodness-of-fit test at
ALPHA = 1e-3 (cells with expected count < 5 are pooled). All draws are seeded, so each test is
deterministic; ALPHA is the chance that a correct sampler fails for a fresh choice of seeds.
The power tests run deliberately wrong rules through the same harness and statistic and assert
that they are rejected.

Two levels:
- Rule level (20,000 draws each): a toy "model" whose logits are a pure function of the token
  path (same prefix -> same logits) for target and draft; trees are built here (chains, full
  branching trees, data-dependent frontiers, siblings that carry the same token, deterministic
  point-mass proposals), verified by ``verify_sampling`` exactly as the target engine calls it,
  round after round until enough tokens are out.
- Engines (tiny random Llama, vocabulary 12): the first token over 20,000 one-round draws through
  DraftEngine/TargetEngine requests, and the first two tokens over 5,000 draws through
  ``specsplit.local.generate`` (slower: it builds engines per call). The exact reference comes
  from the target's own full-context forward and transformers' logits warpers.
Cost: about 2.5 minutes on 2 CPU cores, 60 s of it the 20,000 engine rounds; every test over
~10 s is marked slow.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

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
DRAWS = 20_000
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
class PathLM:
    """Logits [V] as a pure function of the token context; ``pinned`` fixes some contexts,
    ``base`` (another PathLM) is added so a draft can resemble its target."""

    def __init__(self, seed: int, scale: float = 1.5, base: PathLM | None = None, pinned=None):
        self.seed, self.scale, self.base = seed, scale, base
        self.cache: dict[tuple, torch.Tensor] = dict(pinned or {})
        self.qcache: dict = {}

    def __call__(self, ctx: tuple[int, ...]) -> torch.Tensor:
        if ctx not in self.cache:
            x = torch.randn(V, generator=S.make_generator(self.seed, 0, repr(ctx)), dtype=torch.float64) * self.scale
            self.cache[ctx] = x if self.base is None else self.base(ctx) + x
        return self.cache[ctx]

    def q(self, ctx: tuple[int, ...], sampling: SamplingSpec):
        """As a draft: (q [V], support ids by decreasing probability, their probs, log q list)."""
        key = (ctx, sampling)
        if key not in self.qcache:
            q = S.probs_from_logits(self(ctx)[None], sampling)[0]
            ids, probs = sparse(q)
            self.qcache[key] = (q, ids, probs, q.log().tolist())
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


def build_tree(draft: PathLM, ctx: tuple[int, ...], case: Case, depth: int, g) -> tuple[FlatTree, list[tuple]]:
    tokens, parents, ctxs, scores, dists = [ctx[-1] if ctx else 0], [-1], [ctx], [0.0], {}
    frontier = [0]
    for b in case.branch[:depth]:
        new = []
        for f in frontier:
            q, ids, probs, logq = draft.q(ctxs[f], case.draft)
            if case.proposals == "iid":
                kids = S.sample_rows(q[None], g, b)[0].tolist()
                dists[f] = (ids, probs)
            else:
                kids = [ids[0]] * (b - 1) + [ids[1]]
            for t in kids:
                tokens.append(t)
                parents.append(f)
                ctxs.append(ctxs[f] + (t,))
                scores.append(scores[f] + logq[t])
                new.append(len(tokens) - 1)
        frontier = new if not case.expand else heapq.nlargest(case.expand, new, key=lambda i: (scores[i], -i))
    kw = {}
    if dists:
        kw["child_dist_ids"] = [dists[i][0] if i in dists else [] for i in range(len(tokens))]
        kw["child_dist_probs"] = [dists[i][1] if i in dists else [] for i in range(len(tokens))]
    return FlatTree(token_ids=tokens, parents=parents, **kw), ctxs


def rule_draw(target: PathLM, draft: PathLM, case: Case, seed: int, rule) -> tuple[int, ...]:
    """One seeded generation of case.n_tokens tokens, round after round, with ``rule`` verifying."""
    out, rnd = [], 0
    while len(out) < case.n_tokens:
        ctx = tuple(out)
        tree, ctxs = build_tree(draft, ctx, case, case.n_tokens - len(out) - 1, S.make_generator(seed, rnd, "draft"))
        layout = validate_tree(tree, vocab_size=V, max_nodes=256, max_depth=64)
        logits = torch.stack([target(c) for c in ctxs])  # [N, V]
        verdict = rule(tree, layout, logits, case.target, S.make_generator(seed, rnd, "target"))
        out += [tree.token_ids[i] for i in verdict.path[1:]] + [verdict.bonus]
        rnd += 1
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


def rule_fit(target, draft, case: Case, rule=verify_sampling, draws: int = DRAWS) -> tuple[Fit, Counter, dict]:
    counts = Counter(rule_draw(target, draft, case, seed, rule) for seed in range(draws))
    probs = exact(target, case.target, case.n_tokens)
    return chi2_fit(counts, probs), counts, probs


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
    target, draft = ref_models()
    fit, counts, probs = rule_fit(target, draft, REF_CASE)
    assert_fits(fit, counts, probs, "joint of 2 tokens")
    first, p1 = marginal(counts, 1), {(t,): float(REF_P[t]) for t in range(3)}
    assert_fits(chi2_fit(first, p1), first, p1, "first token")
    # and a plain bound: 0.015 is > 4 standard deviations of a frequency at 20,000 draws
    assert max(abs(first[k] / DRAWS - p1[k]) for k in p1) < 0.015, {k: first[k] / DRAWS for k in p1}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_rule_level_matches_target(name):
    """20,000 draws per case; the joint of all n_tokens and every shorter prefix must fit."""
    target, draft, case = _case(name)
    fit, counts, probs = rule_fit(target, draft, case)
    assert_fits(fit, counts, probs, f"{name}: joint of {case.n_tokens} tokens")
    for n in range(1, case.n_tokens):
        first, pn = marginal(counts, n), exact(target, case.target, n)
        assert_fits(chi2_fit(first, pn), first, pn, f"{name}: first {n} tokens")


# ---- power: wrong rules must be rejected by the same statistic ------------------------------
def _walk(tree: FlatTree, layout, logits, sampling, g, pick) -> Verdict:
    """Shared loop of the wrong rules: pick(p, q, children tokens, g) -> (index or -1, bonus dist)."""
    path, v = [0], 0
    while True:
        p = S.probs_from_logits(logits[v : v + 1], sampling)[0]
        kids = layout.children[v]
        if not kids:
            return Verdict(path, int(S.sample_rows(p[None], g, 1)[0, 0]))
        if tree.sampled:
            qs = [S.dense_rows([tree.child_dist_ids[v]], [tree.child_dist_probs[v]], logits.shape[-1],
                               dtype=torch.float64, device=logits.device)[0]] * len(kids)
        else:
            qs = [torch.nn.functional.one_hot(torch.tensor(tree.token_ids[c]), logits.shape[-1]).double() for c in kids]
        j, resid = pick(p, qs, [tree.token_ids[c] for c in kids], g)
        if j < 0:
            return Verdict(path, int(S.sample_rows(resid[None], g, 1)[0, 0]))
        v = kids[j]
        path.append(v)


def wrong_resample_from_p(tree, layout, logits, sampling, g) -> Verdict:
    """WRONG: accept each child with min(1, p/q) against the unchanged p; if all fail, draw from p."""

    def pick(p, qs, toks, g):
        for j, (q, x) in enumerate(zip(qs, toks)):
            if float(torch.rand(1, generator=g, dtype=torch.float64)) * float(q[x]) < float(p[x]):
                return j, p
        return -1, p

    return _walk(tree, layout, logits, sampling, g, pick)


def wrong_no_sibling_residual(tree, layout, logits, sampling, g) -> Verdict:
    """WRONG: siblings are all tested against the original p (no residual update between them);
    the bonus comes from the single-draft residual normalize(max(p - q, 0))."""

    def pick(p, qs, toks, g):
        for j, (q, x) in enumerate(zip(qs, toks)):
            if float(torch.rand(1, generator=g, dtype=torch.float64)) * float(q[x]) < float(p[x]):
                return j, p
        resid = torch.clamp(p - qs[0], min=0.0)
        return -1, resid if float(resid.sum()) > 0 else p

    return _walk(tree, layout, logits, sampling, g, pick)


def wrong_skip_repeated_siblings(tree, layout, logits, sampling, g) -> Verdict:
    """WRONG (subtle): the correct residual rule, but a sibling repeating an already rejected
    token is skipped. Its test would surely reject, yet its residual update is then lost."""

    def pick(p, qs, toks, g):
        r, seen = p, set()
        for j, (q, x) in enumerate(zip(qs, toks)):
            if x in seen:
                continue
            seen.add(x)
            if float(torch.rand(1, generator=g, dtype=torch.float64)) * float(q[x]) < float(r[x]):
                return j, r
            resid = torch.clamp(r - q, min=0.0)
            r = resid / resid.sum() if float(resid.sum()) > 0 else r
        return -1, r

    return _walk(tree, layout, logits, sampling, g, pick)


def _case(name: str):
    if name == "reference":
        return (*ref_models(), REF_CASE)
    seed, scale, noise, case = CASES[name]
    target = PathLM(seed, scale=scale)
    return target, PathLM(seed + 100, scale=noise, base=target), case


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, rule",
    [
        ("reference", wrong_resample_from_p),
        ("reference", wrong_no_sibling_residual),
        ("reference", wrong_skip_repeated_siblings),
    ],
)
def test_wrong_rules_are_rejected(name, rule):
    """Power: the same harness, draws (20,000) and chi-square test at ALPHA must reject a wrong rule."""
    target, draft, case = _case(name)
    fit, _, _ = rule_fit(target, draft, case, rule=rule)
    assert fit.p_value < ALPHA, f"{name}: {rule.__name__} not detected: chi2={fit.stat:.1f} p={fit.p_value:.3g}"


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


@pytest.mark.slow
def test_engines_first_token_matches_target(llama_pair, device):
    """20,000 one-round draws through DraftEngine/TargetEngine requests, as local.generate's first
    round sends them (fresh session per draw): 4 i.i.d. siblings (repeats are common), top-k and
    top-p at both ends. The first generated token must follow the target's distribution."""
    target, draft = (on_device(m, device) for m in llama_pair)
    sampling = SamplingSpec(temperature=0.8, top_k=8, top_p=0.9)
    tree = TreeSpec(max_nodes=5, max_depth=1, branch=4)
    limits = EngineLimits(max_sessions=2, max_session_tokens=64, max_tree_nodes=8, max_tree_depth=2)
    d_eng, t_eng = DraftEngine(draft, limits), TargetEngine(target, limits)
    sync = CacheSync(base_len=0, append_token_ids=PROMPT[:-1])
    counts, accepted, repeats = Counter(), 0, 0
    for seed in range(DRAWS):
        sid, sp = f"s{seed}", sampling.model_copy(update={"seed": seed})
        d = d_eng.handle(
            DraftRequest(session_id=sid, round=0, sync=sync, root=PROMPT[-1], tree=tree, sampling=sp)
        )
        v = t_eng.handle(VerifyRequest(session_id=sid, round=0, sync=sync, tree=d.tree, sampling=sp))
        d_eng.handle(EndSession(session_id=sid))
        t_eng.handle(EndSession(session_id=sid))
        counts[(([*v.accepted_token_ids, v.bonus_token_id])[0],)] += 1
        accepted += len(v.accepted_token_ids)
        repeats += len(set(d.tree.token_ids[1:])) < d.tree.num_nodes - 1
    probs = model_exact(target, PROMPT, sampling, 1)
    assert 0.1 < accepted / DRAWS < 0.95, "the draft should be accepted sometimes, rejected sometimes"
    assert repeats > DRAWS // 4, "most trees should carry a repeated sibling"
    assert_fits(chi2_fit(counts, probs), counts, probs, "engines: first token")


@pytest.mark.slow
def test_generate_first_two_tokens_match_target(llama_pair, device):
    """5,000 draws of specsplit.local.generate (it builds engines per call, so fewer draws than the
    rule-level tests): a 3-sibling i.i.d. tree, then a second round whenever the first ends early."""
    target, draft = (on_device(m, device) for m in llama_pair)
    sampling = SamplingSpec(temperature=1.0, top_p=0.95)
    tree = TreeSpec(max_nodes=4, max_depth=2, branch=3)
    draws = 5_000
    counts, stats = Counter(), RoundStats()
    for seed in range(draws):
        sp = sampling.model_copy(update={"seed": seed})
        counts[tuple(generate(draft, target, PROMPT, max_new_tokens=2, tree=tree, sampling=sp, stats=stats))] += 1
    assert 0.1 * draws < stats.accepted < stats.rounds, "acceptance should be neither rare nor certain"
    for n in (2, 1):
        probs = model_exact(target, PROMPT, sampling, n)
        assert_fits(chi2_fit(marginal(counts, n), probs), marginal(counts, n), probs, f"generate: first {n} tokens")
