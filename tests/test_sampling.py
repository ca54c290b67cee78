"""Unit oracles for sampling.py and verify_sampling, plus seeded reproducibility of generate.

The statistical (distribution-level) tests live in test_sampling_stats.py (rules) and test_sampling_engines.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from schemas import FlatTree, SamplingSpec, TreeSpec
from specsplit.local import generate
from specsplit.engine import sampling as S
from specsplit.tree import validate_tree
from specsplit.engine.verify import verify_sampling
from tests.conftest import tiny_model
from tests.sampling_oracle import hf_probs

V = 16


def sparse(probs: torch.Tensor) -> tuple[list[int], list[float]]:
    """Probability vector [V] -> (ids, probs) of its support, highest first."""
    ids = torch.nonzero(probs > 0).flatten()
    order = torch.argsort(probs[ids], descending=True)
    return ids[order].tolist(), probs[ids][order].tolist()


def sample_from(probs: torch.Tensor, g: torch.Generator, n: int) -> list[int]:
    return S.sample_rows(probs[None], g, n)[0].tolist()


def make_tree(tokens, parents, dists=None) -> tuple[FlatTree, object]:
    """A hand-made tree; dists: {node: probability vector [V]} its children were drawn from."""
    n = len(tokens)
    kw = {}
    if dists is not None:
        kw["child_dist_ids"] = [sparse(dists[i])[0] if i in dists else [] for i in range(n)]
        kw["child_dist_probs"] = [sparse(dists[i])[1] if i in dists else [] for i in range(n)]
    tree = FlatTree(token_ids=tokens, parents=parents, **kw)
    return tree, validate_tree(tree, vocab_size=V, max_nodes=64, max_depth=16)


def logits_of(*probs_rows) -> torch.Tensor:
    """Probability rows -> logits [N, V] (log, -inf on zeros)."""
    return torch.stack([torch.as_tensor(p, dtype=torch.float64).log() for p in probs_rows])


def vec(entries: dict[int, float]) -> torch.Tensor:
    out = torch.zeros(V, dtype=torch.float64)
    for i, p in entries.items():
        out[i] = p
    return out


# ---- probs_from_logits ---------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.6])
@pytest.mark.parametrize("top_k", [0, 1, 3, 8, 16, 40])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.8, 0.5, 0.1])
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3])
@pytest.mark.parametrize("temperature_last", [False, True])
def test_probs_from_logits_matches_transformers_warpers(temperature, top_k, top_p, min_p, temperature_last):
    g = torch.Generator().manual_seed(int(temperature * 10) * 1000 + top_k * 10 + int(top_p * 100) + int(min_p * 7))
    logits = torch.randn(64, V, generator=g) * 3.0  # [64, V] float32, no ties
    sampling = SamplingSpec(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            temperature_last=temperature_last)
    ours = S.probs_from_logits(logits, sampling)
    ref = hf_probs(logits, sampling)
    assert ours.dtype == torch.float64 and ours.shape == (64, V)
    assert torch.equal(ours > 0, ref > 0), "support differs from transformers"
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(ours.sum(-1), torch.ones(64, dtype=torch.float64))


def test_probs_from_logits_top_k_keeps_ties_and_max_support_caps():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -1.0, 2.0, -2.0] + [-5.0] * (V - 8)])
    sp = SamplingSpec(temperature=1.0, top_k=3)
    # k=3: 3.0, 2.0 and the three tied 1.0 survive (as in TopKLogitsWarper)
    assert (S.probs_from_logits(logits, sp) > 0).sum() == 5
    torch.testing.assert_close(S.probs_from_logits(logits, sp), hf_probs(logits, sp))
    capped = S.probs_from_logits(logits, SamplingSpec(temperature=1.0), max_support=2)
    torch.testing.assert_close(capped, hf_probs(logits, SamplingSpec(temperature=1.0, top_k=2)))
    capped = S.probs_from_logits(logits, SamplingSpec(temperature=1.0, top_k=1), max_support=2)
    assert capped[0].nonzero().flatten().tolist() == [0]


@pytest.mark.parametrize(
    "probs, top_p",
    [([0.5, 0.3, 0.2], 0.8), ([0.5, 0.3, 0.2], 0.5), ([0.25] * 4, 0.5), ([0.4, 0.2, 0.2, 0.2], 0.6)],
)
def test_probs_from_logits_top_p_boundaries_and_ties_match_transformers(probs, top_p):
    """Mass exactly at top_p and tied probabilities: the same tokens survive as in transformers."""
    logits = torch.tensor([probs + [0.0] * (V - len(probs))], dtype=torch.float64).log()
    sp = SamplingSpec(temperature=1.0, top_p=top_p)
    torch.testing.assert_close(S.probs_from_logits(logits, sp), hf_probs(logits, sp), atol=0, rtol=0)


def test_temperature_last_keeps_the_tokens_temperature_one_keeps():
    """llama.cpp's order: top-p and min-p choose at temperature 1, then the survivors are scaled.
    Here the two orders keep different tokens, so the switch is not a no-op."""
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-30.0] * (V - 3)], dtype=torch.float64)
    first = SamplingSpec(temperature=0.5, top_p=0.8)
    last = first.model_copy(update={"temperature_last": True})
    p1 = torch.softmax(logits, -1)[0]
    assert p1[0] < 0.8 < p1[0] + p1[1]  # at temperature 1, top-p 0.8 keeps two tokens
    assert (S.probs_from_logits(logits, first) > 0).sum() == 1  # sharpened first: one
    kept = S.probs_from_logits(logits, last)
    assert (kept > 0).sum() == 2
    torch.testing.assert_close(kept[0, :2], torch.softmax(torch.tensor([4.0, 2.0], dtype=torch.float64), -1))


@pytest.mark.parametrize("sampling", [
    SamplingSpec(temperature=0.7, top_k=40, top_p=0.9), SamplingSpec(temperature=1.3, top_k=5, min_p=0.1),
    SamplingSpec(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, temperature_last=True),
    SamplingSpec(temperature=1.0, top_k=1), SamplingSpec(temperature=0.5, top_p=0.8)])
def test_top_k_first_equals_the_whole_vocabulary(sampling, monkeypatch):
    """The k largest logits alone (``top_k_rows``) give the whole-vocabulary path's distribution:
    float32 and bfloat16 logits, -inf among them, a row tied at its k-th logit (whole path),
    and the draft's support cap."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 5000, generator=g) * 3
    logits[1, :4000] = float("-inf")  # a grammar's mask
    logits[2, 100:140] = logits[2].max() - 0.5  # 40 tied just below the top: tied past k for k < 41
    for lg in (logits, logits.to(torch.bfloat16), logits[[0, 1, 3, 4, 5]]):
        k = sampling.top_k or 16
        assert (S.top_k_rows(lg, k, sampling) is None) == (lg.shape[0] == 6 and 1 < k < 41)  # (row 2 ties)
        fast = [S.probs_from_logits(lg, sampling, cap) for cap in (0, 16)]
        with monkeypatch.context() as m:
            m.setattr(S, "top_k_rows", lambda *a: None)
            whole = [S.probs_from_logits(lg, sampling, cap) for cap in (0, 16)]
        for a, b in zip(fast, whole):
            assert torch.equal(a > 0, b > 0)
            torch.testing.assert_close(a, b, atol=1e-15, rtol=1e-12)
    assert S.top_k_rows(logits[2:3], 5, sampling) is None  # the tie: the whole path keeps all 40


