"""The round's stages one at a time (specsplit.orchestrator.rounds): plan, propose (merge and
select), commit, learn; and the proposer registry. No sockets, no models."""

from __future__ import annotations

import asyncio

import pytest

from schemas import FlatTree, SamplingSpec, TreeSpec, VerifyReply
from specsplit.orchestrator import rounds
from specsplit.orchestrator.costmodel import CostModel
from specsplit.orchestrator.ngrams import NgramCache
from specsplit.orchestrator.state import RoundStats, SessionCursor, merge, root_only
from specsplit.proposers import REGISTRY, Proposal, Proposer, Shared, resolve
from specsplit.proposers.ngram_cache import NgramCacheProposer
from specsplit.proposers.prompt_lookup import PromptLookup
from specsplit.proposers.repeat_line import last_line_continuation

GREEDY, SAMPLED = SamplingSpec(), SamplingSpec(temperature=0.8, seed=3)
SPEC = TreeSpec(max_nodes=8, max_depth=6, branch=2)


class FixedTree(Proposer):
    """A tree proposer that always offers the same children under the root, and records what it saw."""

    name, kind, model_cost = "fixed_tree", "tree", True

    def __init__(self, children=(5, 6)):
        super().__init__(None, Shared())
        self.children, self.calls, self.verdicts = list(children), [], []

    async def propose(self, committed, budget, sampling, rnd):
        self.calls.append((list(committed), budget.spec.max_depth, rnd))
        tree = FlatTree(token_ids=[committed[-1], *self.children], parents=[-1] + [0] * len(self.children),
                        draft_logprobs=[0.0] + [-0.1] * len(self.children))
        return Proposal(tree=tree, draft_ms=4.0)

    def learn(self, verdict):
        self.verdicts.append(verdict)


def chain_proposers(ngrams: NgramCache | None = None):
    shared = Shared(policy=None, resources={"ngrams": ngrams} if ngrams else {})
    return [PromptLookup(None, shared), NgramCacheProposer(None, shared)]


def plan(cur, proposers, *, out=None, sampling=GREEDY, cost=None, exact=False, max_new=32, stop=frozenset()):
    return rounds.plan(0, cur, out if out is not None else [], prompt_len=cur.prompt_len, max_new_tokens=max_new,
                       stop=set(stop), tree=SPEC, sampling=sampling, exact=exact, proposers=proposers, cost=cost)


def test_plan_asks_the_proposers_the_round_needs():
    tree_p, (lookup, cache) = FixedTree(), chain_proposers()
    everyone = [tree_p, lookup, cache]
    cur = SessionCursor([1, 2, 3])
    rp = plan(cur, everyone)
    assert rp.proposers == (tree_p, lookup, cache) and not rp.plain and not rp.confirm
    assert rp.sync_tokens == 2 and rp.context_len == 3 and rp.spec.max_depth == SPEC.max_depth
    # sampled: the tree proposer alone (chains would bias the draw); no tree proposer: the root alone
    assert plan(cur, everyone, sampling=SAMPLED).proposers == (tree_p,)
    assert plan(cur, [lookup, cache], sampling=SAMPLED).proposers == ()
    # no model proposer: a plain round of chains
    rp = plan(cur, [lookup, cache])
    assert rp.plain and rp.proposers == (lookup, cache)
    # the cost model finds plain decoding pays under load (nothing measured yet: one session drafts to
    # measure, the rest decode plainly): no model call this round
    cost = CostModel()
    cost.active_sessions, cost.speculating = 3, 1
    rp = plan(cur, everyone, cost=cost)
    assert rp.plain and rp.proposers == (lookup, cache)
    # the depth never exceeds the tokens still wanted
    assert plan(cur, everyone, max_new=3).spec.max_depth == 2


class AheadTree(FixedTree):
    def __init__(self):
        super().__init__()
        self.ahead_calls = []

    def ahead(self, committed, budget, sampling, rnd):
        self.ahead_calls.append((list(committed), budget.spec.max_depth, rnd))


