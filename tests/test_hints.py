"""Growth told the round's other proposers' nodes (GrowRequest ``tree``/``node_probs``,
``specsplit.orchestrator.hints``): the draft adds the chain nodes its tree lacks, scores them by
the orchestrator's estimates, forwards a chain in one forward and re-roots through it; the
re-rooted tree carries the draft's own log-probs, as fresh forwards give them."""

from __future__ import annotations

import math

import pytest

from schemas import (
    CacheSync,
    DraftReply,
    DraftRequest,
    ErrorCode,
    ErrorReply,
    FlatTree,
    GrowReply,
    GrowRequest,
    SamplingSpec,
    TreeSpec,
    VerifyRequest,
)
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.orchestrator.costmodel import CostModel
from specsplit.orchestrator.hints import growth_hint
from specsplit.orchestrator.state import Candidates, SessionCursor
from specsplit.tree import MIN_HINT_PROB, DraftTree, merge_chain, path_to
from tests.conftest import greedy_reference, tiny_model
from tests.test_grow import LIMITS, SPEC, sequential_logprob


def hint_for(g, chain: list[int], probs: list[float]) -> tuple[FlatTree, list[float]]:
    """The verified tree a round with ``chain`` hung under the root sends: the root and the chain
    (the draft's own nodes the draft already holds)."""
    tree = FlatTree(token_ids=[g.tokens[0], *chain], parents=[-1, *range(len(chain))])
    return tree, [1.0, *probs]


class CountForwards:
    """Growth stops after ``limit`` forwards (the worker's ``others_waiting`` check)."""

    def __init__(self, eng, limit: int):
        self.n, self.limit = 0, limit
        eng.others_waiting = self

    def __call__(self) -> bool:
        self.n += 1
        return self.n > self.limit


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_hinted_chain_grows_in_one_forward_and_is_rerooted_at(family):
    """A GrowRequest's tree adds a chain the draft's tree lacks: one forward holds the whole
    chain (each node seeing its ancestors' rows of that same forward), the next the chain
    nodes' children; their log-probs are what sequential forwards of the chain give, and a
    request whose accepted tokens run along the chain re-roots at a child of it (the chain's
    hinted nodes dropped from the next tree, which carries the draft's log-probs only)."""
    model = tiny_model(family, seed=13)
    eng = DraftEngine(model, LIMITS, steps_after_reuse=0)
    committed = [5, 9, 33, 70, 2, 81, 44]
    eng.handle(DraftRequest(session_id="h", round=0, tree=SPEC, root=committed[-1],
                            sync=CacheSync(base_len=0, append_token_ids=committed[:-1])))
    g = eng.store.get("h").draft_tree
    first = next(t for t in range(128) if t not in {g.tokens[c] for c in g.kids[0]})
    chain = [first, 77, 78, 79]
    tree, probs = hint_for(g, chain, [0.95, 0.9, 0.85, 0.8])
    CountForwards(eng, 2)
    grown = eng.handle(GrowRequest(session_id="h", round=0, budget_ms=60_000.0, width=8, tree=tree, node_probs=probs))
    assert isinstance(grown, GrowReply), grown
    path = g.child_path(chain)
    assert len(path) == 4 and set(path) <= g.hinted
    assert min(g.slot[n] for n in path) >= 0
    assert max(g.slot[n] for n in path) - min(g.slot[n] for n in path) == 3  # one forward, in order
    for k, node in enumerate(path):  # the chain's children: the draft's log-probs after the chain's prefix
        kids = [c for c in g.kids[node] if c not in g.hinted]
        assert kids, (k, node)
        for c in kids:
            want = sequential_logprob(model, committed + chain[: k + 1], g.tokens[c])
            assert abs(g.logps[c] - want) < 2e-4, (k, c)
    # the target accepts the chain's first two tokens; its bonus is the draft's best child of the second
    bonus_node = max((c for c in g.kids[path[1]] if c not in g.hinted and g.slot[c] >= 0),
                     key=lambda c: g.scores[c])
    new = [*chain[:2], g.tokens[bonus_node]]
    reply = eng.handle(DraftRequest(session_id="h", round=1, tree=SPEC, root=new[-1],
                                    sync=CacheSync(base_len=len(committed), append_token_ids=new[:-1])))
    assert isinstance(reply, DraftReply) and reply.reused_nodes > 0
    kept = eng.store.get("h").draft_tree
    assert not kept.hinted
    assert eng.store.get("h").kv.length == len(committed) + len(new) + sum(s >= 0 for s in kept.slot[1:])
    ctx = committed + new
    for i in range(1, reply.tree.num_nodes):
        p = [reply.tree.token_ids[a] for a in path_to(reply.tree.parents[i], reply.tree.parents)[1:]]
        want = sequential_logprob(model, ctx + p, reply.tree.token_ids[i])
        assert abs(reply.tree.draft_logprobs[i] - want) < 2e-4