def test_probs_from_logits_rejects_greedy():
    with pytest.raises(ValueError):
        S.probs_from_logits(torch.zeros(1, V), SamplingSpec(temperature=0.0))


# ---- sample_rows ---------------------------------------------------------------------
def test_sample_from_is_seeded_inverse_cdf():
    probs = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(1), dtype=torch.float64), 0)
    a = sample_from(probs, torch.Generator().manual_seed(5), 500)
    b = sample_from(probs, torch.Generator().manual_seed(5), 500)
    assert a == b and len(a) == 500
    u = torch.rand(500, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    cdf = torch.cumsum(probs, 0)
    expected = [int((cdf <= x).sum()) for x in u.tolist()]  # first id whose cdf exceeds u
    assert a == expected
    assert sample_from(probs, torch.Generator().manual_seed(6), 500) != a


def test_sample_from_never_draws_zero_probability_ids():
    probs = vec({1: 0.2, 4: 0.5, 9: 0.3})
    draws = sample_from(probs, torch.Generator().manual_seed(0), 20_000)
    assert set(draws) == {1, 4, 9}
    freq = torch.bincount(torch.tensor(draws), minlength=V).double() / len(draws)
    assert (freq - probs).abs().max() < 0.02  # 20k draws: sd <= 0.0036
    assert set(sample_from(vec({V - 1: 1.0}), torch.Generator().manual_seed(0), 50)) == {V - 1}
    assert set(sample_from(vec({0: 1.0}), torch.Generator().manual_seed(0), 50)) == {0}
    unnormalized = sample_from(probs * 3.0, torch.Generator().manual_seed(0), 20_000)
    assert set(unnormalized) == {1, 4, 9}


def test_make_generator_depends_on_seed_round_and_role():
    def first(*a):
        return torch.rand(4, generator=S.make_generator(*a)).tolist()

    assert first(1, 2, "target") == first(1, 2, "target")
    assert len({tuple(first(*a)) for a in [(1, 2, "target"), (1, 2, "draft"), (1, 3, "target"), (2, 2, "target")]}) == 4


def test_sparse_dense_round_trip():
    probs = vec({3: 0.1, 7: 0.6, 2: 0.3})
    ids, ps = sparse(probs)
    assert ids == [7, 2, 3]
    dense = S.dense_rows([ids, []], [ps, []], V, dtype=torch.float64, device=torch.device("cpu"))
    torch.testing.assert_close(dense[0], probs)
    assert not dense[1].any()
    torch.testing.assert_close(S.dense_rows([ids], [[3 * p for p in ps]], V, dtype=torch.float64,
                                            device=torch.device("cpu"))[0], probs)  # renormalized


# ---- verify_sampling on hand-made trees ------------------------------------------------
ONE = SamplingSpec(temperature=1.0)


def run_verify(tree, layout, logits, sampling=ONE, seeds=range(300)):
    return [verify_sampling(tree, layout, logits, sampling, torch.Generator().manual_seed(s)) for s in seeds]


def test_verify_first_child_carrying_the_only_target_token_wins():
    """Target is a point mass on 5: children (5 is drawn twice) 3, 5, 5 -> node 2 is accepted
    whatever the draws; its own child 4 is accepted because the target there is also sure."""
    q = vec({3: 0.5, 5: 0.5})
    tree, layout = make_tree([0, 3, 5, 5, 4], [-1, 0, 0, 0, 2], dists={0: q, 2: vec({4: 1.0})})
    p_root, p_leaf, p_end = vec({5: 1.0}), vec({4: 1.0}), vec({6: 1.0})
    logits = logits_of(p_root, p_root, p_leaf, p_leaf, p_end)
    for v in run_verify(tree, layout, logits):
        assert v.path == [0, 2, 4] and v.bonus == 6


def test_verify_chain_accepts_everything_when_draft_equals_target():
    p = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64), -1)
    tokens = [0, 2, 9, 4]
    tree, layout = make_tree(tokens, [-1, 0, 1, 2], dists={0: p[0], 1: p[1], 2: p[2]})
    bonuses = set()
    for v in run_verify(tree, layout, p.log()):
        assert v.path == [0, 1, 2, 3]
        bonuses.add(v.bonus)
    assert len(bonuses) > 3  # the bonus is sampled from the leaf's target distribution


