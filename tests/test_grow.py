"""The greedy draft keeps its tree between requests, grows it while the target verifies and
re-roots it at the bonus token: the re-rooted cache must be exactly what a fresh forward gives,
and generation through it must still equal plain greedy decoding."""

from __future__ import annotations

import random

import pytest
import torch

from schemas import CacheSync, DraftReply, DraftRequest, GrowReply, GrowRequest, SamplingSpec, TreeSpec
from specsplit.local import RoundStats, generate
from specsplit.engine.draft import DraftEngine
from specsplit.engine.base import EngineLimits
from specsplit.tree import check_parents, path_to
from tests.conftest import FAMILIES, greedy_reference, tiny_model

LIMITS = EngineLimits(max_sessions=4, max_session_tokens=512, max_tree_nodes=16, max_tree_depth=6)
SPEC = TreeSpec(max_nodes=8, max_depth=4, branch=2)


@torch.no_grad()
def sequential_logprob(model, context: list[int], token: int) -> float:
    logits = model(torch.tensor([context])).logits[0, -1].float()
    return float(torch.log_softmax(logits, -1)[token])


def deepest_expanded(g) -> int:
    """The kept tree's deepest expanded node (other than the root) that has expanded children:
    an 'accepted path + bonus' whose expanded subtree re-rooting must carry over."""
    expanded = [i for i in range(1, len(g.tokens)) if g.slot[i] >= 0]
    with_expanded_kids = [i for i in expanded if any(g.slot[c] >= 0 for c in g.kids[i])]
    return max(with_expanded_kids or expanded, key=lambda i: (g.depths[i], g.scores[i]))


@pytest.mark.parametrize("family,steps_after_reuse,spares",
                         [(f, None, 0) for f in FAMILIES] + [("qwen2", 0, 0), ("llama", 1, 0), ("qwen2", 0, 3)])
def test_rerooted_tree_matches_sequential_forwards(family, steps_after_reuse, spares):
    model = tiny_model(family, seed=31)
    eng = DraftEngine(model, LIMITS, steps_after_reuse=steps_after_reuse, grow_spares=spares)
    rng = random.Random(7)
    committed = [rng.randrange(128) for _ in range(9)]
    req = DraftRequest(session_id="g", round=0, sync=CacheSync(base_len=0, append_token_ids=committed[:-1]),
                       root=committed[-1], tree=SPEC)
    reply = eng.handle(req)
    assert isinstance(reply, DraftReply) and reply.reused_nodes == 0
    held, hits = len(committed), 0
    for rnd in range(4):
        grown = eng.handle(GrowRequest(session_id="g", round=rnd, budget_ms=60_000.0, width=3))
        assert isinstance(grown, GrowReply) and grown.grown_nodes > 0
        g = eng.store.get("g").draft_tree
        node = deepest_expanded(g)
        new = [g.tokens[i] for i in path_to(node, g.parents)[1:]]  # accepted tokens + bonus
        committed = committed + new
        reply = eng.handle(DraftRequest(session_id="g", round=rnd + 1, root=committed[-1], tree=SPEC,
                                        sync=CacheSync(base_len=held, append_token_ids=committed[held:-1])))
        assert isinstance(reply, DraftReply), reply
        hits += reply.reused_nodes > 0
        kept = eng.store.get("g").draft_tree
        assert eng.store.get("g").kv.length == len(committed) + sum(s >= 0 for s in kept.slot[1:])
        if steps_after_reuse == 0 and reply.reused_nodes:  # nothing forwarded after re-rooting
            assert len(kept.tokens) == reply.reused_nodes + 1
        held = len(committed)
        tree = reply.tree
        check_parents(tree.parents, max_nodes=SPEC.max_nodes, max_depth=SPEC.max_depth)
        assert tree.token_ids[0] == committed[-1]
        for i in range(1, tree.num_nodes):  # every node's log-prob as a fresh full forward gives it
            ctx = committed + [tree.token_ids[a] for a in path_to(tree.parents[i], tree.parents)[1:]]
            want = sequential_logprob(model, ctx, tree.token_ids[i])
            assert abs(tree.draft_logprobs[i] - want) < 2e-4, (rnd, i, tree.draft_logprobs[i], want)
        assert eng.store.get("g").kv.length >= len(committed)
    assert hits == 4


