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