def test_the_first_round_overlaps_the_model_proposers_with_the_verify():
    """``overlap``: round 0 is plain (its root and free chains), the model proposer started on
    the prompt beside it; not later rounds, nor a round that would not have drafted anyway."""
    tree_p, (lookup, cache) = AheadTree(), chain_proposers()
    everyone, cur = [tree_p, lookup, cache], SessionCursor([7, 40, 41, 42])

    def first(rnd=0, **kw):
        kw = {"sampling": GREEDY, "max_new": 32, "cost": None, "exact": False, "most": 0, **kw}
        return rounds.plan(rnd, cur, [], prompt_len=cur.prompt_len, max_new_tokens=kw["max_new"], stop=set(),
                           tree=SPEC, sampling=kw["sampling"], exact=kw["exact"], proposers=everyone,
                           cost=kw["cost"], overlap=True, overlap_max_tokens=kw["most"])

    rp = first()
    assert rp.plain and rp.ahead == (tree_p,) and rp.proposers == (lookup, cache)
    c = asyncio.run(rounds.propose(rp, cur.committed, GREEDY, chain_tokens=8, cost=None))
    assert tree_p.ahead_calls == [([7, 40, 41, 42], SPEC.max_depth, 0)] and not tree_p.calls
    assert c.drafted is None and c.tree.token_ids[0] == 42
    assert first(sampling=SAMPLED).ahead == (tree_p,) and first(sampling=SAMPLED).proposers == ()
    assert first(rnd=1).ahead == () and first(rnd=1).proposers == (tree_p, lookup, cache)
    assert first(max_new=1).ahead == ()  # one token wanted: nothing to draft, now or later
    # a prompt longer than overlap_max_tokens (3 for the target to forward here): drafted first
    assert first(most=3).ahead == (tree_p,) and first(most=2).ahead == () and first(most=2).proposers[0] is tree_p
    cost = CostModel()
    cost.active_sessions, cost.speculating = 3, 1  # plain decoding pays under this load: no draft at all
    assert first(cost=cost).ahead == ()
    assert plan(cur, everyone).ahead == ()  # off by default


def test_plan_only_confirms_when_provisional_tokens_would_end_the_generation():
    cur = SessionCursor([1, 2, 3, 7, 8], confirmed=3, prompt_len=3)  # 7, 8 provisional (exact SpecPV)
    rp = plan(cur, [FixedTree(), *chain_proposers()], exact=True, max_new=2)
    assert rp.confirm and rp.proposers == ()
    assert not plan(cur, [FixedTree()], exact=True, max_new=10).confirm


def test_propose_merges_chains_in_order_with_sources_and_falls_back_to_the_cache():
    cache = NgramCache(100)
    for _ in range(2):
        cache.add([40, 41, 42, 43, 44])
    lookup, ngram = chain_proposers(cache)
    tree_p = FixedTree(children=(43, 50))
    rp = plan(SessionCursor([7, 40, 41, 42]), [tree_p, lookup, ngram])
    c = asyncio.run(rounds.propose(rp, [7, 40, 41, 42], GREEDY, chain_tokens=8, cost=None))
    # the draft spelled 43; the cache's chain 43, 44 follows it and adds 44 under it, keyed by its n-gram length
    assert c.tree.token_ids == [42, 43, 50, 44] and c.tree.parents == [-1, 0, 0, 1]
    assert c.sources == {3: ("ngrams", 4)} and c.cached == {3: 4} and c.lookup == {3}
    assert c.drafted is not None and c.drafted.draft_ms == 4.0 and tree_p.calls[0][0] == [7, 40, 41, 42]
    # the context repeats itself: prompt lookup proposes, so the cache (a fallback) is not asked
    ctx = [40, 41, 42, 9, 9, 40, 41, 42]
    c = asyncio.run(rounds.propose(plan(SessionCursor(ctx), [lookup, ngram]), ctx, GREEDY, chain_tokens=8, cost=None))
    assert c.tree.token_ids[1:3] == [9, 9] and {name for name, _ in c.sources.values()} == {"lookup"}
    # no chain tokens: chains are not asked at all
    c = asyncio.run(rounds.propose(plan(SessionCursor(ctx), [lookup, ngram]), ctx, GREEDY, chain_tokens=0, cost=None))
    assert c.tree.num_nodes == 1