def test_verify_point_mass_rejection_moves_mass_to_the_other_sibling():
    """Deterministic proposals 1 and 2 with target support {1, 2}: if 1 is rejected, the residual
    is a point mass on 2, so node 2 is always accepted -- the round never ends at the root."""
    tree, layout = make_tree([0, 1, 2], [-1, 0, 0])
    p = vec({1: 0.3, 2: 0.7})
    paths = [tuple(v.path) for v in run_verify(tree, layout, logits_of(p, p, p))]
    assert set(paths) == {(0, 1), (0, 2)}
    assert abs(paths.count((0, 1)) / len(paths) - 0.3) < 0.1


def test_verify_rejected_tokens_never_come_back_as_bonus():
    """i.i.d. children 3, 3 from q = U{3, 4}; the target never emits 3, so both are rejected and
    the bonus comes from the residual normalize(max(p - q, 0)) = point mass on 5 here."""
    q = vec({3: 0.5, 4: 0.5})
    p = vec({4: 0.4, 5: 0.6})
    tree, layout = make_tree([0, 3, 3], [-1, 0, 0], dists={0: q})
    for v in run_verify(tree, layout, logits_of(p, p, p)):
        assert v.path == [0] and v.bonus == 5


def test_verify_single_child_accept_rate_is_min_one_p_over_q():
    q = vec({3: 0.8, 4: 0.2})
    p = vec({3: 0.2, 4: 0.3, 6: 0.5})  # accept 3 with prob 0.25; else residual on {4, 6} only
    tree, layout = make_tree([0, 3], [-1, 0], dists={0: q})
    verdicts = run_verify(tree, layout, logits_of(p, p), seeds=range(4000))
    rate = sum(v.path == [0, 1] for v in verdicts) / len(verdicts)
    assert abs(rate - 0.25) < 5 * (0.25 * 0.75 / 4000) ** 0.5
    assert {v.bonus for v in verdicts if v.path == [0]} == {4, 6}
    bonus_after_accept = {v.bonus for v in verdicts if v.path == [0, 1]}
    assert bonus_after_accept <= {3, 4, 6}


