"""The per-round tree budget: verify cost fit, acceptance calibration, the choice, and that
choosing nodes never changes greedy output."""

from __future__ import annotations

import asyncio
import itertools
import math
import random

from schemas import FlatTree, GenerateRequest, SamplingSpec, TreeSpec
from specsplit.local import generate
from specsplit.orchestrator.actor import ActorPolicy, SessionActor
from specsplit.orchestrator.costmodel import (
    CACHE_NGRAMS,
    MAX_CHAINS,
    CostModel,
    Hits,
    LineFit,
    chain_sources,
    select_nodes,
)
from specsplit.tree import check_parents
from tests.conftest import greedy_reference
from tests.test_actor import LIMITS, EngineRpc

CHAIN = FlatTree(token_ids=[1, 2, 3, 4, 5, 6], parents=[-1, 0, 1, 2, 3, 4],
                 draft_logprobs=[0.0, -0.05, -0.05, -0.7, -0.7, -0.7])


def test_verify_line_is_fitted_and_never_negative():
    cm = CostModel()
    assert cm.verify_line() == (0.0, 0.0)
    for tokens in (1, 4, 9, 16, 2, 12):
        cm.observe_verify(tokens, 100.0 + 20.0 * tokens)
    a, b = cm.verify_line()
    assert abs(a - 100.0) < 1e-6 and abs(b - 20.0) < 1e-6
    flat = CostModel()
    for tokens in (1, 16):
        flat.observe_verify(tokens, 300.0 - tokens)  # noise that slopes down: clamped to 0
    assert flat.verify_line()[1] == 0.0


def test_free_verification_keeps_everything_and_costly_verification_prunes():
    free = CostModel()
    free.observe_verify(1, 100.0)
    free.observe_verify(16, 100.0)
    assert free.choose(CHAIN, 0).nodes == [0, 1, 2, 3, 4, 5]
    costly = CostModel()
    for tokens in range(1, 17):  # every size measured (an unmeasured one is priced optimistically)
        costly.observe_verify(tokens, 50.0 + 100.0 * tokens)
    choice = costly.choose(CHAIN, 0)
    assert choice.nodes == [0, 1, 2]  # the two likely nodes pay, the unlikely tail does not
    assert choice.expected_tokens > 2.5 and abs(choice.expected_ms - (50.0 + 100.0 * 3)) < 1e-6



# root + a likely chain: node path probabilities 0.9, 0.75, 0.6, 0.45, 0.3
LIKELY = FlatTree(token_ids=[1, 2, 3, 4, 5, 6], parents=[-1, 0, 1, 2, 3, 4],
                  draft_logprobs=[0.0, math.log(0.9), math.log(0.75 / 0.9), math.log(0.6 / 0.75),
                                  math.log(0.45 / 0.6), math.log(0.3 / 0.45)])


def test_each_forward_size_keeps_its_own_measured_cost():
    """llama.cpp's CPU matmul multiplies rows 4 at a time: a 4-token forward costs what a 3-token
    one does (ratios measured on a 2-core AVX512 Xeon). The model prices each size as measured, so the
    likely chain is verified as root + 3 nodes; the same chain where forwards cost a line
    through the same 1- to 3-token costs (what the linear fit assumed) stops at root + 2."""
    stair = {1: 100.0, 2: 160.0, 3: 212.0, 4: 211.0, 5: 267.0, 6: 337.0}
    cm = CostModel()
    for _ in range(10):
        for n, ms in stair.items():
            cm.observe_verify(n, ms)
    a, b = cm.verify_line()
    assert abs(a + 4 * b - stair[4]) > 20.0  # the line misprices the 4-row GEMM
    for n, ms in stair.items():
        assert abs(cm.verify_ms(n) - ms) < 0.05 * ms
    assert cm.choose(LIKELY, 0).nodes == [0, 1, 2, 3]
    linear = CostModel()
    for _ in range(10):
        for n in stair:
            linear.observe_verify(n, 100.0 + 56.0 * (n - 1))
    assert linear.choose(LIKELY, 0).nodes == [0, 1, 2]