def test_propose_keeps_a_sampled_tree_as_drawn_and_selects_greedy_nodes_with_the_cost_model():
    tree_p = FixedTree(children=(5, 6))
    ctx = [1, 2, 3, 1, 2, 3]
    rp = plan(SessionCursor(ctx), [tree_p, *chain_proposers()], sampling=SAMPLED)
    c = asyncio.run(rounds.propose(rp, ctx, SAMPLED, chain_tokens=8, cost=CostModel()))
    assert c.tree.token_ids == [3, 5, 6] and c.sources == {} and c.choice is None
    # greedy with a cost model: the choice's subtree, its chain sources renumbered to the kept nodes
    cost = CostModel(min_nodes=1)
    rp = plan(SessionCursor(ctx), [tree_p, *chain_proposers()], cost=cost)
    c = asyncio.run(rounds.propose(rp, ctx, GREEDY, chain_tokens=8, cost=cost))
    assert c.choice is not None and c.merged is not None and c.merged.num_nodes >= c.tree.num_nodes
    kept = c.choice.nodes
    assert c.tree.token_ids == [c.merged.token_ids[i] for i in kept]
    assert {kept[i]: s for i, s in c.sources.items()} == {i: s for i, s in c.merged_sources.items() if i in kept}


def test_merge_shares_one_node_budget_between_chains():
    base = root_only(9)
    chains = [("lookup", Proposal(chain=[1, 2, 3], keys=[0, 0, 0])), ("other", Proposal(chain=[4, 5], keys=[7, 8]))]
    tree, sources = merge(base, chains, SPEC, chain_tokens=4)
    assert tree.token_ids == [9, 1, 2, 3, 4] and tree.parents == [-1, 0, 1, 2, 0]
    assert sources == {1: ("lookup", 0), 2: ("lookup", 0), 3: ("lookup", 0), 4: ("other", 7)}


def reply(accepted_nodes, accepted, bonus, **kw):
    return VerifyReply(session_id="s", round=0, accepted_nodes=accepted_nodes, accepted_token_ids=accepted,
                       bonus_token_id=bonus, cache_len=kw.pop("cache_len", 0), verify_ms=kw.pop("verify_ms", 10.0), **kw)


def test_commit_streams_the_new_tokens_and_ends_at_a_stop_id():
    cur, out, stats = SessionCursor([1, 2, 3]), [], RoundStats()
    tree = FlatTree(token_ids=[3, 5, 6], parents=[-1, 0, 1], draft_logprobs=[0.0, -0.1, -0.1])
    got = rounds.commit(cur, out, stats, tree, reply([0, 1], [5], 8, cache_len=4), prompt_len=3, max_new_tokens=10,
                        stop=set(), exact=False)
    assert got.new == [5, 8] and got.stream == [5, 8] and not got.done and out == [5, 8]
    assert cur.committed == [1, 2, 3, 5, 8] and cur.target_len == 4 and stats.rounds == 1 and stats.accepted == 1
    got = rounds.commit(cur, out, stats, root_only(8), reply([0], [], 0, cache_len=5), prompt_len=3,
                        max_new_tokens=10, stop={0}, exact=False)
    assert got.done and got.stream == [0] and out == [5, 8, 0]
    # exact SpecPV: tokens accepted under a partial view are provisional, never streamed yet
    cur, out = SessionCursor([1, 2, 3]), []
    got = rounds.commit(cur, out, RoundStats(), tree, reply([0, 1], [5], 8, cache_len=4, confirmed_len=3, partial=True),
                        prompt_len=3, max_new_tokens=10, stop=set(), exact=True)
    assert got.stream is None and out == [] and cur.provisional == 2


