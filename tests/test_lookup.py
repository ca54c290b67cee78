"""Prompt lookup: continuations of earlier occurrences of the context's suffix, merged into the
draft's tree at no model cost; greedy output stays the target's greedy decoding."""

from __future__ import annotations

import random

from schemas import FlatTree, SamplingSpec, TreeSpec
from specsplit.local import RoundStats, generate
from specsplit.tree import check_parents, lookup_continuation, merge_chain
from tests.conftest import greedy_reference


def test_lookup_finds_the_most_recent_longest_match():
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup_continuation(ctx, max_tokens=2, min_ngram=3) == [7, 8]  # most recent earlier [1, 2, 3]
    assert lookup_continuation(ctx, max_tokens=9, min_ngram=3) == [7, 8, 5, 1, 2, 3]
    assert lookup_continuation([4, 5, 6, 1, 2, 3], max_tokens=4, min_ngram=3) == []
    assert lookup_continuation([5, 1, 2, 3, 6, 0, 2, 3], max_tokens=2, min_ngram=2) == [6, 0]
    assert lookup_continuation(ctx, max_tokens=0) == [] and lookup_continuation([1, 2], max_tokens=3) == []


def test_merge_follows_existing_nodes_and_respects_caps():
    tree = FlatTree(token_ids=[10, 11, 12, 13], parents=[-1, 0, 1, 0], draft_logprobs=[0.0, -0.1, -0.2, -0.3])
    merged = merge_chain(tree, [11, 12, 14, 15], max_depth=10, max_nodes=64)
    assert merged.token_ids == [10, 11, 12, 13, 14, 15] and merged.parents == [-1, 0, 1, 0, 2, 4]
    check_parents(merged.parents, max_nodes=64, max_depth=10)
    assert merge_chain(tree, [11, 12, 14, 15], max_depth=3, max_nodes=64).token_ids == [10, 11, 12, 13, 14]
    assert merge_chain(tree, [13, 1, 2], max_depth=10, max_nodes=5).parents == [-1, 0, 1, 0, 3]
    assert merge_chain(tree, [11, 12], max_depth=10, max_nodes=64) is tree  # nothing new
    sampled = FlatTree(token_ids=[1, 2], parents=[-1, 0], child_dist_ids=[[2], []], child_dist_probs=[[1.0], []])
    assert merge_chain(sampled, [5], max_depth=4, max_nodes=8) is sampled


def test_generate_with_lookup_equals_plain_greedy(models):
    """Repetitive prompts, so lookup proposes often; output = the target's greedy decoding, and
    lookup adds nodes to the trees (a random target rarely continues the motif, so few are accepted)."""
    target, _, rarely = models["qwen2"]
    rng = random.Random(11)
    with_stats, without_stats = RoundStats(), RoundStats()
    for _ in range(6):
        motif = [rng.randrange(128) for _ in range(rng.randrange(4, 9))]
        prompt = motif * 4 + motif[: rng.randrange(len(motif))]
        want = greedy_reference(target, prompt, 24)[0]
        kw = dict(max_new_tokens=24, tree=TreeSpec(max_nodes=6, max_depth=4, branch=2), sampling=SamplingSpec())
        assert generate(rarely, target, prompt, lookup_max_tokens=8, stats=with_stats, **kw) == want
        assert generate(rarely, target, prompt, stats=without_stats, **kw) == want
    assert with_stats.drafted > without_stats.drafted  # lookup added nodes


def _lookup_by_scan(context, max_tokens, min_ngram=3, max_ngram=8, window=4096):
    """``lookup_continuation`` as first written: one Python pass over the window, most recent first."""
    if max_tokens <= 0 or len(context) <= min_ngram:
        return []
    ctx = context[-window:]
    n_ctx, last = len(ctx), ctx[-1]
    best_k, best_p = 0, -1
    for p in range(n_ctx - 1, min_ngram - 1, -1):
        if ctx[p - 1] != last:
            continue
        k = 1
        while k < max_ngram and k < p and ctx[p - 1 - k] == ctx[n_ctx - 1 - k]:
            k += 1
        if k > best_k:
            best_k, best_p = k, p
            if k == max_ngram:
                break
    return ctx[best_p:best_p + max_tokens] if best_k >= min_ngram else []


def test_lookup_finds_what_a_scan_of_the_window_finds():
    """The lookup finds where the last token recurs with list.index; over random contexts (small
    vocabularies: many recurrences, long matches; windows cutting the context) it returns what a
    plain scan of the window does."""
    import random

    rng = random.Random(3)
    for _ in range(3000):
        vocab, n = rng.choice([2, 3, 5, 20, 500]), rng.randrange(1, 300)
        ctx = [rng.randrange(vocab) for _ in range(n)]
        kw = {"max_tokens": rng.randrange(0, 10), "min_ngram": rng.randrange(1, 6), "max_ngram": rng.randrange(1, 10),
              "window": rng.choice([4096, 50, 7])}
        assert lookup_continuation(ctx, **kw) == _lookup_by_scan(ctx, **kw), (ctx, kw)