def test_a_size_never_measured_is_priced_at_the_least_it_can_cost():
    """An unmeasured size costs at least what the nearest smaller measured size does: priced at
    that, it is tried (and measured) once it would pay there, instead of never (the line between
    2 and 9 tokens priced a 4-token verify too high for a lone lookup session to ever try it)."""
    cm = CostModel()
    for _ in range(5):
        cm.observe_verify(1, 100.0)
        cm.observe_verify(2, 160.0)
        cm.observe_verify(9, 460.0)
    a, b = cm.verify_line()
    assert a + 4 * b > 200.0  # the line: what a 4-token verify looked like
    assert cm.verify_ms(3) == cm.verify_ms(4) == cm.verify_ms(8) == cm.verify_ms(2)
    assert cm.verify_ms(20) == cm.verify_ms(9) and cm.verify_ms(100) == a + 100 * b  # past the table: the line
    assert cm.verify_ms(3.5) == cm.verify_ms(3)  # an average load: between the two sizes around it
    assert cm.choose(LIKELY, 0).nodes == [0, 1, 2, 3, 4, 5]  # all of it, at 2 tokens' price
    for _ in range(5):
        for n in range(3, 9):
            cm.observe_verify(n, 100.0 + 60.0 * (n - 1) - (40.0 if n == 4 else 0.0))
    assert cm.choose(LIKELY, 0).nodes == [0, 1, 2, 3]  # measured: 4 tokens cost what 3 do
    fresh = CostModel()
    fresh.observe_verify(8, 400.0)
    assert fresh.verify_ms(2) == min(400.0, fresh.verify_ms(100))  # below every measured size: no more than it


def test_expected_tokens_of_a_chain_match_what_it_delivers():
    """A node is on the accepted path only when every node above it is: a chain whose steps are
    each accepted with probability c delivers c + c^2 + ... tokens, and the calibrated model must
    expect that (not c per node: deep trees would look worth drafting and predictions run high)."""
    rng = random.Random(0)
    n = 8
    for c in (0.6, 0.8, 0.9):
        chain = FlatTree(token_ids=list(range(n + 1)), parents=[-1, *range(n)],
                         draft_logprobs=[0.0] + [math.log(c)] * n)
        cm, delivered = CostModel(), 0
        for _ in range(2000):
            accepted = list(itertools.takewhile(lambda _, c=c: rng.random() < c, range(1, n + 1)))
            delivered += len(accepted)
            cm.observe_round(chain, accepted, set())
        expected = sum(cm.node_probs(chain, set())[1:])
        true = sum(c ** k for k in range(1, n + 1))
        assert abs(delivered / 2000 - true) < 0.15 * true  # the simulation itself
        assert abs(expected - delivered / 2000) < 0.1 * true, (c, expected, delivered / 2000)
    # the same for a prompt-lookup chain, calibrated by position
    lookup, cm, delivered = set(range(1, n + 1)), CostModel(), 0
    chain = FlatTree(token_ids=list(range(n + 1)), parents=[-1, *range(n)], draft_logprobs=[0.0] * (n + 1))
    for _ in range(2000):
        accepted = list(itertools.takewhile(lambda _: rng.random() < 0.7, range(1, n + 1)))
        delivered += len(accepted)
        cm.observe_round(chain, accepted, lookup)
    assert abs(sum(cm.node_probs(chain, lookup)[1:]) - delivered / 2000) < 0.25


def test_select_nodes_keeps_a_valid_tree():
    tree = FlatTree(token_ids=[1, 2, 3, 4, 5], parents=[-1, 0, 0, 1, 3], draft_logprobs=[0.0] * 5)
    sub = select_nodes(tree, [0, 1, 3])
    assert sub.token_ids == [1, 2, 4] and sub.parents == [-1, 0, 1]
    check_parents(sub.parents, max_nodes=8, max_depth=8)


def test_generate_with_a_cost_model_equals_plain_greedy(models):
    target, often, _ = models["llama"]
    rng = random.Random(3)
    cm = CostModel()
    cm.observe_verify(1, 10.0)
    cm.observe_verify(16, 40.0)  # a steep line: the model prunes
    for _ in range(5):
        prompt = [rng.randrange(128) for _ in range(rng.randrange(2, 20))]
        want = greedy_reference(target, prompt, 20)[0]
        out = generate(often, target, prompt, max_new_tokens=20, tree=TreeSpec(max_nodes=12, max_depth=5, branch=2),
                       sampling=SamplingSpec(), cost_model=cm, lookup_max_tokens=4)
        assert out == want


def test_actor_with_a_cost_model_predicts_its_speed(models):
    from specsplit.engine.draft import DraftEngine
    from specsplit.engine.target import TargetEngine

    target, often, _ = models["qwen2"]
    spec = TreeSpec(max_nodes=8, max_depth=4, branch=2)
    cm, out = CostModel(), []
    prompt = [3, 14, 15, 92, 65, 35]
    req = GenerateRequest(session_id="c", prompt_token_ids=prompt, max_new_tokens=30, tree=spec)
    actor = SessionActor(req, EngineRpc(DraftEngine(often, LIMITS)), EngineRpc(TargetEngine(target, LIMITS)),
                         ActorPolicy(tree=spec, grow=True), out.append, cm)
    done = asyncio.run(actor.run())
    assert done.token_ids == greedy_reference(target, prompt, 30)[0]
    # it measured: overhead and a verify line that prices a forward (how it splits into intercept
    # and slope is timing, which swings on a shared box: not asserted)
    assert done.predicted_tok_s > 0 and cm.overhead_ms is not None and cm.verify_ms(1) > 0