def test_learn_feeds_the_cost_model_and_every_proposer():
    tree_p, (lookup, _) = FixedTree(children=(5, 6)), chain_proposers()
    cost = CostModel()
    cur = SessionCursor([1, 2, 3])
    rp = plan(cur, [tree_p, lookup], cost=cost)
    c = asyncio.run(rounds.propose(rp, cur.committed, GREEDY, chain_tokens=8, cost=cost))
    r = reply([0, 1], [c.tree.token_ids[1]], 8, verify_ms=12.0)
    timing = rounds.Timing(draft_ms=4.0, verify_ms=12.0, wall_ms=20.0)
    tokens, ms = rounds.learn(cost, [tree_p, lookup], rp, c, r, [c.tree.token_ids[1], 8], timing, clean=True)
    assert (tokens, ms) == (c.choice.expected_tokens, c.choice.expected_ms)
    assert tree_p.verdicts[0].verify_ms == 12.0 and tree_p.verdicts[0].new_tokens == [c.tree.token_ids[1], 8]
    assert cost.rate == pytest.approx(2 / 20.0) and cost.overhead_ms == pytest.approx(8.0)
    assert cost.verify_ms(rp.sync_tokens + c.tree.num_nodes) == pytest.approx(12.0)
    # a resend (not clean) enters the prediction with what it measured and teaches no times
    cost2 = CostModel()
    c2 = asyncio.run(rounds.propose(plan(cur, [tree_p], cost=cost2), cur.committed, GREEDY, chain_tokens=0, cost=cost2))
    assert rounds.learn(cost2, [tree_p], rp, c2, r, [5, 8], timing, clean=False) == (2.0, 20.0)
    assert cost2.rate is None and cost2.overhead_ms is None
    # a plain round (no model call) teaches what plain rounds deliver, never the speculative rate
    cost3 = CostModel()
    rp3 = plan(cur, [lookup], cost=cost3)
    c3 = asyncio.run(rounds.propose(rp3, cur.committed, GREEDY, chain_tokens=8, cost=cost3))
    rounds.learn(cost3, [lookup], rp3, c3, reply([0], [], 4), [4], rounds.Timing(verify_ms=10.0, wall_ms=11.0),
                 clean=True)
    assert cost3.rate is None and cost3.plain_overhead_ms == pytest.approx(1.0) and cost3.round_tokens == 1.0


def test_is_clean_takes_only_first_sends_of_small_syncs_after_round_0():
    ok = reply([0], [], 1)
    assert rounds.is_clean(3, 1, 2, ok)
    assert not rounds.is_clean(0, 1, 2, ok) and not rounds.is_clean(3, 2, 2, ok)
    assert not rounds.is_clean(3, 1, 500, ok) and not rounds.is_clean(3, 1, 2, reply([0], [], 1, partial=True))


def test_the_registry_resolves_names_and_refuses_unknown_repeated_or_two_tree_proposers():
    assert {"draft", "lookup", "ngrams", "repeat_line"} <= set(REGISTRY)
    assert [c.name for c in resolve(["draft", "lookup"])] == ["draft", "lookup"]
    with pytest.raises(ValueError, match="unknown proposer 'nope'"):
        resolve(["nope"])
    with pytest.raises(ValueError, match="named twice"):
        resolve(["lookup", "lookup"])

    class Other(Proposer):
        name, kind = "other_tree_for_test", "tree"

    REGISTRY[Other.name] = Other
    try:
        with pytest.raises(ValueError, match="at most one tree proposer"):
            resolve(["draft", Other.name])
    finally:
        del REGISTRY[Other.name]


def test_repeat_line_proposes_the_rest_of_the_previous_line():
    nl = frozenset({0})
    # previous line 5 6 7 NL, current line 5 6: the rest is 7 NL
    assert last_line_continuation([9, 0, 5, 6, 7, 0, 5, 6], nl, 8) == [7, 0]
    assert last_line_continuation([9, 0, 5, 6, 7, 0, 5, 6], nl, 1) == [7]
    assert last_line_continuation([5, 6, 7, 0], nl, 8) == [5, 6, 7, 0]  # a new line: the whole previous one
    assert last_line_continuation([5, 6, 7, 0, 5, 8], nl, 8) == []  # the current line went its own way
    assert last_line_continuation([5, 6, 7], nl, 8) == [] and last_line_continuation([0, 5], nl, 0) == []
