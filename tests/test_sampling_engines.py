"""Statistical oracles through the engines: speculative sampling, as the workers serve it, must
leave the target's distribution unchanged (the rules alone: tests/test_sampling_stats.py).

A tiny random Llama (vocabulary 12) and a noisy copy as its draft. The first token over
ENGINE_DRAWS (3,000) one-round draws through the batched request path a worker takes under load
(``draft_batch``, then ``verify_batch``: 50 sessions' trees verified in one fused target forward;
sampled drafts are served one by one there, as in the fleet), and the first two tokens over
GENERATE_DRAWS (1,200) draws through ``specsplit.local.generate`` (the single-session path). The
exact reference comes from the target's own full-context forward and transformers' logits
warpers; counts are compared by the chi-square fit of tests/sampling_oracle.py at ALPHA = 1e-3.
Both record what the target verified (trees, logits, seeds) and replay the wrong rules on it:
the gross rules are rejected at p ~ 0 (engines) and ~1e-78 / 1e-53 (generate), skipping a
repeated sibling at ~1e-20 through the engines.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from schemas import (
    CacheSync,
    DraftRequest,
    EndSession,
    SamplingSpec,
    TreeSpec,
    VerifyRequest,
)
from specsplit.engine import sampling as S
from specsplit.engine.base import EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.engine.verify import verify_sampling
from specsplit.local import RoundStats, generate
from tests.conftest import on_device, tiny_model
from tests.sampling_oracle import (
    ALPHA,
    WRONG_RULES,
    Fit,
    WrongRule,
    assert_fits,
    chi2_fit,
    hf_probs,
    marginal,
    wrong_no_sibling_residual,
    wrong_resample_from_p,
)

pytestmark = pytest.mark.slow

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


class Recorder:
    """Wraps a TargetEngine's ``decide`` (where the verification rule runs on the target's
    logits) and keeps each call's inputs, so the wrong rules can be replayed on exactly what the
    engine verified: (tree, layout, logits [N, V] on the engine's device, sampling, round).
    Replays draw from the engine's own per-(seed, round) generator on that device."""

    def __init__(self, engine: TargetEngine):
        self.calls: list[tuple] = []
        self._probs: list | None = None
        decide = engine.decide

        def recording(req, layout, logits, argmax=None, **kw):
            self.calls.append((req.tree, layout, logits.detach().clone(), req.sampling, req.round))
            return decide(req, layout, logits, argmax, **kw)

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


# transformers' order, and llama.cpp's (the temperature after the truncations, as the API's
# llama-server endpoints ask for: SamplingSpec.temperature_last)
ENGINE_SAMPLINGS = {"temperature-first": SamplingSpec(temperature=0.8, top_k=8, top_p=0.9),
                    "temperature-last": SamplingSpec(temperature=0.5, top_k=8, top_p=0.9, min_p=0.3,
                                                     temperature_last=True)}


@pytest.mark.slow
@pytest.mark.parametrize("order", list(ENGINE_SAMPLINGS))
def test_engines_first_token_matches_target(llama_pair, device, order):
    """ENGINE_DRAWS one-round draws through DraftEngine/TargetEngine as a worker serves requests
    queued together (``draft_batch``, ``verify_batch``): ENGINE_BATCH fresh sessions per batch,
    each with its own seed; their trees are verified in ONE target forward (the fused path,
    checked by ``batch_size``); sampled drafts are served one by one, as ``draft_batch`` does.
    4 i.i.d. siblings (repeats are common), top-k and top-p at both ends. The first generated
    token must follow the target's distribution, and the wrong rules replayed on the very
    logits and trees the engine verified must be rejected by the same fit."""
    target, draft = (on_device(m, device) for m in llama_pair)
    sampling = ENGINE_SAMPLINGS[order]
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
    # (the sharper llama.cpp-order distribution accepts the noisy draft less often, ~5%, too
    # seldom for the wrong rules to show: their power is checked in the first order)
    first = order == "temperature-first"
    assert (0.1 if first else 0.03) < accepted / ENGINE_DRAWS < 0.95, "the draft should be accepted sometimes"
    assert repeats > ENGINE_DRAWS // 4, "most trees should carry a repeated sibling"
    # the replay is faithful: verify_sampling replayed on the recorded rounds gives the engine's draws
    replayed, n = rec.first_tokens(verify_sampling, limit=REPLAY_CHECK), min(REPLAY_CHECK, ENGINE_DRAWS)
    assert replayed == Counter((t,) for t in firsts[:n]), "the replay must reproduce the engine's own draws"
    assert_fits(chi2_fit(counts, probs), counts, probs, "engines: first token")
    if first:
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