def test_bad_growth_hints_are_refused_and_change_nothing():
    model = tiny_model("qwen2", seed=17)
    eng = DraftEngine(model, LIMITS)
    committed = [4, 8, 15, 16, 23, 42]
    eng.handle(DraftRequest(session_id="b", round=0, tree=SPEC, root=committed[-1],
                            sync=CacheSync(base_len=0, append_token_ids=committed[:-1])))
    g = eng.store.get("b").draft_tree
    before = (list(g.tokens), list(g.parents), list(g.slot), eng.store.get("b").kv.length)
    root = g.tokens[0]
    bad = [
        FlatTree(token_ids=[root + 1, 3], parents=[-1, 0]),  # another round's root
        FlatTree(token_ids=[root, 3, 4], parents=[-1, 2, 0]),  # not topological
        FlatTree(token_ids=[root, 10_000], parents=[-1, 0]),  # outside the vocabulary
        FlatTree(token_ids=[root, 3], parents=[-1, 0], child_dist_ids=[[3], []], child_dist_probs=[[1.0], []]),
    ]
    for tree in bad:
        r = eng.handle(GrowRequest(session_id="b", round=0, budget_ms=60_000.0, tree=tree,
                                   node_probs=[1.0] * tree.num_nodes))
        assert isinstance(r, ErrorReply) and r.code == ErrorCode.BAD_REQUEST, (tree, r)
        assert (g.tokens, g.parents, g.slot, eng.store.get("b").kv.length) == tuple(before)
        assert eng.store.get("b").draft_tree is g


