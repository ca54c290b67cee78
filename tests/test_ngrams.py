"""The cross-session n-gram cache: lookup candidates from what earlier sessions generated, bounded,
calibrated apart from prompt lookup, and never changing greedy output."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from schemas import FlatTree, GenerateRequest, SamplingSpec, TreeSpec, VerifyRequest
from specsplit.metrics import OrchestratorMetrics
from specsplit.orchestrator.costmodel import CostModel
from specsplit.orchestrator.ngrams import NgramCache
from specsplit.orchestrator.state import plan_round, root_only
from tests.conftest import greedy_reference


def test_the_continuation_of_the_longest_confident_suffix():
    cache = NgramCache(1000)
    for _ in range(3):
        cache.add([1, 2, 3, 4, 5, 6])
    cache.add([9, 3, 4, 7])  # after [3, 4]: 5 three times, 7 once; after [9, 3, 4]: 7 once
    assert cache.continuation([8, 1, 2, 3], max_tokens=8) == ([4, 5, 6], [3, 4, 4])
    assert cache.continuation([8, 1, 2, 3], max_tokens=2) == ([4, 5], [3, 4])
    # [9, 3, 4] was seen once (min_count 2): the 2-token key [3, 4] answers, with its majority
    assert cache.continuation([9, 3, 4], max_tokens=1) == ([5], [2])
    assert cache.continuation([7, 7], max_tokens=4) == ([], [])  # unknown
    assert cache.continuation([5], max_tokens=4) == ([], [])  # shorter than the shortest key (2)
    split = NgramCache(1000)
    for nxt in (1, 1, 2, 2, 3):  # 40 % share each at best: below min_share 0.5
        split.add([7, 8, nxt])
    assert split.continuation([7, 8], max_tokens=3) == ([], [])
    one = NgramCache(1000, min_count=1, min_ngram=1)
    one.add([4, 5])
    assert one.continuation([4], max_tokens=3) == ([5], [1])


def test_the_cache_stays_within_its_bounds():
    rng = random.Random(3)
    cache = NgramCache(500, max_next=3)
    for _ in range(200):
        cache.add([rng.randrange(50) for _ in range(40)])
        assert len(cache) <= 500
    assert all(len(c) <= 3 + 1 for c in cache._table.values())  # continuations + the total
    # the least recently written n-grams go first: an old sequence is forgotten, a fresh one kept
    small = NgramCache(6)
    small.add([1, 2, 3])
    small.add([1, 2, 3])
    assert small.continuation([1, 2], max_tokens=1) == ([3], [2])
    small.add([5, 6, 7, 8, 9])
    small.add([5, 6, 7, 8, 9])  # 6 new keys of 2-4 tokens: [1, 2] is gone
    assert len(small) == 6 and small.continuation([1, 2], max_tokens=1) == ([], [])
    assert small.continuation([5, 6, 7], max_tokens=1) == ([8], [3])
    for bad in (dict(max_keys=0), dict(max_keys=9, min_ngram=3, max_ngram=2), dict(max_keys=9, min_share=0.0)):
        with pytest.raises(ValueError):
            NgramCache(**bad)


def test_a_round_takes_cache_candidates_only_where_prompt_lookup_has_none():
    cache = NgramCache(1000)
    for _ in range(2):
        cache.add([40, 41, 42, 43, 44])
    spec, greedy = TreeSpec(max_nodes=8, max_depth=6, branch=2), SamplingSpec()
    plan = plan_round(root_only(42), [7, 40, 41, 42], spec, greedy, lookup_max_tokens=8, ngrams=cache)
    assert plan.tree.token_ids == [42, 43, 44] and plan.lookup == {1, 2}
    assert plan.cached == {1: 3, 2: 4}  # the length of the key that proposed each node
    # a draft tree that already spells part of the chain: the rest hangs under it, keyed by depth
    drafted = FlatTree(token_ids=[42, 43, 50], parents=[-1, 0, 0], draft_logprobs=[0.0, -0.1, -0.2])
    plan = plan_round(drafted, [7, 40, 41, 42], spec, greedy, lookup_max_tokens=8, ngrams=cache)
    assert plan.tree.token_ids == [42, 43, 50, 44] and plan.tree.parents == [-1, 0, 0, 1]
    assert plan.lookup == {3} and plan.cached == {3: 4}
    # the context repeats itself: prompt lookup's candidates, not the cache's
    ctx = [40, 41, 42, 9, 9, 40, 41, 42]
    plan = plan_round(root_only(42), ctx, spec, greedy, lookup_max_tokens=8, ngrams=cache)
    assert plan.cached == {} and plan.tree.token_ids[1:3] == [9, 9]
    # sampled rounds never take lookup candidates; the cost model keeps `cached` aligned
    assert plan_round(root_only(42), [40, 41, 42], spec, SamplingSpec(temperature=0.8, seed=1),
                      lookup_max_tokens=8, ngrams=cache).tree.num_nodes == 1
    plan = plan_round(root_only(42), [7, 40, 41, 42], spec, greedy, lookup_max_tokens=8, ngrams=cache,
                      cost=CostModel(), plain=True)
    assert set(plan.cached) == set(plan.lookup) and plan.choice is not None


def test_cache_candidates_are_calibrated_apart_by_key_length():
    """Candidates after a 4-token key accepted 90 % a step, after a 2-token key 20 %, prompt
    lookup's 70 %: each keeps its own rate, and a steep verify cost buys the first chain only."""
    rng = random.Random(5)
    n = 4
    chain = FlatTree(token_ids=list(range(n + 1)), parents=[-1, *range(n)], draft_logprobs=[0.0] * (n + 1))
    lookup = set(range(1, n + 1))
    strong, weak = dict.fromkeys(lookup, 4), dict.fromkeys(lookup, 2)
    cm = CostModel()
    for _ in range(600):
        for cached, c in ((strong, 0.9), (weak, 0.2), (None, 0.7)):
            accepted = list(itertools.takewhile(lambda _: rng.random() < c, range(1, n + 1)))
            cm.observe_round(chain, accepted, lookup, cached)
    first = [cm.node_probs(chain, lookup, cached)[1] for cached in (strong, weak, None)]
    assert abs(first[0] - 0.9) < 0.05 and abs(first[1] - 0.2) < 0.05 and abs(first[2] - 0.7) < 0.05, first
    for _ in range(40):  # one token 100 ms, each more 80 ms
        for k in range(1, n + 2):
            cm.observe_verify(k, 100.0 + 80.0 * (k - 1))
    cm.min_nodes = 0
    assert len(cm.choose(chain, 1, lookup, plain=True, cached=strong).nodes) > 1
    assert cm.choose(chain, 1, lookup, plain=True, cached=weak).nodes == [0]


