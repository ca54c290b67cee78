"""The llama.cpp draft engine (``specsplit.engine.llamacpp_draft``) on the real SmolLM2 GGUF of
``test_llamacpp_engine``: kept trees re-rooted and freed; sessions drafted together in one decode
per step build the trees their own contexts give, within their share of the sequences.
"""

from __future__ import annotations

import numpy as np
import pytest

from schemas import CacheSync, DraftReply, DraftRequest, EndSession, ErrorReply, SamplingSpec, TreeSpec
from specsplit.engine.base import EngineLimits
from specsplit.tree import path_to

pytest.importorskip("llama_cpp", reason="llama-cpp-python is the gguf extra: ./ops/setup.sh gguf")

from specsplit.engine.llamacpp import LlamaDraftEngine  # noqa: E402
from tests.test_llamacpp_engine import PROMPT, _near_tie, _paths_logits, gguf, lm, lm_draft  # noqa: E402,F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_draft_kept_tree_survives_and_frees(lm_draft):
    """A greedy draft keeps its tree (sequences per forwarded node) and re-roots it; ending the
    session frees every sequence."""
    eng = LlamaDraftEngine(lm_draft, EngineLimits(max_sessions=4, max_session_tokens=512, max_tree_nodes=16))
    free0 = len(eng.pool)
    spec = TreeSpec(max_nodes=8, max_depth=4, branch=2)
    r0 = eng.handle(DraftRequest(session_id="s", round=0, sync=CacheSync(base_len=0, append_token_ids=PROMPT[:-1]),
                                 root=PROMPT[-1], tree=spec, sampling=SamplingSpec()))
    assert not isinstance(r0, ErrorReply) and len(r0.tree.token_ids) > 1
    assert len(eng.pool) < free0 - 1  # the main sequence and the forwarded nodes'
    # the first child's path accepted: the next request re-roots the kept tree
    child = r0.tree.parents.index(0)
    first = r0.tree.token_ids[child]
    nxt = next((i for i, p in enumerate(r0.tree.parents) if p == child), None)
    root = r0.tree.token_ids[nxt] if nxt is not None else 7
    r1 = eng.handle(DraftRequest(session_id="s", round=1,
                                 sync=CacheSync(base_len=len(PROMPT), append_token_ids=[first]),
                                 root=root, tree=spec, sampling=SamplingSpec()))
    assert not isinstance(r1, ErrorReply)
    if nxt is not None:
        assert r1.reused_nodes > 0
    eng.handle(EndSession(session_id="s"))
    assert len(eng.pool) == free0
    with lm_draft.lock:
        assert all(lm_draft.seq_pos_max(s) == -1 for s in range(lm_draft.n_seq))


def test_batched_drafts_build_each_sessions_own_tree(lm, lm_draft):
    """Greedy DraftRequests of four sessions (different prompts and lengths) drafted in lockstep,
    each step's node forwards of all of them in one decode, round after round with kept trees
    re-rooted: under every expanded node the tree holds the model's greedy token after that
    node's own path (a forward of the path alone; skipped where its two best logits nearly tie),
    which fails if a node attended to another session's cells; most trees are the ones drafting
    each alone builds; every sequence comes back."""
    spec = TreeSpec(max_nodes=8, max_depth=4, branch=2)
    prompts = [PROMPT, (PROMPT * 3)[:45], list(range(300, 340)), PROMPT[:5]]
    limits = EngineLimits(max_sessions=8, max_session_tokens=512, max_tree_nodes=16)
    alone, batched = LlamaDraftEngine(lm, limits), LlamaDraftEngine(lm_draft, limits)
    free0 = len(batched.pool)
    fused, real = [], batched.forward_segments
    batched.forward_segments = lambda segs: (fused.append(len(segs)), real(segs))[1]
    state = {i: ([], p[:-1], p[-1]) for i, p in enumerate(prompts)}  # committed, append, root
    trees, identical, reused = [], 0, 0
    for rnd in range(4):
        reqs = [DraftRequest(session_id=f"s{i}", round=rnd, sync=CacheSync(base_len=len(c), append_token_ids=a),
                             root=r, tree=spec, sampling=SamplingSpec()) for i, (c, a, r) in state.items()]
        want = [alone.handle(r) for r in reqs]
        got = batched.draft_batch(reqs)
        for (i, (c, a, r)), w, g in zip(list(state.items()), want, got):
            assert isinstance(w, DraftReply) and isinstance(g, DraftReply), (w, g)
            identical += (w.tree.token_ids, w.tree.parents) == (g.tree.token_ids, g.tree.parents)
            reused += g.reused_nodes > 0
            trees.append(([*c, *a], g.tree))
            # the tree's first path is accepted: its first token joins the prefix, the next is the root
            t = g.tree
            child = t.parents.index(0)
            nxt = next((k for k, q in enumerate(t.parents) if q == child), None)
            state[i] = ([*c, *a, r], [t.token_ids[child]], t.token_ids[nxt] if nxt is not None else 7)
    assert max(fused) == 4 and len(fused) >= 8  # node forwards of all four sessions shared decodes
    assert identical >= 8 and reused >= 4, (identical, reused)
    for i in range(len(prompts)):
        for eng in (alone, batched):
            eng.handle(EndSession(session_id=f"s{i}"))
    assert len(batched.pool) == free0
    with lm_draft.lock:
        assert all(lm_draft.seq_pos_max(s) == -1 for s in range(lm_draft.n_seq))
    expanded = []  # (context, path root->node, the node's children's tokens)
    for ctx, t in trees:
        for node in range(len(t.token_ids)):
            children = {t.token_ids[k] for k, q in enumerate(t.parents) if q == node}
            if children:
                expanded.append((ctx, [t.token_ids[k] for k in path_to(node, t.parents)], children))
    checked = 0
    for (ctx, path, children), ref in zip(expanded, _paths_logits(lm, [(c, p) for c, p, _ in expanded])):
        if not _near_tie(ref[None]):
            assert int(np.argmax(ref)) in children, (ctx[-3:], path)
            checked += 1
    assert checked >= 30