class HintAware(DraftEngine):
    """Counts re-rootings whose accepted path ran through a hinted node."""

    hinted_reroots = 0

    def _reroot(self, kv, g, sync, root):
        path = g.child_path([*sync.append_token_ids, root])
        out = super()._reroot(kv, g, sync, root)
        if out is not None and set(path) & g.hinted:
            HintAware.hinted_reroots += 1
        return out


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_rounds_through_hinted_chains_equal_greedy_and_fresh_forwards(models, family):
    """Rounds as the orchestrator runs them: a shallow draft tree, and a chain proposer that
    knows the target's output four tokens deep (wrong at its fourth token every third round);
    each GrowRequest carries the verified tree with the chain, the real target verifies, and the
    next request re-roots through the chain. The output equals plain greedy decoding, some
    rounds re-root through a hinted chain, and every tree the draft sends carries the
    log-probs fresh forwards of its paths give."""
    target, often, _ = models[family]
    shallow = TreeSpec(max_nodes=4, max_depth=3, branch=2)  # growth forwards nodes up to depth 5
    prompt = [3, 61, 17, 99, 4, 40, 8]
    ref, _ = greedy_reference(target, prompt, 30)
    draft, verifier = HintAware(often, LIMITS, steps_after_reuse=0, grow_spares=2), TargetEngine(target, LIMITS)
    HintAware.hinted_reroots = 0
    cur, rnd = SessionCursor(list(prompt)), 0
    while len(cur.committed) - len(prompt) < len(ref):
        reply = draft.handle(DraftRequest(session_id="r", round=rnd, sync=cur.draft_sync(), root=cur.committed[-1],
                                          tree=shallow))
        assert isinstance(reply, DraftReply), reply
        cur.after_draft()
        for i in range(1, reply.tree.num_nodes):
            p = [reply.tree.token_ids[a] for a in path_to(reply.tree.parents[i], reply.tree.parents)[1:]]
            want = sequential_logprob(often, cur.committed + p, reply.tree.token_ids[i])
            assert abs(reply.tree.draft_logprobs[i] - want) < 2e-4, (rnd, i)
        done = len(cur.committed) - len(prompt)
        chain = list(ref[done:done + 4])
        if rnd % 3 == 2 and len(chain) > 3:
            chain[3] = (chain[3] + 1) % 128
        merged = merge_chain(reply.tree, chain, max_depth=4, max_nodes=LIMITS.max_tree_nodes)
        sources = {i: ("lookup", 0) for i in range(reply.tree.num_nodes, merged.num_nodes)}
        hint, probs = growth_hint(Candidates(merged, sources, merged=merged, merged_sources=sources), None)
        CountForwards(draft, 3)
        grown = draft.handle(GrowRequest(session_id="r", round=rnd, budget_ms=60_000.0, tree=hint, node_probs=probs))
        assert isinstance(grown, GrowReply), grown
        verdict = verifier.handle(VerifyRequest(session_id="r", round=rnd, sync=cur.target_sync(), tree=merged,
                                                sampling=SamplingSpec()))
        cur.apply_verify(verdict)
        rnd += 1
    assert cur.committed[len(prompt):][: len(ref)] == ref
    assert HintAware.hinted_reroots > 0


def small_tree() -> DraftTree:
    """root 5 (forwarded) with the draft's children 1 (-0.2) and 2 (-1.8); 1 has child 3 (-0.5);
    the root's spares 7 and 8."""
    g = DraftTree(5, 10, 2)
    a = g.add(0, 1, -0.2)
    g.add(0, 2, -1.8)
    g.add(a, 3, -0.5)
    g.slot[a] = 10
    g.spares[0] = [(7, -2.5), (8, -3.0)]
    return g


def test_hints_score_by_the_chance_the_target_takes_them_and_discount_the_rest():
    g = small_tree()
    before = list(g.scores)
    # root -> 1 (the draft's) -> 9 (new); root -> 7 (a spare) -> 4
    tree = FlatTree(token_ids=[5, 1, 9, 7, 4], parents=[-1, 0, 1, 0, 3])
    assert g.add_hints(tree, [1.0, 0.8, 0.6, 0.15, 0.1], max_depth=8, max_nodes=64) == 3
    n9, n7, n4 = 4, 5, 6
    assert [g.tokens[i] for i in (n9, n7, n4)] == [9, 7, 4] and g.hinted == {n9, n7, n4}
    assert g.parents[n9] == 1 and g.parents[n7] == 0 and g.parents[n4] == n7
    root_left = math.log(1 - 0.15)  # the root's other children: the target takes 7 with 0.15
    assert g.scores[1] == pytest.approx(before[1] + root_left)
    assert g.scores[2] == pytest.approx(before[2] + root_left)
    assert g.scores[n9] == pytest.approx(g.scores[1] + math.log(0.6 / 0.8))
    assert g.scores[3] == pytest.approx(before[3] + root_left + math.log(1 - 0.75))  # 1's other child
    assert g.scores[n7] == pytest.approx(math.log(0.15))
    assert g.scores[n4] == pytest.approx(math.log(0.1))
    assert g.spares[0] == [(8, -3.0)]  # 7 is a node now
    assert g.spare_candidates(8) == [(pytest.approx(-3.0 + root_left), 0)]
    later = g.add(1, 11, -1.0)  # a draft child of 1 added later loses the hinted child's chance too
    assert g.scores[later] == pytest.approx(g.scores[1] - 1.0 + math.log(0.25))
    assert g.logps[later] == -1.0  # the draft's own log-prob, which a re-rooted tree carries
    # re-rooting at 1 keeps the draft's nodes only, scored by their own log-probs again
    assert g.kept_subtree(1) == [1, 3, later]
    r = g.rerooted(1, 11, {10: 10})
    assert not r.hinted and not r.discount and r.tokens == [1, 3, 11]
    assert r.scores == [0.0, -0.5, -1.0]