def _warm(cm: CostModel, draft_ms_per_node: float, tok_per_ms: float = 0.008) -> CostModel:
    for i in range(8):
        cm.observe_verify(1 + i % 4, 150.0 + 25.0 * (1 + i % 4))
        cm.observe_draft(1 + i % 5, 30.0 + draft_ms_per_node * (1 + i % 5))
        cm.observe_rate(4, 4 / tok_per_ms)
    return cm


def test_draft_depth_is_priced_from_measured_costs():
    spec = TreeSpec(max_nodes=16, max_depth=10, branch=2, min_path_prob=0.3)
    assert CostModel().draft_spec(spec) == spec  # nothing measured yet: as configured
    costly = _warm(CostModel(), draft_ms_per_node=60.0).draft_spec(spec)
    cheap = _warm(CostModel(), draft_ms_per_node=1.0).draft_spec(spec)
    # 0.008 tok/ms x (60 + 25) ms = 0.68 expected tokens needed per expanded node; x (1 + 25) = 0.21
    assert 0.6 <= costly.min_path_prob <= 0.75, costly
    assert 0.15 <= cheap.min_path_prob <= 0.25, cheap
    assert (costly.max_nodes, costly.max_depth, costly.branch) == (16, 10, 2)
    # observed acceptance moves the threshold: paths the draft rates 0.5 that are always accepted
    cm = _warm(CostModel(), draft_ms_per_node=60.0)
    for _ in range(40):
        cm.observe_round(FlatTree(token_ids=[1, 2], parents=[-1, 0], draft_logprobs=[0.0, -0.69]), [1], set())
    assert cm.draft_spec(spec).min_path_prob <= 0.5 < costly.min_path_prob


def test_a_lone_plain_round_forces_a_lookup_node_only_now_and_then():
    """Alone, a draft round keeps at least one node (the draft was paid for), but a plain round
    (prompt-lookup candidates under a root, no draft call) verifies a node that does not pay only
    once in EXPLORE_EVERY rounds that have candidates: enough for lookup's calibration to notice
    when candidates start to pay, without a wider forward for nothing every round."""
    from specsplit.orchestrator.costmodel import EXPLORE_EVERY

    chain = FlatTree(token_ids=[1, 2, 3], parents=[-1, 0, 1], draft_logprobs=[0.0] * 3)
    lookup = {1, 2}
    cm = CostModel()
    for _ in range(10):
        for k in range(1, 5):
            cm.observe_verify(k, 100.0 + 60.0 * (k - 1))  # a second token costs 0.6 of the first
    for _ in range(50):
        cm.observe_round(chain, [], lookup)  # lookup's candidates are never accepted here
    picks = [len(cm.choose(chain, 1, lookup, plain=True).nodes) for _ in range(3 * EXPLORE_EVERY)]
    forced = [i for i, n in enumerate(picks) if n > 1]
    assert forced == [0, EXPLORE_EVERY, 2 * EXPLORE_EVERY] and all(picks[i] == 2 for i in forced), picks
    assert len(cm.choose(FlatTree(token_ids=[1], parents=[-1]), 1, set(), plain=True).nodes) == 1
    # a root-only tree did not count: the next chain is the (3 x EXPLORE_EVERY + 1)th chance, forced
    assert len(cm.choose(chain, 1, lookup, plain=True).nodes) == 2
    assert all(len(cm.choose(chain, 1, lookup).nodes) == 2 for _ in range(EXPLORE_EVERY))  # drafted: always
    # where they pay, lookup nodes are verified every round
    for _ in range(200):
        cm.observe_round(chain, [1, 2], lookup)
    assert all(len(cm.choose(chain, 1, lookup, plain=True).nodes) == 3 for _ in range(EXPLORE_EVERY))


def test_line_fit_and_hits_are_the_weighted_sums_and_smoothed_rates():
    fit = LineFit()
    assert fit.line() == (0.0, 0.0) and fit.y_per_x() is None
    for x, y in ((1.0, 3.0), (3.0, 7.0), (2.0, 5.0)):
        fit.observe(x, y, 0.9)
    a, b = fit.line()
    assert abs(a - 1.0) < 1e-9 and abs(b - 2.0) < 1e-9
    same = LineFit()
    for _ in range(3):
        same.observe(4.0, 10.0, 0.9)
    assert same.line() == (10.0, 0.0) and same.y_per_x() == 2.5  # x never varied: no slope
    cell = Hits()
    assert cell.posterior(0.5, 2.0) == 0.5  # nothing seen: the prior
    for hit in (True, True, True, False):
        cell.add(hit)
    assert (cell.hits, cell.total) == (3.0, 4.0) and cell.posterior(0.5, 2.0) == 4.0 / 6.0


