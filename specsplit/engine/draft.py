"""Draft engine: keeps its own KV cache per session and builds a token tree within a budget.

One forward per step over a few nodes with the tree mask (EAGLE-2 style); a forwarded node gets
its ``branch`` children, scored by cumulative draft log-prob.
- temperature 0 (best-first): each step forwards the ``branch`` most probable unexpanded nodes of
  the whole tree, until the ``max_nodes - 1`` best nodes are settled (no unexpanded node could
  enter them), ``max_depth`` steps were taken, or the best candidate path's probability falls
  below ``min_path_prob``; the best nodes are returned (a parent always outranks its children).
  Deterministic. The tree and its cache entries are KEPT: a GrowRequest expands it further while
  the target verifies, and the next DraftRequest whose accepted tokens + bonus token form a path
  of the kept tree re-roots it at the bonus node (the cache keeps that path and the bonus node's
  expanded subtree, compacted after the prefix) instead of drafting from scratch.
- temperature > 0 (level by level): children are drawn i.i.d. from the draft's processed
  distribution q, which the tree carries; the ``branch`` best new nodes are the next level's
  frontier; no child is ever dropped because of its value (only whole groups, or a group's tail in
  draw order when the node budget runs out), so the verifier's rule stays lossless. The cache is
  cropped back to the committed tokens (prefix + root) afterwards.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

import torch

from schemas import (
    DraftReply, DraftRequest, ErrorCode, FlatTree, GrowReply, GrowRequest, Message, SamplingSpec, TreeSpec,
)
from specsplit.engine import sampling as S
from specsplit.engine.base import Engine, EngineLimits, elapsed_ms
from specsplit.engine.kvcache import SessionKV
from specsplit.engine.tree import SpecError, check_token_ids, path_to


@dataclass
class _Pool:
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    logps: list[float] = field(default_factory=lambda: [0.0])
    scores: list[float] = field(default_factory=lambda: [0.0])
    dists: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)

    def add(self, parent: int, token: int, logp: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.logps.append(logp)
        self.scores.append(self.scores[parent] + logp)
        return len(self.tokens) - 1


def _first_of_token(pool: _Pool, nodes: list[int]) -> list[int]:
    """Nodes whose token no earlier sibling carries (siblings are drawn i.i.d. and may repeat)."""
    seen, out = set(), []
    for i in nodes:
        key = (pool.parents[i], pool.tokens[i])
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out


class _Grown:
    """A greedy draft tree kept between requests. Node 0 is the newest committed token, at cache
    index ``prefix_len - 1``; an expanded node has a cache ``slot`` (>= prefix_len; -1 until it is
    forwarded) and its top-``branch`` children in the tree. Scores are cumulative log-probs."""

    def __init__(self, root: int, root_logits: torch.Tensor | None, branch: int, prefix_len: int):
        self.branch, self.prefix_len = branch, prefix_len
        self.tokens, self.parents, self.logps, self.scores, self.depths = [root], [-1], [0.0], [0.0], [0]
        self.kids: list[list[int]] = [[]]
        self.slot = [prefix_len - 1]
        self.round, self.max_depth, self.forward_ms = -1, 0, 0.0
        if root_logits is not None:
            self.add_children(0, root_logits)

    def add_children(self, node: int, logits: torch.Tensor) -> None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logp, min(self.branch, logp.shape[-1]))
        for tok, lp in zip(top.indices.tolist(), top.values.tolist()):
            i = len(self.tokens)
            self.tokens.append(tok)
            self.parents.append(node)
            self.logps.append(lp)
            self.scores.append(self.scores[node] + lp)
            self.depths.append(self.depths[node] + 1)
            self.kids.append([])
            self.slot.append(-1)
            self.kids[node].append(i)

    def candidates(self, max_depth: int, min_logp: float) -> list[int]:
        """Unexpanded nodes whose children would still be within ``max_depth``."""
        return [i for i in range(1, len(self.tokens))
                if self.slot[i] < 0 and self.depths[i] < max_depth and self.scores[i] >= min_logp]

    def settled(self, keep: int, max_depth: int, cands: list[int]) -> bool:
        """True when no descendant of a candidate can enter the best ``keep`` nodes (a child's
        score never exceeds its parent's), so further steps cannot change the result."""
        scores = [self.scores[i] for i in range(1, len(self.tokens)) if self.depths[i] <= max_depth]
        if len(scores) < keep:
            return False
        return heapq.nlargest(keep, scores)[-1] >= max(self.scores[c] for c in cands)

    def subtree(self, node: int) -> list[int]:
        inside, out = {node}, [node]
        for i in range(node + 1, len(self.tokens)):
            if self.parents[i] in inside:
                inside.add(i)
                out.append(i)
        return out

    def rerooted(self, sub: list[int], prefix_len: int, where: dict[int, int]) -> _Grown:
        """The subtree ``sub`` (node indices, ``sub[0]`` the new root) with its cache slots moved
        per ``where`` (old slot -> new slot)."""
        g = _Grown(self.tokens[sub[0]], None, self.branch, prefix_len)
        index = {old: new for new, old in enumerate(sub)}
        b = sub[0]
        for old in sub[1:]:
            g.tokens.append(self.tokens[old])
            g.parents.append(index[self.parents[old]])
            g.logps.append(self.logps[old])
            g.scores.append(self.scores[old] - self.scores[b])
            g.depths.append(self.depths[old] - self.depths[b])
            g.kids.append([])
            g.slot.append(where[self.slot[old]] if self.slot[old] >= 0 else -1)
            g.kids[g.parents[-1]].append(len(g.tokens) - 1)
        g.max_depth, g.forward_ms = self.max_depth, self.forward_ms
        return g

    def flat(self, keep: int, max_depth: int) -> FlatTree:
        eligible = [i for i in range(1, len(self.tokens)) if self.depths[i] <= max_depth]
        best = sorted(eligible, key=lambda i: (-self.scores[i], i))[: max(keep, 0)]
        chosen = [0, *sorted(best)]
        index = {old: new for new, old in enumerate(chosen)}
        if any(self.parents[i] not in index for i in chosen[1:]):
            raise SpecError(ErrorCode.INTERNAL, "tree selection lost a parent")
        return FlatTree(
            token_ids=[self.tokens[i] for i in chosen],
            parents=[-1] + [index[self.parents[i]] for i in chosen[1:]],
            draft_logprobs=[self.logps[i] for i in chosen],
        )


class DraftEngine(Engine):
    role = "draft"

    def __init__(self, model, limits: EngineLimits = EngineLimits(), *, vocab_size=None, max_support: int = 64,
                 steps_after_reuse: int | None = None):
        super().__init__(model, limits, vocab_size=vocab_size)
        self.max_support = max_support
        self.steps_after_reuse = steps_after_reuse
        self.max_kept_nodes = 4 * limits.max_tree_nodes  # a grown tree's size cap
        # set by the worker loop: True when other requests wait (growing yields to them)
        self.others_waiting = lambda: False

    @staticmethod
    def committed_len(session) -> int:
        g = session.draft_tree
        return g.prefix_len if isinstance(g, _Grown) else session.kv.length

    def _dispatch(self, msg: Message) -> Message:
        if isinstance(msg, DraftRequest):
            return self.draft(msg)
        if isinstance(msg, GrowRequest):
            return self.grow(msg)
        return super()._dispatch(msg)

    def draft(self, req: DraftRequest) -> DraftReply:
        t0 = time.perf_counter()
        check_token_ids([req.root], self.vocab_size, what="root token")
        spec = TreeSpec(
            max_nodes=min(req.tree.max_nodes, self.limits.max_tree_nodes),
            max_depth=min(req.tree.max_depth, self.limits.max_tree_depth),
            branch=req.tree.branch,
            min_path_prob=req.tree.min_path_prob,
        )
        sync = req.sync
        session = self.open_session(req.session_id, req.round, sync, 1 + spec.branch * spec.max_depth)
        with session.lock:
            self.check_locked(session, req.round, sync)

            def run() -> tuple[FlatTree, int]:
                kv = session.kv
                kept, session.draft_tree = session.draft_tree, None
                if req.sampling.greedy:
                    grown = self._reroot(kv, kept, sync, req.root) if kept is not None else None
                    reused = len(grown.tokens) - 1 if grown is not None else 0
                    if grown is None:
                        grown = _Grown(req.root, self._root_forward(kv, sync, req.root), spec.branch, kv.length)
                    grown.round, grown.branch = req.round, spec.branch
                    steps = spec.max_depth
                    if reused and self.steps_after_reuse is not None:
                        steps = min(steps, self.steps_after_reuse)
                    tree = self._best_first(kv, grown, spec, steps)
                    session.draft_tree = grown
                    session.last_round = req.round
                    return tree, reused
                root_logits = self._root_forward(kv, sync, req.root)
                committed = kv.length
                try:
                    return self._build(kv, req.root, root_logits, spec, req.sampling, req.round), 0
                finally:
                    kv.crop_to(committed)
                    session.last_round = req.round

            tree, reused = self.guarded(session, run)
        return DraftReply(session_id=req.session_id, round=req.round, tree=tree, draft_ms=elapsed_ms(t0),
                          reused_nodes=reused)

    def _root_forward(self, kv: SessionKV, sync, root: int) -> torch.Tensor:
        """Crop to the synced prefix and forward [append tokens + root]; the root's logits [V]."""
        kv.crop_to(sync.base_len)
        tokens = [*sync.append_token_ids, root]
        t = len(tokens)
        visible = torch.ones(t, sync.base_len + t, dtype=torch.bool)
        visible[:, sync.base_len :] = torch.ones(t, t, dtype=torch.bool).tril()
        pos = torch.arange(sync.base_len, sync.base_len + t, dtype=torch.long)
        return self.forward(kv, tokens, pos, visible, keep=1)[0]

    # ---- greedy: best-first, kept between requests -------------------------------------
    def _best_first(self, kv: SessionKV, g: _Grown, spec: TreeSpec, steps: int) -> FlatTree:
        keep = spec.max_nodes - 1
        min_logp = math.log(spec.min_path_prob) if spec.min_path_prob > 0 else -math.inf
        g.max_depth = spec.max_depth
        for _ in range(steps):
            if keep <= 0:
                break
            cands = g.candidates(spec.max_depth, min_logp)
            if not cands or g.settled(keep, spec.max_depth, cands):
                break
            front = heapq.nlargest(spec.branch, cands, key=lambda i: (g.scores[i], -i))
            if kv.room() < len(front):
                break
            self._expand(kv, g, front)
        return g.flat(keep, spec.max_depth)

    def _expand(self, kv: SessionKV, g: _Grown, nodes: list[int]) -> None:
        """One forward of ``nodes`` (unexpanded, parents expanded); each gets its top children."""
        base, t0 = kv.length, time.perf_counter()
        rows = self._forward_nodes(kv, nodes, g.tokens, g.parents, g.slot, g.prefix_len,
                                   [g.prefix_len - 1 + g.depths[n] for n in nodes])  # [F, V]
        g.forward_ms = elapsed_ms(t0)
        for j, node in enumerate(nodes):
            g.slot[node] = base + j
            g.add_children(node, rows[j])

    def _reroot(self, kv: SessionKV, g: _Grown, sync, root: int) -> _Grown | None:
        """The kept tree re-rooted at the new root when [append tokens + root] is one of its paths
        from the old root and the new root was expanded; compacts the cache. None otherwise."""
        if g.prefix_len != sync.base_len or kv.length < g.prefix_len:
            return None
        path, node = [], 0
        for tok in [*sync.append_token_ids, root]:
            node = next((c for c in g.kids[node] if g.tokens[c] == tok), -1)
            if node < 0:
                return None
            path.append(node)
        b = path[-1]
        if g.slot[b] < 0:
            return None
        sub = g.subtree(b)
        expanded = [n for n in sub[1:] if g.slot[n] >= 0]
        src = [g.slot[n] for n in path] + sorted(g.slot[n] for n in expanded)
        kv.compact(src, g.prefix_len)
        new_prefix = g.prefix_len + len(path)
        where = {g.slot[n]: new_prefix + k for k, n in enumerate(sorted(expanded, key=lambda n: g.slot[n]))}
        return g.rerooted(sub, new_prefix, where)

    def grow(self, req: GrowRequest) -> GrowReply:
        """Expand the kept tree of round ``req.round``, most probable unexpanded nodes first,
        ``width`` per forward, while the budget lasts and no other request waits."""
        t0 = time.perf_counter()
        session = self.store.get(req.session_id)
        grown = 0
        if session is not None:
            with session.lock:
                g = session.draft_tree
                if isinstance(g, _Grown) and g.round == req.round:
                    grown = self.guarded(session, lambda: self._grow(session.kv, g, req, t0))
        return GrowReply(session_id=req.session_id, round=req.round, grown_nodes=grown, grow_ms=elapsed_ms(t0))

    def _grow(self, kv: SessionKV, g: _Grown, req: GrowRequest, t0: float) -> int:
        depth_limit = 2 * max(1, g.max_depth)
        n0 = len(g.tokens)
        while not self.others_waiting():
            if elapsed_ms(t0) + (g.forward_ms or 0.0) > req.budget_ms:
                break
            if len(g.tokens) + req.width * g.branch > self.max_kept_nodes:
                break
            cands = g.candidates(depth_limit, -math.inf)
            if not cands:
                break
            front = heapq.nlargest(req.width, cands, key=lambda i: (g.scores[i], -i))
            if kv.room() < len(front):
                break
            self._expand(kv, g, front)
        return len(g.tokens) - n0

    # ---- sampled: level by level, cache cropped afterwards -----------------------------
    def _build(
        self, kv: SessionKV, root: int, root_logits: torch.Tensor, spec: TreeSpec, sampling: SamplingSpec, round: int
    ) -> FlatTree:
        pool = _Pool(tokens=[root])
        pool.slots[0] = kv.length - 1
        prefix_len = kv.length
        g = S.make_generator(sampling.seed, round, "draft")
        frontier, rows = [0], root_logits[None]  # [F], [F, V]
        min_logp = math.log(spec.min_path_prob) if spec.min_path_prob > 0 else -math.inf
        for depth in range(1, spec.max_depth + 1):
            if spec.max_nodes <= 1 or not frontier:
                break
            new = self._expand_sampled(pool, frontier, rows, spec, sampling, g)
            if depth == spec.max_depth or not new or len(pool.tokens) >= spec.max_nodes:
                break
            # a repeat of an earlier sibling's token is reached only if that one was rejected,
            # and then it is rejected too: don't grow it
            new = _first_of_token(pool, new)
            frontier = heapq.nlargest(spec.branch, new, key=lambda i: (pool.scores[i], -i))
            frontier = [n for n in frontier if pool.scores[n] >= min_logp]  # paths unlikely to be accepted
            if not frontier:  # are not worth a forward
                break
            rows = self._forward_frontier(kv, pool, frontier, prefix_len, depth)
        return self._flat(pool)

    def _expand_sampled(self, pool, frontier, rows, spec: TreeSpec, sampling: SamplingSpec, g) -> list[int]:
        q = S.probs_from_logits(rows, sampling, self.max_support)  # [F, V] float64
        new = []
        for j, f in enumerate(frontier):
            room = spec.max_nodes - len(pool.tokens)
            if room <= 0:
                break
            draws = S.sample_from(q[j], g, spec.branch)[:room]  # a prefix in draw order
            pool.dists[f] = S.sparse(q[j])
            qj = q[j]
            new.extend(pool.add(f, tok, float(torch.log(qj[tok]))) for tok in draws)
        return new

    def _forward_frontier(self, kv: SessionKV, pool: _Pool, frontier: list[int], prefix_len: int, depth: int):
        base = kv.length
        rows = self._forward_nodes(kv, frontier, pool.tokens, pool.parents, pool.slots, prefix_len,
                                   [prefix_len - 1 + depth] * len(frontier))
        for j, node in enumerate(frontier):
            pool.slots[node] = base + j
        return rows

    def _forward_nodes(self, kv: SessionKV, nodes, tokens, parents, slot, prefix_len: int, positions) -> torch.Tensor:
        """One forward of tree ``nodes`` appended to the cache: each sees the committed prefix, its
        ancestors' cache ``slot`` (the root is the prefix's last entry) and itself. [F, V] logits."""
        f, base = len(nodes), kv.length
        visible = torch.zeros(f, base + f, dtype=torch.bool)
        visible[:, :prefix_len] = True
        for j, node in enumerate(nodes):
            for a in path_to(node, parents)[1:-1]:
                visible[j, slot[a]] = True
            visible[j, base + j] = True
        pos = torch.tensor(positions, dtype=torch.long)
        return self.forward(kv, [tokens[n] for n in nodes], pos, visible, keep=f)

    @staticmethod
    def _flat(pool: _Pool) -> FlatTree:
        n = len(pool.tokens)
        has_child = set(pool.parents[1:])
        return FlatTree(
            token_ids=list(pool.tokens),
            parents=list(pool.parents),
            draft_logprobs=list(pool.logps),
            child_dist_ids=[list(pool.dists[i][0]) if i in has_child else [] for i in range(n)] if pool.dists else [],
            child_dist_probs=[list(pool.dists[i][1]) if i in has_child else [] for i in range(n)] if pool.dists else [],
        )