def test_hints_stop_at_the_depth_and_node_caps_and_never_score_minus_infinity():
    g = small_tree()
    chain = FlatTree(token_ids=[5, 20, 21, 22, 23], parents=[-1, 0, 1, 2, 3])
    assert g.add_hints(chain, [1.0, 0.9, 0.0, 0.0, 0.0], max_depth=2, max_nodes=64) == 2  # depths 1, 2
    deepest = max(g.hinted, key=lambda n: g.depths[n])
    assert g.depths[deepest] == 2 and math.isfinite(g.scores[deepest])
    assert g.scores[deepest] == pytest.approx(math.log(0.9) + math.log(MIN_HINT_PROB))
    g2 = small_tree()
    assert g2.add_hints(chain, [1.0] * 5, max_depth=8, max_nodes=len(g2) + 1) == 1


def test_growth_hint_is_the_merged_tree_with_calibrated_probabilities():
    draft = FlatTree(token_ids=[5, 1, 2], parents=[-1, 0, 0], draft_logprobs=[0.0, -0.2, -1.8])
    assert growth_hint(Candidates(draft, merged=draft), None) == (None, [])
    merged = merge_chain(draft, [7, 8], max_depth=4, max_nodes=16)
    sources = {3: ("lookup", 0), 4: ("lookup", 0)}
    cost = CostModel()
    for _ in range(20):  # lookup's first token accepted, its second rejected
        cost.observe_round(merged, [3], sources=sources)
    tree, probs = growth_hint(Candidates(merged, sources, merged=merged, merged_sources=sources), cost)
    assert tree is merged and probs == pytest.approx(cost.node_probs(merged, sources=sources))
    assert probs[3] > 0.8 and probs[4] < 0.2 and all(0.0 <= p <= 1.0 for p in probs)
    _, priors = growth_hint(Candidates(merged, sources, merged=merged, merged_sources=sources), None)
    assert priors == pytest.approx(CostModel().node_probs(merged, sources=sources))


@pytest.mark.parametrize("chains", [False, True])
def test_the_actor_tells_growth_the_lookup_chains(models, chains):
    """Through the session actor (prompt lookup on, growth on): with SPECSPLIT_GROW_CHAINS the
    GrowRequests of rounds whose tree holds lookup nodes carry it, rooted at the round's root;
    without, none does. The output is the target's greedy decoding either way."""
    from tests.test_actor import run_actor

    target, often, _ = models["qwen2"]
    phrase = [3, 14, 15, 92, 65, 35, 89, 79]
    prompt, n = phrase * 3 + phrase[:3], 30
    want = greedy_reference(target, prompt, n)[0]
    done, grows = run_actor(often, target, prompt, n, grow=True, grow_fraction=4.0, lookup_max_tokens=8,
                            lookup_min_ngram=1, grow_chains=chains)  # chains after any recurring token
    assert done.token_ids == want
    told = [g for g in grows if g.tree is not None]
    if not chains:
        assert grows and not told
        return
    assert told
    for g in told:
        assert len(g.node_probs) == g.tree.num_nodes and g.node_probs[0] == 1.0