def _chain_rounds(seed: int, n: int = 300):
    """Random trees with prompt-lookup and n-gram cache chains: (tree, accepted, lookup, cached)."""
    rng = random.Random(seed)
    for _ in range(n):
        size = rng.randrange(2, 20)
        parents = [-1] + [i - 1 if rng.random() < 0.6 else rng.randrange(i) for i in range(1, size)]
        tree = FlatTree(token_ids=list(range(size)), parents=parents,
                        draft_logprobs=[0.0] + [-rng.random() for _ in range(1, size)])
        lookup = {i for i in range(1, size) if rng.random() < 0.6}
        cached = {i: rng.randrange(0, CACHE_NGRAMS + 3) for i in lookup if rng.random() < 0.5}
        accepted, node = [], 0
        while kids := [i for i in range(1, size) if parents[i] == node and rng.random() < 0.7]:
            node = kids[0]
            accepted.append(node)
        yield tree, accepted, lookup, cached


def test_sources_of_lookup_and_the_ngram_cache_are_the_lookup_and_cached_parameters():
    """("lookup", 0) and ("ngrams", n) are the cells ``lookup`` and ``cached`` calibrate: a model
    told its chains as ``sources`` learns and chooses exactly as one told them the old way."""
    old, new = CostModel(), CostModel()
    for cm in (old, new):
        for k in range(1, 9):
            cm.observe_verify(k, 100.0 + 30.0 * k)
    for tree, accepted, lookup, cached in _chain_rounds(5):
        sources = chain_sources(lookup, cached)
        assert all(sources[i] == (("ngrams", cached[i]) if cached.get(i, 0) > 0 else ("lookup", 0)) for i in lookup)
        assert old.node_probs(tree, lookup, cached) == new.node_probs(tree, sources=sources)
        chosen = old.choose(tree, 1, lookup, plain=True, cached=cached)
        assert chosen == new.choose(tree, 1, plain=True, sources=sources)
        old.observe_round(tree, accepted, lookup, cached)
        new.observe_round(tree, accepted, sources=sources)
    assert old.chains == new.chains and set(old.chains) >= {("lookup", 0), ("ngrams", CACHE_NGRAMS)}
    assert all(new.lookup_prob(pos, n) == new.chain_prob(("ngrams", n) if n else ("lookup", 0), pos)
               for pos in range(20) for n in range(CACHE_NGRAMS + 3))


def test_a_new_proposer_is_calibrated_apart_and_continues_a_chain():
    """A chain proposer's nodes are calibrated by its own name (and key), never in lookup's cells;
    a chain node under another proposer's chain node is one position further down the chain."""
    chain = FlatTree(token_ids=[1, 2, 3, 4], parents=[-1, 0, 1, 2], draft_logprobs=[])
    cm = CostModel()
    for _ in range(50):  # a lookup node at position 0, then two "repeat" nodes: always accepted
        cm.observe_round(chain, [1, 2, 3], {1}, sources={2: ("repeat", 0), 3: ("repeat", 0)})
        cm.observe_round(chain, [], {1, 2, 3})  # lookup alone: never accepted
    assert cm.chain_prob(("repeat", 0), 1) > 0.9 and cm.chain_prob(("repeat", 0), 2) > 0.9
    assert cm.chain_prob(("repeat", 0), 0) == 0.5  # never observed at position 0: the prior
    assert cm.lookup_prob(1) < 0.1 and cm.lookup_prob(2) < 0.1 and 0.4 < cm.lookup_prob(0) < 0.6
    probs = cm.node_probs(chain, {1}, sources={2: ("repeat", 0), 3: ("repeat", 0)})
    assert probs[1] == cm.lookup_prob(0) and probs[2] == probs[3] == probs[1]  # capped by the parent
    assert cm.chain_prob(("repeat", 99), 1) == cm.chain_prob(("repeat", CACHE_NGRAMS), 1) == 0.5


def test_chain_calibration_keeps_at_most_max_chains_pairs():
    cm = CostModel()
    tree = FlatTree(token_ids=[1, 2], parents=[-1, 0])
    cm.observe_round(tree, [1], {1})  # prompt lookup first
    for k in range(MAX_CHAINS):
        cm.observe_round(tree, [1], sources={1: (f"p{k}", 0)})
        if k == MAX_CHAINS // 2:
            cm.observe_round(tree, [1], {1})  # observed again: no longer the least recent
    assert len(cm.chains) == MAX_CHAINS and ("lookup", 0) in cm.chains and ("p0", 0) not in cm.chains
    assert cm.chain_prob(("p0", 0), 0) == 0.5 and cm.chain_prob(("p1", 0), 0) == 2.0 / 3.0