def test_sessions_drafting_together_share_the_sequences(lm_draft):
    """Twelve sessions drafting 16-node trees in lockstep on a 64-sequence context: alone, each
    could take every free sequence (others' kept trees given up), together they would need ~180;
    each takes its share, so all get trees (none OVERLOADED), and every sequence comes back."""
    spec = TreeSpec(max_nodes=16, max_depth=6, branch=2)
    eng = LlamaDraftEngine(lm_draft, EngineLimits(max_sessions=16, max_session_tokens=512, max_tree_nodes=16))
    free0 = len(eng.pool)
    reqs = [DraftRequest(session_id=f"s{i}", round=0, sync=CacheSync(base_len=0, append_token_ids=PROMPT[:4 + i]),
                         root=PROMPT[(4 + i) % len(PROMPT)], tree=spec, sampling=SamplingSpec()) for i in range(12)]
    got = eng.draft_batch(reqs)
    assert all(isinstance(g, DraftReply) for g in got), [g for g in got if not isinstance(g, DraftReply)][:2]
    assert all(len(g.tree.token_ids) > 1 for g in got)
    assert eng.sharing == 1
    for r in reqs:
        eng.handle(EndSession(session_id=r.session_id))
    assert len(eng.pool) == free0
    with lm_draft.lock:
        assert all(lm_draft.seq_pos_max(s) == -1 for s in range(lm_draft.n_seq))


def test_a_hinted_chain_grows_level_by_level_and_is_rerooted_at(lm_draft):
    """A GrowRequest's chain on the llama.cpp draft: a node's sequence copies its parent's
    cells, so growth forwards the chain a level per forward (never a node with its parent in the
    same forward); a request whose accepted tokens run along it re-roots at a forwarded child of
    its end; ending the session frees every sequence."""
    from schemas import FlatTree, GrowRequest

    eng = LlamaDraftEngine(lm_draft, EngineLimits(max_sessions=4, max_session_tokens=512, max_tree_nodes=16))
    free0 = len(eng.pool)
    spec = TreeSpec(max_nodes=4, max_depth=3, branch=2)
    eng.handle(DraftRequest(session_id="h", round=0, sync=CacheSync(base_len=0, append_token_ids=PROMPT[:-1]),
                            root=PROMPT[-1], tree=spec, sampling=SamplingSpec()))
    g = eng.store.get("h").draft_tree
    first = next(t for t in range(1000, 2000) if t not in {g.tokens[c] for c in g.kids[0]})
    chain = [first, 2100, 2200]
    hint = FlatTree(token_ids=[g.tokens[0], *chain], parents=[-1, 0, 1, 2])
    forwards, real = [], eng.forward_one

    def forward_one(seg):
        forwards.append(list(seg.nodes))
        return real(seg)

    eng.forward_one = forward_one
    eng.others_waiting = lambda: len(forwards) >= 5
    eng.handle(GrowRequest(session_id="h", round=0, budget_ms=60_000.0, width=4, tree=hint,
                           node_probs=[1.0, 0.9, 0.8, 0.7]))
    for nodes in forwards:
        assert not set(nodes) & {g.parents[n] for n in nodes}
    path = g.child_path(chain)
    assert len(path) == 3 and all(g.slot[n] >= 0 for n in path)
    end_kids = [c for c in g.kids[path[-1]] if g.slot[c] >= 0]
    assert end_kids
    bonus = max(end_kids, key=lambda c: g.scores[c])
    r1 = eng.handle(DraftRequest(session_id="h", round=1, tree=spec, root=g.tokens[bonus], sampling=SamplingSpec(),
                                 sync=CacheSync(base_len=len(PROMPT), append_token_ids=chain)))
    assert isinstance(r1, DraftReply) and r1.reused_nodes > 0
    assert not eng.store.get("h").draft_tree.hinted
    eng.handle(EndSession(session_id="h"))
    assert len(eng.pool) == free0


def test_the_orchestrator_re_roots_a_grown_tree_as_the_llama_cpp_draft_does(lm_draft):
    """``specsplit.tree.reroot_grown`` of a GrowReply's tree is the llama.cpp draft's next reply
    too (its own re-rooting: sequences per node, the path joining the main sequence)."""
    from tests.test_reroot_local import against_the_draft

    eng = LlamaDraftEngine(lm_draft, EngineLimits(max_sessions=4, max_session_tokens=1024, max_tree_nodes=16),
                           steps_after_reuse=0, grow_spares=2)
    free0 = len(eng.pool)
    seen = against_the_draft(eng, rounds=8)
    assert seen["local"] >= 3 and seen["scratch"] >= 1, seen
    eng.handle(EndSession(session_id="g"))
    assert len(eng.pool) == free0