def test_later_sessions_verify_what_earlier_answers_continued_with(models):
    """Three sessions of one prompt through the actor, a lookup-only fleet with a fixed budget:
    the first two fill the cache, the third gets its candidates (most of its answer) in fewer
    rounds; every answer is the target's greedy decoding."""
    from specsplit.engine.draft import DraftEngine
    from specsplit.engine.target import TargetEngine
    from specsplit.orchestrator.actor import ActorPolicy, SessionActor
    from tests.test_actor import LIMITS, SPEC, EngineRpc

    target, often, _ = models["llama"]
    prompt, n = [5, 17, 99, 23, 61, 8, 44, 120], 24
    want = greedy_reference(target, prompt, n)[0]
    cache, metrics = NgramCache(10_000), OrchestratorMetrics()
    policy = ActorPolicy(tree=SPEC, lookup_max_tokens=8, lookup_only=True)
    d_rpc, t_rpc = EngineRpc(DraftEngine(often, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    done, cached_nodes = [], []
    for k in range(3):
        req = GenerateRequest(session_id=f"s{k}", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC)
        t_rpc.requests.clear()
        done.append(asyncio.run(SessionActor(req, d_rpc, t_rpc, policy, lambda m: None, None, ngrams=cache,
                                             metrics=metrics).run()))
        trees = [m.tree for m in t_rpc.requests if isinstance(m, VerifyRequest)]
        cached_nodes.append(sum(t.num_nodes - 1 for t in trees))
        assert done[-1].token_ids == want
    assert d_rpc.requests == []
    assert done[2].rounds < done[0].rounds and done[2].rounds < done[1].rounds, [d.rounds for d in done]
    assert done[2].accepted_tokens > done[0].accepted_tokens and cached_nodes[2] > cached_nodes[0]
    # the cache's own counters: what it proposed and what of it was accepted
    proposed, accepted = metrics.cache_draft_tokens._value.get(), metrics.cache_accepted_tokens._value.get()
    assert 0 < accepted <= proposed <= sum(cached_nodes), (accepted, proposed, cached_nodes)