def test_grow_is_harmless_when_it_cannot_apply():
    model = tiny_model("llama", seed=3)
    eng = DraftEngine(model, LIMITS)
    r = eng.handle(GrowRequest(session_id="nobody", round=0, budget_ms=100.0))
    assert isinstance(r, GrowReply) and r.grown_nodes == 0
    sampled = SamplingSpec(temperature=0.8, seed=1)
    eng.handle(DraftRequest(session_id="s", round=0, sync=CacheSync(base_len=0, append_token_ids=[1, 2, 3]), root=4,
                            tree=SPEC, sampling=sampled))
    length = eng.store.get("s").kv.length
    assert eng.handle(GrowRequest(session_id="s", round=0, budget_ms=1000.0)).grown_nodes == 0  # sampled: no kept tree
    assert eng.store.get("s").kv.length == length == 4
    eng.handle(DraftRequest(session_id="t", round=0, sync=CacheSync(base_len=0, append_token_ids=[1, 2, 3]), root=4,
                            tree=SPEC))
    assert eng.handle(GrowRequest(session_id="t", round=5, budget_ms=1000.0)).grown_nodes == 0  # not that round
    eng.others_waiting = lambda: True
    assert eng.handle(GrowRequest(session_id="t", round=0, budget_ms=1000.0)).grown_nodes == 0  # yields
    eng.others_waiting = lambda: False
    assert eng.handle(GrowRequest(session_id="t", round=0, budget_ms=60_000.0)).grown_nodes > 0
    # a sync that is not a path of the kept tree drafts from scratch, on the committed prefix
    miss = eng.handle(DraftRequest(session_id="t", round=1, sync=CacheSync(base_len=4, append_token_ids=[127, 126]),
                                   root=125, tree=SPEC))
    assert isinstance(miss, DraftReply) and miss.reused_nodes == 0
    assert eng.store.get("t").draft_tree.prefix_len == 7


@pytest.mark.parametrize("family,spares", [(f, 0) for f in FAMILIES] + [("llama", 4)])
def test_generate_with_growth_equals_plain_greedy(models, family, spares):
    target, often, _ = models[family]
    rng = random.Random(11)
    stats, compared = RoundStats(), 0
    for _ in range(6):
        prompt = [rng.randrange(128) for _ in range(rng.randrange(1, 25))]
        ref, gap = greedy_reference(target, prompt, 24)
        if gap < 1e-3:
            continue
        for tree in (TreeSpec(max_nodes=8, max_depth=4, branch=2), TreeSpec(max_nodes=6, max_depth=5, branch=1,
                                                                              min_path_prob=0.2)):
            out = generate(often, target, prompt, max_new_tokens=24, tree=tree, sampling=SamplingSpec(),
                           stats=stats, grow_budget_ms=60_000.0,
                           make_draft_engine=lambda m, limits: DraftEngine(m, limits, grow_spares=spares))
            assert out == ref, (family, prompt, tree)
        compared += 1
    assert compared >= 4
    assert stats.reused_rounds > stats.rounds // 4, (stats.reused_rounds, stats.rounds)


def test_spares_let_a_bonus_among_rejected_siblings_reuse_the_grown_tree():
    """With ``grow_spares``, growth may add a node's next most probable tokens past its
    ``branch`` children (where the bonus lands when the target rejects every verified child):
    such a sibling, once forwarded, is a root the next request re-roots at, its log-probs those of
    fresh forwards. Without spares no node gets more than ``branch`` children."""
    model = tiny_model("qwen2", seed=5)
    committed = [3, 17, 40, 41, 99, 7, 12]
    for spares in (0, 4):
        eng = DraftEngine(model, LIMITS, steps_after_reuse=0, grow_spares=spares)
        eng.handle(DraftRequest(session_id="s", round=0, tree=SPEC, root=committed[-1],
                                sync=CacheSync(base_len=0, append_token_ids=committed[:-1])))
        eng.handle(GrowRequest(session_id="s", round=0, budget_ms=60_000.0, width=4))
        g = eng.store.get("s").draft_tree
        wide = [i for i in range(len(g)) if len(g.kids[i]) > SPEC.branch]
        if not spares:
            assert not wide
            continue
        extra = [c for i in wide for c in g.kids[i][SPEC.branch:] if g.slot[c] >= 0]
        assert extra, "growth added and forwarded no spare sibling"
        node = max(extra, key=lambda c: g.scores[c])
        new = [g.tokens[i] for i in path_to(node, g.parents)[1:]]
        parent_scores = [g.logps[c] for c in g.kids[g.parents[node]]]
        assert parent_scores == sorted(parent_scores, reverse=True)  # siblings in the draft's order
        reply = eng.handle(DraftRequest(session_id="s", round=1, tree=SPEC, root=new[-1],
                                        sync=CacheSync(base_len=len(committed), append_token_ids=new[:-1])))
        assert reply.reused_nodes > 0
        ctx = committed + new
        for i in range(1, reply.tree.num_nodes):
            path = [reply.tree.token_ids[a] for a in path_to(reply.tree.parents[i], reply.tree.parents)[1:]]
            want = sequential_logprob(model, ctx + path, reply.tree.token_ids[i])
            assert abs(reply.tree.draft_logprobs[i] - want) < 2e-4