def test_verify_applies_target_top_k():
    """top_k=1 at the target makes it greedy at temperature 1: only argmax tokens survive."""
    p = torch.softmax(torch.tensor([[0.0, 2.0, 1.0, 3.0] + [-9.0] * (V - 4)] * 3, dtype=torch.float64), -1)
    tree, layout = make_tree([0, 1, 3], [-1, 0, 0])  # point masses: 1 rejected, 3 accepted
    for v in run_verify(tree, layout, p.log(), SamplingSpec(temperature=1.0, top_k=1)):
        assert v.path == [0, 2] and v.bonus == 3


def test_verify_is_seeded():
    q = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(0), dtype=torch.float64), 0)
    tree, layout = make_tree([0, 1, 2, 3, 4], [-1, 0, 0, 1, 1], dists={0: q, 1: q})
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a, b = run_verify(tree, layout, logits, seeds=range(50)), run_verify(tree, layout, logits, seeds=range(50))
    assert a == b
    assert len({(tuple(v.path), v.bonus) for v in a}) > 3


@pytest.mark.parametrize("sampled", [True, False])
@pytest.mark.parametrize("sampling", [SamplingSpec(temperature=1.0, top_k=3), SamplingSpec(temperature=0.7, top_k=8,
                                                                                         top_p=0.9),
                                      SamplingSpec(temperature=1.2, top_k=40, min_p=0.05, temperature_last=True)])
