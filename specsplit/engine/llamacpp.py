"""Engines on llama.cpp's kernels (GGUF weights through llama-cpp-python's C API).

On a CPU, llama.cpp's quantized kernels (Q4_K_M as the preset's GGUFs ship) run the 1.5B target
~2-4x faster than torch's int8 (fbgemm) here, so the draft and the target verify with the same
kernels a user of llama.cpp already runs. The request handling, tree search and verification rules
are the torch engines' (``DraftEngine`` / ``TargetEngine``): only the cache and the forward differ.

One llama context per worker holds every session's KV in one *unified* cache; a cell is shared by
sequences (a bitset). Visibility in a llama.cpp batch is "same sequence and not a later position"
(the token's first sequence id decides), which gives tree attention:

- each session owns a *main* sequence: its committed tokens;
- target: every root->leaf path of the tree gets a scratch sequence (a copy of the main one's
  cells); a node is tagged with the sequences of every leaf below it, so it sees the prefix, its
  ancestors and itself. After the verdict, the main sequence takes the accepted path's cells and
  the scratch sequences are removed (the rejected nodes' cells become free);
- draft: every forwarded tree node owns a sequence = its parent's cells + its own, so a node
  forwarded later sees exactly its ancestors; a re-rooted tree hands the path to the main sequence.

Positions are ``cache_len + depth`` as in the torch engines. A target verifies the rounds of
several sessions in one decode (``verify_batch``: each token carries its own session's sequences,
so the shared decode computes what each round alone would, up to the kernels' shape rounding).
Exactness: llama.cpp's kernels are not batch-invariant (a multi-token forward may round
differently from one-token decodes: the weight GEMMs, and the flash-attention kernel's tiled /
split-KV paths), so a llama.cpp target's output equals its own plain greedy decoding except where
the two top logits are within that rounding. Sequence ids come from a bounded pool
(LLAMA_MAX_SEQ = 256 per context); a draft that finds the pool empty stops growing.
Engines contain no transport and no device policy: threads per forward size come from the
worker's backend (``threads_for``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from schemas import ErrorCode
from specsplit.engine.base import LINEAR_CHUNK, EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.store import Session, SessionStore
from specsplit.engine.target import TargetEngine
from specsplit.engine.target_batch import verify_alone, verify_batch
from specsplit.engine.llamacpp_model import (  # noqa: F401 (greedy_decode, MAX_SEQ: re-exported)
    MAX_SEQ, LlamaCppModel, LlamaOutOfCells, SeqPool, greedy_decode,
)
from specsplit.engine.verify import Outcome, Verdict
from specsplit.errors import SpecError
from specsplit.tree import DraftTree, TreeLayout, path_to, subtree_nodes


class LlamaKV:
    """A session's part of the unified cache, with SessionKV's vocabulary: ``length`` counts
    slots (the committed prefix in the main sequence, then forwarded tree nodes, each with its
    own sequence id and position), ``crop_to`` drops slots from the end."""

    def __init__(self, lm: LlamaCppModel, pool: SeqPool, max_len: int, tree_seqs: Callable[[], int],
                 trash: int | None = None):
        self.lm, self.pool, self.max_len, self.trash = lm, pool, max_len, trash
        self.tree_seqs = tree_seqs  # sequences all tree slots may hold (the pool less main sequences)
        seq = pool.take()
        if seq is None:
            raise SpecError(ErrorCode.OVERLOADED, "worker has no free sequence for a new session", retryable=True)
        self.seq = seq
        self.prefix = 0  # committed cells in the main sequence (positions 0..prefix-1)
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (sequence, position), slots >= prefix
        self.length = 0
        self.closed = False

    @property
    def layers(self):  # SessionKV compatibility for code that counts layers (SpecPV: not supported here)
        return ()

    def room(self) -> int:
        """Slots this session may still add: its length limit, and the sequences not held by main
        sequences or by its own tree (other sessions' kept trees are given up for it)."""
        return min(self.max_len - self.length, self.tree_seqs() - len(self.slots))

    def crop_to(self, length: int) -> None:
        """Keep the first ``length`` slots (committed cells, then tree slots)."""
        length = max(0, length)
        for slot in [s for s in self.slots if s >= length]:
            seq, _ = self.slots.pop(slot)
            self.drop(seq)
            self.pool.give(seq)
        if length < self.prefix:
            self.drop(self.seq, length, -1)
            self.prefix = length
        self.length = min(self.length, length)

    def release(self) -> None:
        """Free every cell and sequence of the session (it was evicted or ended)."""
        if self.closed:
            return
        self.crop_to(0)
        self.drop(self.seq)
        self.pool.give(self.seq)
        self.closed = True

    def drop(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Remove ``seq`` from the cells in [p0, p1). With a trash sequence the cells are not
        freed but handed to it (see LlamaTargetEngine: no cell is ever reused before the whole
        cache is collected, so every session's cells stay in position order)."""
        if self.trash is not None:
            self.lm.seq_cp(seq, self.trash, p0, p1)
        self.lm.seq_rm(seq, p0, p1)

    def append_linear(self, tokens: list[int], chunk: int) -> np.ndarray:
        """Committed tokens appended to the main sequence, ``chunk`` per decode; the last
        token's logits [V]. Only with no tree slots."""
        assert not self.slots and self.length == self.prefix
        logits = None
        for a in range(0, len(tokens), chunk):
            part = tokens[a:a + chunk]
            p = self.prefix
            logits = self.lm.decode(part, list(range(p, p + len(part))), [[self.seq]] * len(part), [len(part) - 1])
            self.prefix += len(part)
            self.length = self.prefix
        return logits[0]

    @property
    def nbytes(self) -> int:
        """The session's cells (committed prefix and tree slots) in the shared context's KV."""
        return 0 if self.closed else self.length * self.lm.bytes_per_cell


class _LlamaEngineMixin:
    """What both llama engines share: the context, the sequence pool, sessions that free their
    cells when evicted, and room-making when the shared cache is full."""

    lm: LlamaCppModel

    trash: int | None = None  # a sequence id that keeps dropped cells (LlamaTargetEngine)

    def _setup(self, lm: LlamaCppModel, limits: EngineLimits, vocab_size: int | None, backend) -> None:
        from specsplit.engine.base import Backend

        self.model = None
        self.collections = 0  # full caches cleared (every session dropped)
        self.idle_clears = 0  # trash cleared with no session left
        self.lm = lm
        with lm.lock:  # the context serves this engine alone: no cells of an earlier one remain
            lm.lib.llama_memory_clear(lm.mem, True)
        self.limits = limits
        self.vocab_size = vocab_size or lm.vocab_size
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.backend = backend or Backend()
        # sessions need a main sequence each; the rest is the trees' (target leaves / draft nodes)
        n_seq = lm.n_seq - (1 if self.trash is not None else 0)
        if self.trash is not None:
            self.trash = lm.n_seq - 1
        self.pool = SeqPool(n_seq)
        max_sessions = max(1, min(limits.max_sessions, n_seq // 2))
        self.limits = EngineLimits(**{**limits.__dict__, "max_sessions": max_sessions})
        self.store = SessionStore(lambda: LlamaKV(lm, self.pool, limits.max_session_tokens,
                                                  lambda: n_seq - len(self.store), self.trash),
                                  max_sessions=max_sessions, ttl_s=limits.session_ttl_s,
                                  on_evict=lambda s: s.kv.release())

    def handle(self, msg):
        """Every request (and an eviction it causes) runs under the context's lock: one llama
        context is never used by two threads at once (the worker may serve small requests inline)."""
        with self.lm.lock:
            try:
                return super().handle(msg)
            finally:
                self._clear_if_idle()

    def _clear_if_idle(self) -> None:
        """With no session left, the trash sequence's cells are cleared (nothing to resend: a
        collection with no victims). Kept cells widen every later decode's attention span: on the
        1.5B target (2 threads, AVX2) a 1-token decode after 3,000 trash cells took 115 ms against
        98-102 in a fresh context, since the kernel computes masked cells too; and the next
        session's cells then start at cell 0, laid out as in a fresh context (flash attention's
        KV tiles follow absolute cell positions, which moves its rounding)."""
        if self.trash is None or len(self.store) or self.lm.seq_pos_max(self.trash) < 0:
            return
        self.lm.lib.llama_memory_clear(self.lm.mem, True)
        self.pool.reset()
        self.idle_clears += 1

    def _retry_out_of_cells(self, kv: LlamaKV, fn):
        """fn(), evicting the least recently used other sessions while the shared cache is full.
        With a trash sequence nothing frees cells but a collection: every session is dropped,
        the cache cleared, and this request answered CACHE_MISS (its client resends the context)."""
        while True:
            try:
                return fn()
            except LlamaOutOfCells:
                if self.trash is not None:
                    self._collect()
                    raise _cache_miss()
                if self.store.evict_oldest(keep=lambda s: s.kv is kv) is None:
                    raise SpecError(ErrorCode.OVERLOADED, "the worker's KV cache is full", retryable=True)

    def _collect(self) -> None:
        for session in self.store.clear():
            session.kv.closed = True
        self.lm.lib.llama_memory_clear(self.lm.mem, True)
        self.pool.reset()
        self.collections += 1

    def _take_seqs(self, kv: LlamaKV, count: int) -> list[int]:
        """``count`` free sequence ids; other sessions' kept draft trees are dropped (oldest first)
        to make them, and OVERLOADED when that is not enough (nothing taken)."""
        while len(self.pool) < count:
            victim = self.store.oldest(keep=lambda s: s.kv is kv or not s.kv.slots)
            if victim is None:
                raise SpecError(ErrorCode.OVERLOADED, "worker has no free sequence for this tree", retryable=True)
            victim.kv.crop_to(victim.kv.prefix)
            victim.draft_tree = None
        return [self.pool.take() for _ in range(count)]

    def forward_linear(self, kv: LlamaKV, token_ids: list[int], chunk: int = LINEAR_CHUNK) -> torch.Tensor:
        """Committed tokens appended to the session's main sequence; the last one's logits [V]."""
        size = min(chunk, self.lm.n_batch)
        return torch.from_numpy(self._retry_out_of_cells(kv, lambda: kv.append_linear(token_ids, size)))


def _leaf_sets(layout: TreeLayout) -> tuple[list[int], list[list[int]]]:
    """(leaves, below): the tree's leaves, and for every node the indices (into ``leaves``) of the
    leaves in its subtree, the first one on its first child's side."""
    n = layout.num_nodes
    leaves = [i for i in range(n) if not layout.children[i]]
    index = {leaf: k for k, leaf in enumerate(leaves)}
    below: list[list[int]] = [[] for _ in range(n)]
    for i in range(n - 1, -1, -1):
        if i in index:
            below[i] = [index[i]]
        else:
            below[i] = [k for c in layout.children[i] for k in below[c]]
    return leaves, below


class LlamaTargetEngine(_LlamaEngineMixin, TargetEngine):
    """TargetEngine's requests and verification rules on a llama.cpp context (full verification;
    SpecPV views are a torch-engine feature: a request's ``specpv`` is verified fully here)."""

    role = "target"
    trash = -1  # set to the last sequence id by _setup

    def __init__(self, lm: LlamaCppModel, limits: EngineLimits = EngineLimits(), *, vocab_size: int | None = None,
                 backend=None):
        from specsplit.logs import get_logger

        self._setup(lm, limits, vocab_size, backend)
        self._view_attention = None
        self.log = get_logger("specsplit.target")

    @staticmethod
    def committed_len(session) -> int:
        return session.kv.prefix

    def batched_forward_supported(self) -> bool:
        return True  # sessions share a decode through their own sequences (verify_members)

    def verify_batch(self, requests) -> list:
        """Replies in order; the sessions that allow it share one decode (``target_batch``'s
        rules, ``verify_members``). Under the context's lock, as ``handle``."""
        with self.lm.lock:
            try:
                return verify_batch(self, requests)
            finally:
                self._clear_if_idle()

    def verify_members(self, members, replies: list, t0: float) -> None:
        """Several sessions' syncs and trees in one llama_decode: each token carries its own
        session's sequences, so it sees only its session's prefix and tree ancestors (the unified
        cache's visibility rule), exactly what its request alone would decode. Members are grouped
        into decodes of at most ``n_batch`` tokens; a member that fits no group, or finds no free
        sequences for its tree, is verified alone after the groups."""
        groups: list[list] = [[]]
        used, later = 0, []
        for m in members:
            size = len(m.req.sync.append_token_ids) + m.layout.num_nodes
            if size > self.lm.n_batch:
                later.append(m)
                continue
            if used + size > self.lm.n_batch:
                groups.append([])
                used = 0
            groups[-1].append(m)
            used += size
        for group in groups:
            group = [m for m in group if not self._gone(m, replies)]
            if len(group) == 1:
                verify_alone(self, group[0], replies, t0)
            elif group:
                later += self._verify_group(group, replies, t0)
        for m in later:
            if not self._gone(m, replies):
                verify_alone(self, m, replies, t0)

    @staticmethod
    def _gone(m, replies: list) -> bool:
        """A member whose session was dropped meanwhile (a collection, or evicted by a later
        member's new session: its sequence may already serve another) is answered CACHE_MISS."""
        if not m.session.kv.closed:
            return False
        replies[m.index] = _cache_miss().to_reply(m.req.session_id, m.req.round)
        return True

    def _verify_group(self, group, replies: list, t0: float) -> list:
        """One decode for ``group``'s rounds; returns the members left to verify alone."""
        planned, later = [], []
        for m in group:
            try:
                planned.append((m, self.guarded(m.session, lambda m=m: self._plan(m.session.kv, m.req, m.layout))))
            except SpecError as exc:
                if exc.code is ErrorCode.OVERLOADED:  # no free sequences now: alone, after this decode
                    later.append(m)
                else:
                    replies[m.index] = exc.to_reply(m.req.session_id, m.req.round)
        tokens, pos, seqs, outputs = [], [], [], []
        for _, plan in planned:
            outputs += [len(tokens) + i for i in plan.outputs]
            tokens += plan.tokens
            pos += plan.positions
            seqs += plan.seqs
        if not planned:
            return later
        try:
            logits = self.lm.decode(tokens, pos, seqs, outputs)
        except LlamaOutOfCells:
            self._collect()  # every session dropped: each member resends its context
            for m, _ in planned:
                replies[m.index] = _cache_miss().to_reply(m.req.session_id, m.req.round)
            return later
        except Exception as exc:  # nothing was decoded (llama_decode restores the cache on failure)
            self.log.warning("batch_forward_failed", sessions=len(planned), error=f"{type(exc).__name__}: {exc}"[:500],
                             action="verify each alone")
            for m, plan in planned:
                self._release(m.session.kv, plan)
                m.session.kv.crop_to(m.req.sync.base_len)
            return later + [m for m, _ in planned]
        row = 0
        for m, plan in planned:
            lg = torch.from_numpy(logits[row:row + plan.layout.num_nodes])
            row += plan.layout.num_nodes

            def settle(m=m, plan=plan, lg=lg) -> Outcome:
                try:
                    verdict = self._settle(m.session.kv, m.req, plan, lg)
                finally:
                    self._release(m.session.kv, plan)
                m.session.last_round = m.req.round
                return Outcome(verdict, forward_tokens=len(plan.tokens))

            try:
                out = self.guarded(m.session, settle)
                replies[m.index] = self.reply_for(m.req, out, self.committed_len(m.session), t0,
                                                  batch_tokens=len(tokens), batch_size=len(planned))
            except SpecError as exc:
                replies[m.index] = exc.to_reply(m.req.session_id, m.req.round)
        return later

    def _round(self, session: Session, req, layout: TreeLayout) -> Outcome:
        kv: LlamaKV = session.kv
        plan = self._plan(kv, req, layout)
        try:
            logits = torch.from_numpy(self._retry_out_of_cells(
                kv, lambda: self.lm.decode(plan.tokens, plan.positions, plan.seqs, plan.outputs)))  # [N, V]
            verdict = self._settle(kv, req, plan, logits)
        finally:
            self._release(kv, plan)
        return Outcome(verdict, forward_tokens=len(req.sync.append_token_ids) + layout.num_nodes)

    def _plan(self, kv: LlamaKV, req, layout: TreeLayout) -> "_Planned":
        """Before the round's decode: the cache cropped to the sync's base, a sync too long for
        one decode with the tree committed ahead in chunks, and a scratch sequence (a copy of the
        main one) per leaf of the tree; the decode's tokens, positions and sequences."""
        kv.crop_to(req.sync.base_len)
        lin = list(req.sync.append_token_ids)
        n = layout.num_nodes
        leaves, below = _leaf_sets(layout)
        room = self.lm.n_batch - n
        if len(lin) > room:  # a long sync (a prompt): committed first, in chunks
            head, lin = lin[:len(lin) - room], lin[len(lin) - room:]
            self.forward_linear(kv, head)
        scratch = self._take_seqs(kv, len(leaves))
        for s in scratch:
            self.lm.seq_cp(kv.seq, s)
        start = kv.prefix + len(lin)  # the root's position
        return _Planned(
            lin=lin, layout=layout, scratch=scratch, below=below, start=start,
            tokens=[*lin, *req.tree.token_ids],
            positions=[*range(kv.prefix, start), *(start + d for d in layout.depths)],
            seqs=[[kv.seq, *scratch]] * len(lin) + [[scratch[k] for k in below[i]] for i in range(n)])

    def _settle(self, kv: LlamaKV, req, plan: "_Planned", logits: torch.Tensor) -> Verdict:
        """After the decode (the sync's tokens are committed): the verdict from the tree's logits
        [N, V], and the accepted path's cells handed to the main sequence."""
        kv.prefix = kv.length = plan.start
        visible = torch.from_numpy(_ancestor_matrix(plan.layout))  # [N, N]
        verdict: Verdict = self.decide(req, plan.layout, logits, visible)
        path_seq = plan.scratch[plan.below[verdict.path[-1]][0]]
        self.lm.seq_cp(path_seq, kv.seq, plan.start, plan.start + len(verdict.path))  # root + accepted nodes
        kv.prefix = kv.length = plan.start + len(verdict.path)
        return verdict

    def _release(self, kv: LlamaKV, plan: "_Planned") -> None:
        if not kv.closed:  # (a collection cleared everything)
            for s in plan.scratch:
                kv.drop(s)
                self.pool.give(s)
        plan.scratch = []


@dataclass(slots=True)
class _Planned:
    """One round's decode inputs on a llama target (``LlamaTargetEngine._plan``)."""

    lin: list[int]  # sync tokens in the decode (committed to the main sequence by it)
    layout: TreeLayout
    scratch: list[int]  # a sequence per leaf
    below: list[list[int]]  # per node: the leaves (indices into scratch) under it
    start: int  # the root's position
    tokens: list[int]
    positions: list[int]
    seqs: list[list[int]]

    @property
    def outputs(self) -> list[int]:
        """The tree nodes' indices in the decode's tokens (their logits are read)."""
        return list(range(len(self.lin), len(self.tokens)))


def _cache_miss() -> SpecError:
    return SpecError(ErrorCode.CACHE_MISS, "the worker's cache was collected; resend with base_len 0")


def _ancestor_matrix(layout: TreeLayout) -> np.ndarray:
    n = layout.num_nodes
    m = np.zeros((n, n), dtype=bool)
    for i in range(n):
        for a in path_to(i, layout.parents):
            m[i, a] = True
    return m


@dataclass(frozen=True)
class _NodeForward:
    """A draft forward of tree ``nodes`` (parents forwarded) at positions ``pos``."""

    kv: LlamaKV
    g: DraftTree
    nodes: list
    pos: list


class LlamaDraftEngine(_LlamaEngineMixin, DraftEngine):
    """DraftEngine's tree search (best-first, kept and re-rooted between requests, grown while
    the target verifies; sampled level by level) on a llama.cpp context."""

    role = "draft"

    def __init__(self, lm: LlamaCppModel, limits: EngineLimits = EngineLimits(), *, vocab_size: int | None = None,
                 max_support: int = 64, steps_after_reuse: int | None = None, backend=None, window=None):
        self._setup(lm, limits, vocab_size, backend)
        self.max_support = max_support
        self.steps_after_reuse = steps_after_reuse
        # (a torch draft's window view; llama.cpp's kernels attend to the whole cache)
        self.window, self._window_attention = None, None
        self.max_kept_nodes = 4 * limits.max_tree_nodes
        self.others_waiting = lambda: False

    @staticmethod
    def committed_len(session) -> int:
        """Committed tokens: the kept tree's prefix, else the main sequence's cells (never tree
        slots a failed request may have left behind)."""
        g = session.draft_tree
        return g.prefix_len if isinstance(g, DraftTree) else session.kv.prefix

    def _root_forward(self, kv: LlamaKV, sync, root: int):
        """Crop to the synced prefix (freeing any kept tree) and append [sync tokens + root]; the
        root's logits [V]. A generator like DraftEngine's (its forwards are driven as generators)
        that forwards by itself and yields nothing."""
        kv.crop_to(sync.base_len)
        return self.forward_linear(kv, [*sync.append_token_ids, root])
        yield  # noqa: unreachable: makes this a generator

    def _nodes_segment(self, kv: LlamaKV, g: DraftTree, nodes: list[int], pos: list[int]) -> "_NodeForward":
        return _NodeForward(kv, g, nodes, pos)

    def forward_one(self, seg: "_NodeForward") -> torch.Tensor:
        return self._forward_nodes(seg.kv, seg.g, seg.nodes, seg.pos)

    def draft_batch(self, requests) -> list:
        """One at a time (the context's sessions could share a decode; not built yet)."""
        return [self.handle(r) for r in requests]

    def _forward_nodes(self, kv: LlamaKV, g: DraftTree, nodes: list[int], pos: list[int]) -> torch.Tensor:
        """One decode of tree ``nodes`` (parents forwarded): node n gets a sequence holding its
        parent's cells, so it sees the prefix, its ancestors and itself. [F, V] logits."""
        f, base = len(nodes), kv.length
        seqs = self._take_seqs(kv, f)
        try:
            for node, s in zip(nodes, seqs):
                parent = g.slot[g.parents[node]]
                self.lm.seq_cp(kv.seq if parent < kv.prefix else kv.slots[parent][0], s)
            tokens = [g.tokens[n] for n in nodes]
            logits = self._retry_out_of_cells(kv, lambda: self.lm.decode(tokens, pos, [[s] for s in seqs],
                                                                          list(range(f))))  # [F, V]
        except BaseException:
            for s in seqs:
                self.lm.seq_rm(s)
                self.pool.give(s)
            raise
        for j, s in enumerate(seqs):
            kv.slots[base + j] = (s, pos[j])
        kv.length = base + f
        return torch.from_numpy(logits)

    def _reroot(self, kv: LlamaKV, g: DraftTree, sync, root: int) -> DraftTree | None:
        """The kept tree re-rooted at the new root when [append tokens + root] is one of its
        paths and the new root was forwarded: the main sequence takes the path's cells, the new
        root's expanded subtree keeps its sequences, the rest are freed."""
        if g.prefix_len != sync.base_len or kv.prefix != g.prefix_len:
            return None
        path = g.child_path([*sync.append_token_ids, root])
        if not path or g.slot[path[-1]] < 0:
            return None
        b = path[-1]
        b_seq, b_pos = kv.slots[g.slot[b]]
        expanded = sorted((n for n in subtree_nodes(g.parents, b)[1:] if g.slot[n] >= 0), key=lambda n: g.slot[n])
        self.lm.seq_cp(b_seq, kv.seq, g.prefix_len, b_pos + 1)  # the path joins the committed prefix
        new_prefix = g.prefix_len + len(path)
        keep = {g.slot[n] for n in expanded}
        kept = {}
        for slot, (seq, p) in kv.slots.items():
            if slot in keep:
                kept[slot] = (seq, p)
            else:
                self.lm.seq_rm(seq)
                self.pool.give(seq)
        where = {g.slot[n]: new_prefix + k for k, n in enumerate(expanded)}
        kv.slots = {where[slot]: v for slot, v in kept.items()}
        kv.prefix = new_prefix
        kv.length = new_prefix + len(expanded)
        return g.rerooted(b, new_prefix, where)
