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

import math
import time
from collections.abc import Generator, Sequence
from typing import TypeVar

import numpy
import torch

from schemas import (
    MAX_TREE_DEPTH, MAX_TREE_NODES, DraftReply, DraftRequest, FlatTree, GrowReply, GrowRequest, Message, SamplingSpec,
    TreeSpec,
)
from specsplit.engine import penalties
from specsplit.engine import sampling as S
from specsplit.engine.base import LINEAR_CHUNK, Engine, EngineLimits, elapsed_ms
from specsplit.engine.batch import Segment, using_attention
from specsplit.engine.draft_batch import draft_batch
from specsplit.engine.draftview import WINDOW_KWARG, DraftWindow, window_attention_name
from specsplit.engine.kvcache import SessionKV
from specsplit.engine.store import Session
from specsplit.engine.masks import causal
from specsplit.engine.grammar import DraftGrammar
from specsplit.errors import SpecError, TreeError
from specsplit.tree import DraftTree, check_token_ids, path_to, validate_tree


T = TypeVar("T")
Forwards = Generator[Segment, torch.Tensor, T]  # yields the forwards it needs, is sent their logits [keep, V]


class DraftEngine(Engine):
    role = "draft"
    grow_spares = 0  # engines that build their own state (llama.cpp's) add no spares
    grammars = None  # a GrammarBook (set by the worker: it has the tokenizer); None: proposes unconstrained
    # a forward may hold a node with unforwarded ancestors when they are in it too (the mask
    # shows each node its ancestors' rows of the same forward): a hinted chain in one forward
    tree_forward = True

    def __init__(self, model, limits: EngineLimits = EngineLimits(), *, vocab_size=None, max_support: int = 64,
                 steps_after_reuse: int | None = None, backend=None, window: DraftWindow | None = DraftWindow(),
                 grow_spares: int = 0):
        super().__init__(model, limits, vocab_size=vocab_size, backend=backend)
        self.max_support = max_support
        self.steps_after_reuse = steps_after_reuse
        # long contexts: forwards attend to sinks + a recent window (specsplit.engine.draftview)
        self.window = window if window is not None and window.window_tokens > 0 else None
        self._window_attention = window_attention_name(model) if self.window else None
        self.max_kept_nodes = 4 * limits.max_tree_nodes  # a grown tree's size cap
        self.grow_spares = grow_spares  # tokens past a node's branch that growth may add as siblings
        # set by the worker loop: True when other requests wait (growing yields to them)
        self.others_waiting = lambda: False

    @staticmethod
    def committed_len(session) -> int:
        g = session.draft_tree
        return g.prefix_len if isinstance(g, DraftTree) else session.kv.length

    def _dispatch(self, msg: Message) -> Message:
        if isinstance(msg, DraftRequest):
            return self.draft(msg)
        if isinstance(msg, GrowRequest):
            return self.grow(msg)
        return super()._dispatch(msg)

    def draft(self, req: DraftRequest) -> DraftReply:
        t0 = time.perf_counter()
        session, spec = self.admit(req)
        with session.lock:
            self.check_locked(session, req.round, req.sync)
            tree, reused = self.guarded(session, lambda: self.drive(self.draft_steps(session, req, spec)))
        return self.reply_for(req, tree, reused, t0)

    def admit(self, req: DraftRequest) -> tuple[Session, TreeSpec]:
        """The checks that need no session lock; finds or creates the session. Raises SpecError."""
        check_token_ids([req.root], self.vocab_size, what="root token")
        spec = TreeSpec(
            max_nodes=min(req.tree.max_nodes, self.limits.max_tree_nodes),
            max_depth=min(req.tree.max_depth, self.limits.max_tree_depth),
            branch=req.tree.branch,
            min_path_prob=req.tree.min_path_prob,
        )
        return self.open_session(req.session_id, req.round, req.sync, 1 + spec.branch * spec.max_depth), spec

    def reply_for(self, req: DraftRequest, tree: FlatTree, reused: int, t0: float,
                  draft_ms: float | None = None) -> DraftReply:
        """The reply; ``draft_ms`` measured already (a lockstep batch's), else since ``t0`` once
        the device is done."""
        return DraftReply(session_id=req.session_id, round=req.round, tree=tree, reused_nodes=reused,
                          draft_ms=self.elapsed_ms(t0) if draft_ms is None else draft_ms)

    def drive(self, steps: Forwards[T]) -> T:
        """Run a generator of forwards alone: each Segment it yields is forwarded on its own."""
        try:
            seg = next(steps)
            while True:
                seg = steps.send(self.forward_one(seg))
        except StopIteration as done:
            return done.value

    def draft_steps(self, session: Session, req: DraftRequest, spec: TreeSpec) -> Forwards[tuple[FlatTree, int]]:
        """One DraftRequest (checks passed, session locked) as a generator: it yields each forward
        it needs as a Segment and is sent that forward's logits [keep, V]; returns (tree, reused).
        ``drive`` runs it alone, ``draft_batch`` in lockstep with other sessions'."""
        kv, sync = session.kv, self.take_prefix(session, req.sync, req.root)
        kept, session.draft_tree = session.draft_tree, None
        if sync is not req.sync:  # a cached prefix replaced the cache: nothing kept stands
            kept = None
        process = penalties.for_draft(req.sampling, session.tokens, req.sync.base_len + len(req.sync.append_token_ids) + 1,
                                      req.sync.prompt_len, self._grammar(session, req))
        if req.sampling.greedy:
            grown = self._reroot(kv, kept, sync, req.root) if kept is not None else None
            reused = len(grown.tokens) - 1 if grown is not None else 0
            if grown is None:
                root_logits = yield from self._root_forward(kv, sync, req.root)
                if not req.sync.base_len:  # a context forwarded: kept at once (Engine.keep_prefix)
                    self.keep_prefix(session, held=True)
                grown = DraftTree(req.root, kv.length, spec.branch)
                grown.process = process
                self._add_top_children(grown, [0], root_logits[None])
            grown.round, grown.branch, grown.process = req.round, spec.branch, process
            steps = spec.max_depth
            if reused and self.steps_after_reuse is not None:
                steps = min(steps, self.steps_after_reuse)
            tree = yield from self._best_first(kv, grown, spec, steps)
            session.draft_tree = grown
            session.last_round = req.round
            return tree, reused
        root_logits = yield from self._root_forward(kv, sync, req.root)
        if not req.sync.base_len:
            self.keep_prefix(session, held=True)
        committed = kv.length
        try:
            return (yield from self._build(kv, req.root, root_logits, spec, req.sampling, req.round, process)), 0
        finally:
            kv.crop_to(committed)
            session.last_round = req.round

    def _grammar(self, session: Session, req: DraftRequest) -> DraftGrammar | None:
        """The request's grammar on this draft's rows (its matcher after the round's root); None
        where it has none, this draft cannot apply it (no tokenizer for grammars, the prompt not
        named) or the session's output is not known to it: proposing unconstrained costs only
        acceptance, the target holds the answer to the grammar."""
        if req.grammar is None or self.grammars is None or req.sync.prompt_len < 1:
            return None
        try:
            return DraftGrammar(self.grammars, session, self.grammars.at(session, req.grammar, req.sync, req.root))
        except SpecError:
            return None

    def forward(self, kv: SessionKV, token_ids: list[int], position_ids: torch.Tensor, visible: torch.Tensor,
                keep: int, **model_kwargs) -> torch.Tensor:
        """``Engine.forward``; past the window's reach, attending to sinks + the recent window
        only (a batched forward, ``forward_segments``, always attends to the whole cache). On
        CUDA graphs the window is not applied: it bounds what attention costs where that grows
        with the context (a CPU), while a windowed forward fits no graph and would run eagerly,
        several times a replay over the whole cache on the H200 (docs/results.md, GPU)."""
        bounds = self.window.bounds(kv.length) if self._window_attention and self.graphs is None else None
        if bounds is None:
            return super().forward(kv, token_ids, position_ids, visible, keep, **model_kwargs)
        with using_attention(self.model, self._window_attention):
            return super().forward(kv, token_ids, position_ids, visible, keep, **{WINDOW_KWARG: bounds}, **model_kwargs)

    def draft_batch(self, requests: Sequence[Message]) -> list[Message]:
        """Replies to ``requests`` in order; the sessions that allow it draft in lockstep, one
        forward per step for all of them (``specsplit.engine.draft_batch``)."""
        return draft_batch(self, requests)

    def _root_forward(self, kv: SessionKV, sync, root: int) -> Forwards[torch.Tensor]:
        """Crop to the synced prefix and forward [append tokens + root]; the root's logits [V]."""
        kv.crop_to(sync.base_len)
        tokens = [*sync.append_token_ids, root]
        t = len(tokens)
        if t > LINEAR_CHUNK:  # a long prompt: chunked, so its masks stay small (never batched)
            return self.forward_linear(kv, tokens, LINEAR_CHUNK)
        pos = torch.arange(sync.base_len, sync.base_len + t, dtype=torch.long, device=self.device)
        return (yield Segment(kv, tokens, pos, causal(t, sync.base_len, self.device), keep=1))[0]

    @staticmethod
    def _processed(g: DraftTree, nodes: list[int], rows: torch.Tensor) -> torch.Tensor:
        """``nodes``' logits rows [F, V] with the request's bias and penalties, after each node's
        path (``g.process``; the rows themselves when it has none)."""
        if g.process is None:
            return rows
        return g.process.rows(rows, [[g.tokens[a] for a in path_to(n, g.parents)[1:]] for n in nodes])

    def _add_top_children(self, g: DraftTree, nodes: list[int], rows: torch.Tensor) -> None:
        """Each of ``nodes`` gets its ``g.branch`` most probable children from its logits row
        (rows [F, V], processed as the request asks), and its next ``grow_spares`` tokens as
        spares growth may add; one host copy for all of them."""
        logp = torch.log_softmax(self._processed(g, nodes, rows).float(), dim=-1)  # [F, V]
        top = torch.topk(logp, min(g.branch + self.grow_spares, logp.shape[-1]), dim=-1)  # [F, B + S]
        ids, lps = top.indices.tolist(), top.values.tolist()
        for node, tok_row, lp_row in zip(nodes, ids, lps):
            have = {g.tokens[c] for c in g.kids[node]}  # a hinted node's hinted child stands for its token
            pairs = list(zip(tok_row, lp_row))
            for tok, lp in pairs[: g.branch]:
                if tok not in have:
                    g.add(node, tok, lp)
            if len(pairs) > g.branch:
                g.spares[node] = [(tok, lp) for tok, lp in pairs[g.branch:] if tok not in have]

    # ---- greedy: best-first, kept between requests -------------------------------------
    def _best_first(self, kv: SessionKV, g: DraftTree, spec: TreeSpec, steps: int) -> Forwards[FlatTree]:
        keep = spec.max_nodes - 1
        min_logp = math.log(spec.min_path_prob) if spec.min_path_prob > 0 else -math.inf
        g.max_depth = spec.max_depth
        for _ in range(steps):
            if keep <= 0:
                break
            cands = g.candidates(spec.max_depth, min_logp)
            if not cands or g.settled(keep, spec.max_depth, cands):
                break
            front = g.best(spec.branch, cands)
            if kv.room() < len(front):
                break
            yield from self._expand(kv, g, front)
        return g.best_flat(keep, spec.max_depth)

    def _expand(self, kv: SessionKV, g: DraftTree, nodes: list[int]) -> Forwards[None]:
        """One forward of ``nodes`` (unforwarded, parents forwarded); each gets its top children."""
        base, t0 = kv.length, time.perf_counter()
        rows = yield self._nodes_segment(kv, g, nodes, [g.prefix_len - 1 + g.depths[n] for n in nodes])  # [F, V]
        for j, node in enumerate(nodes):
            g.slot[node] = base + j
        self._add_top_children(g, nodes, rows)
        g.forward_ms = self.steady_ms(t0)  # after the host copy: the device has finished

    def _reroot(self, kv: SessionKV, g: DraftTree, sync, root: int) -> DraftTree | None:
        """The kept tree re-rooted at the new root when [append tokens + root] is one of its paths
        from the old root and the new root was forwarded; compacts the cache. None otherwise."""
        if g.prefix_len != sync.base_len or kv.length < g.prefix_len:
            return None
        path = g.reroot_path([*sync.append_token_ids, root])
        if not path:
            return None
        b = path[-1]
        expanded = sorted((n for n in g.kept_subtree(b)[1:] if g.slot[n] >= 0), key=lambda n: g.slot[n])
        kv.compact([g.slot[n] for n in path] + [g.slot[n] for n in expanded], g.prefix_len)
        new_prefix = g.prefix_len + len(path)
        where = {g.slot[n]: new_prefix + k for k, n in enumerate(expanded)}
        return g.rerooted(b, new_prefix, where)

    def grow(self, req: GrowRequest) -> GrowReply:
        """Expand the kept tree of round ``req.round``, most probable unforwarded nodes first,
        ``width`` per forward, while the budget lasts and no other request waits."""
        t0 = time.perf_counter()
        session = self.store.get(req.session_id)
        grown, tree = 0, None
        if session is not None:
            with session.lock:
                g = session.draft_tree
                if isinstance(g, DraftTree) and g.round == req.round:
                    if req.tree is not None:
                        self._check_hints(g, req)
                        # within growth's depth, leaving it room for a forward's children
                        g.add_hints(req.tree, req.node_probs, max_depth=2 * max(1, g.max_depth) - 1,
                                    max_nodes=self.max_kept_nodes - req.width * g.branch)
                    grown = self.guarded(session, lambda: self.drive(self._grow(session.kv, g, req, t0)))
                    tree = self._grown_tree(g) if req.return_tree else None
        return GrowReply(session_id=req.session_id, round=req.round, grown_nodes=grown, grow_ms=self.elapsed_ms(t0),
                         tree=tree)

    def _grown_tree(self, g: DraftTree):
        """The grown tree for the orchestrator to re-root itself (``specsplit.tree.reroot_grown``),
        where the next DraftReply is that re-rooted tree and nothing more: no draft steps after
        re-rooting (``steps_after_reuse`` 0). None otherwise."""
        if self.steps_after_reuse != 0:
            return None
        return g.to_grown(self.limits.max_tree_nodes, self.limits.max_tree_depth)

    def _check_hints(self, g: DraftTree, req: GrowRequest) -> None:
        """A GrowRequest's tree: valid, greedy and rooted at the round's root; else TreeError
        (before anything changes)."""
        validate_tree(req.tree, vocab_size=self.vocab_size, max_nodes=MAX_TREE_NODES, max_depth=MAX_TREE_DEPTH)
        if req.tree.sampled:
            raise TreeError("a growth hint is a greedy tree (no child distributions)")
        if req.tree.token_ids[0] != g.tokens[0]:
            raise TreeError(f"the hinted tree's root {req.tree.token_ids[0]} is not round {req.round}'s root "
                            f"{g.tokens[0]}")

    def _grow(self, kv: SessionKV, g: DraftTree, req: GrowRequest, t0: float) -> Forwards[int]:
        depth_limit = 2 * max(1, g.max_depth)
        n0 = len(g)
        while not self.others_waiting():
            if elapsed_ms(t0) + (g.forward_ms or 0.0) > req.budget_ms:
                break
            if len(g) + req.width * g.branch > self.max_kept_nodes:
                break
            front = self._growth_front(g, depth_limit, req.width, self.tree_forward)
            if not front or kv.room() < len(front):
                break
            yield from self._expand(kv, g, front)
        return len(g) - n0

    @staticmethod
    def _growth_front(g: DraftTree, depth_limit: int, width: int, tree_forward: bool = True) -> list[int]:
        """The ``width`` most probable of the unforwarded nodes and the spare siblings (each
        expanded node's next one), the chosen spares added to the tree. A node whose parent is
        unforwarded (a hinted chain's) goes only with its parent (``tree_forward``) or after it."""
        ranked = [(g.scores[i], -i, i) for i in g.candidates(depth_limit, -math.inf)]
        ranked += [(score, -len(g) - k, -1 - parent) for k, (score, parent) in enumerate(g.spare_candidates(depth_limit))]
        chosen: list[int] = []
        for _, _, i in sorted(ranked, reverse=True):
            if len(chosen) == width:
                break
            if i >= 0 and g.slot[g.parents[i]] < 0 and not (tree_forward and g.parents[i] in chosen):
                continue
            chosen.append(i)
        return [i if i >= 0 else g.add_spare(-1 - i) for i in chosen]

    # ---- sampled: level by level, cache cropped afterwards -----------------------------
    def _build(
        self, kv: SessionKV, root: int, root_logits: torch.Tensor, spec: TreeSpec, sampling: SamplingSpec, round: int,
        process: penalties.DraftProcessing | None = None,
    ) -> Forwards[FlatTree]:
        g = DraftTree(root, kv.length, spec.branch)
        g.process = process
        gen = S.make_generator(sampling.seed, round, "draft", self.device)
        frontier, rows = [0], root_logits[None]  # [F], [F, V]
        min_logp = math.log(spec.min_path_prob) if spec.min_path_prob > 0 else -math.inf
        for depth in range(1, spec.max_depth + 1):
            if spec.max_nodes <= 1 or not frontier:
                break
            new = self._expand_sampled(g, frontier, rows, spec, sampling, gen)
            if depth == spec.max_depth or not new or len(g) >= spec.max_nodes:
                break
            # a repeat of an earlier sibling's token is reached only if that one was rejected,
            # and then it is rejected too: don't grow it
            new = g.first_of_token(new)
            frontier = [n for n in g.best(spec.branch, new) if g.scores[n] >= min_logp]
            if not frontier:  # paths unlikely to be accepted are not worth a forward
                break
            base = kv.length
            rows = yield self._nodes_segment(kv, g, frontier, [g.prefix_len - 1 + depth] * len(frontier))  # [F, V]
            for j, node in enumerate(frontier):
                g.slot[node] = base + j
        return g.to_flat()

    def _expand_sampled(self, g: DraftTree, frontier, rows, spec: TreeSpec, sampling: SamplingSpec, gen) -> list[int]:
        """Children of every frontier node drawn i.i.d. from its processed distribution q, which
        the tree carries (support capped at ``max_support``); one host copy per level."""
        infill = self.infill_vocab() if sampling.infill and self.infill_vocab is not None else None
        q = S.probs_from_logits(self._processed(g, frontier, rows), sampling, self.max_support, infill)  # [F, V]
        draws = S.sample_rows(q, gen, spec.branch)  # [F, B]
        logq = torch.log(q.gather(1, draws))  # [F, B]
        # the support: max_support ids, plus room for ties with the k-th logit (which survive)
        k = min(2 * self.max_support if self.max_support else q.shape[-1], q.shape[-1])
        support = torch.topk(q, k, dim=-1)  # [F, K], highest first
        host = [t.tolist() for t in (draws, logq, support.indices, support.values)]
        if k < q.shape[-1] and any(row[-1] > 0 for row in host[3]):  # more ties than that: all of it
            nnz = int((q > 0).sum(dim=-1).max())
            support = torch.topk(q, nnz, dim=-1)
            host[2], host[3] = support.indices.tolist(), support.values.tolist()
        new = []
        for j, f in enumerate(frontier):
            room = spec.max_nodes - len(g)
            if room <= 0:
                break
            ids, probs = host[2][j], host[3][j]
            nz = [i for i, p in enumerate(probs) if p > 0]
            g.dists[f] = ([ids[i] for i in nz], [probs[i] for i in nz])
            tokens, lps = host[0][j][:room], host[1][j][:room]  # a prefix in draw order
            new.extend(g.add_children(f, tokens, lps))
        return new

    def _nodes_segment(self, kv: SessionKV, g: DraftTree, nodes: list[int], pos: list[int]) -> Segment:
        """The forward of tree ``nodes`` appended to the cache: each sees the committed prefix,
        its ancestors' cache slots (the root is the prefix's last entry; an unforwarded ancestor
        is in ``nodes`` too, its row of this forward) and itself; [F, V] logits."""
        f, base, dev = len(nodes), kv.length, self.device
        here = {node: base + j for j, node in enumerate(nodes)}  # ancestors forwarded with them (hints)
        rows, cols = [], []
        for j, node in enumerate(nodes):
            for a in path_to(node, g.parents)[1:-1]:
                rows.append(j)
                cols.append(g.slot[a] if g.slot[a] >= 0 else here[a])
            rows.append(j)
            cols.append(base + j)
        # built on the host and copied once (on a GPU, one copy for the zeros, the prefix and the
        # ancestors' entries that took six operations, two of them copies of the indices)
        host = numpy.zeros((f, base + f), dtype=bool)  # [F, P+F]
        host[:, : g.prefix_len] = True
        host[rows, cols] = True
        visible = torch.from_numpy(host).to(dev)
        position_ids = torch.tensor(pos, dtype=torch.long, device=dev)  # [F]
        return Segment(kv, [g.tokens[n] for n in nodes], position_ids, visible, keep=f)