def test_verify_over_the_supports_draws_what_the_whole_rows_draw(sampled, sampling, monkeypatch):
    """With top-k, verification works on each node's columns (p's support, the draft's
    distribution, the children) instead of the vocabulary: the same verdict for every seed as
    over the whole rows, for sampled trees (i.i.d. siblings, repeats) and point-mass proposals."""
    import random

    from specsplit.engine import verify as Ver

    vocab, rng = 300, random.Random(f"{sampled}{sampling.top_k}")
    g, outcomes = torch.Generator().manual_seed(sampling.top_k), set()
    for case in range(12):
        logits = torch.randn(9, vocab, generator=g) * 2.5
        top = torch.topk(logits, 6, dim=-1).indices.tolist()  # children are likely tokens, repeats included
        parents = [-1] + [rng.randrange(i) for i in range(1, 9)]
        tokens = [0] + [rng.choice(top[parents[i]]) for i in range(1, 9)]
        dists = {}
        if sampled:
            for v in set(parents[1:]):
                q = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, 0)
                for c in (i for i in range(1, 9) if parents[i] == v):
                    q[tokens[c]] += 0.05
                keep = torch.topk(q, 20).indices
                q = torch.zeros(vocab, dtype=torch.float64).index_put_((keep,), q[keep])
                dists[v] = q / q.sum()
        if not sampled:  # point masses: distinct siblings
            seen = set()
            for i in range(1, 9):
                while (parents[i], tokens[i]) in seen:
                    tokens[i] = rng.randrange(vocab)
                seen.add((parents[i], tokens[i]))
        tree = FlatTree(token_ids=tokens, parents=parents,
                        **({"child_dist_ids": [sparse(dists[i])[0] if i in dists else [] for i in range(9)],
                            "child_dist_probs": [sparse(dists[i])[1] if i in dists else [] for i in range(9)]}
                           if sampled else {}))
        layout = validate_tree(tree, vocab_size=vocab, max_nodes=64, max_depth=16)
        fast = run_verify(tree, layout, logits, sampling, seeds=range(60))
        with monkeypatch.context() as m:
            m.setattr(Ver.S, "top_k_rows", lambda *a: None)
            whole = run_verify(tree, layout, logits, sampling, seeds=range(60))
        assert fast == whole, case
        outcomes.update((case, tuple(v.path), v.bonus) for v in fast)
    assert len(outcomes) > 12 * 2  # (draws that differ from seed to seed: the comparison is not vacuous)


# ---- reproducibility through generate ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair():
    return tuple(tiny_model("llama", seed=seed, scale=0.5, vocab=V, hidden=32, layers=1) for seed in (1, 2))


@pytest.mark.parametrize("sampling", [SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.7, top_k=5, top_p=0.9)])
def test_generate_same_seed_same_output(tiny_pair, sampling):
    target, draft = tiny_pair
    tree = TreeSpec(max_nodes=8, max_depth=3, branch=2)
    outs = {}
    for seed, _ in itertools.product(range(6), range(2)):
        sp = sampling.model_copy(update={"seed": seed})
        out = generate(draft, target, [3, 1, 4], max_new_tokens=12, tree=tree, sampling=sp)
        assert len(out) == 12
        assert outs.setdefault(seed, out) == out, f"seed {seed} is not reproducible"
    assert len({tuple(o) for o in outs.values()}) >= 3, "different seeds should usually differ"


def test_argmax_rows_equals_torch_argmax_with_ties_and_nans():
    """The verify rules' argmax (numpy's on the CPU for float rows) is torch's: the first index of
    a row's maximum, a NaN counting as the maximum, int64 on the input's device; other dtypes
    take torch's own."""
    from specsplit.engine.sampling import argmax_rows

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = torch.randn(7, 1000, generator=g).to(dtype)
        x[1, 10] = x[1, 500] = x[1].max() + 1  # a tie: the first wins
        x[2, 7] = float("nan")
        x[3, 3] = x[3, 900] = float("nan")  # the first NaN
        x[4] = float("-inf")
        x[5, 999] = float("inf")
        x[6] = 0.0
        for rows in (x, x[0], x[:, ::2], x.t().contiguous().t()):
            got = argmax_rows(rows)
            assert got.dtype == torch.int64 and got.device == rows.device and got.shape == rows.shape[:-1]
            assert torch.equal(got, rows.argmax(dim=-1)), (dtype, got, rows.argmax(dim=-1))
