"""The llama.cpp draft (``specsplit.engine.llamacpp`` tells how the engines use the unified
cache): DraftEngine's tree search with a sequence per forwarded node, kept trees re-rooted, and
the trees of several greedy sessions built in lockstep (``draft_batch``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.engine.base import EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.draft_batch import batchable, draft_batch
from specsplit.engine.llamacpp_kv import LlamaKV, _cache_miss, _LlamaEngineMixin
from specsplit.engine.llamacpp_model import LlamaCppModel
from specsplit.tree import DraftTree


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
    tree_forward = False  # a node's sequence copies its parent's cells: parents forwarded before

    def __init__(self, lm: LlamaCppModel, limits: EngineLimits = EngineLimits(), *, vocab_size: int | None = None,
                 max_support: int = 64, steps_after_reuse: int | None = None, backend=None, window=None,
                 grow_spares: int = 0):
        from specsplit.logs import get_logger

        self._setup(lm, limits, vocab_size, backend)
        self.max_support = max_support
        self.steps_after_reuse = steps_after_reuse
        # (a torch draft's window view; llama.cpp's kernels attend to the whole cache)
        self.window, self._window_attention = None, None
        self.max_kept_nodes = 4 * limits.max_tree_nodes
        self.grow_spares = grow_spares
        self.others_waiting = lambda: False
        self.log = get_logger("specsplit.draft")

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
        if kv.closed:  # evicted by a later member's admission in a batch: its sequence may serve another
            raise _cache_miss()
        kv.crop_to(sync.base_len)
        return self.forward_linear(kv, [*sync.append_token_ids, root])
        yield  # noqa: unreachable: makes this a generator

    def _nodes_segment(self, kv: LlamaKV, g: DraftTree, nodes: list[int], pos: list[int]) -> "_NodeForward":
        return _NodeForward(kv, g, nodes, pos)

    def forward_one(self, seg: "_NodeForward") -> torch.Tensor:
        return self._forward_nodes(seg.kv, seg.g, seg.nodes, seg.pos)

    def batched_forward_supported(self) -> bool:
        return True  # sessions share a decode through their own sequences (forward_segments)

    def draft_batch(self, requests) -> list:
        """Replies in order; the greedy sessions draft in lockstep (``draft_batch``'s rules), each
        step's node forwards of every session in one decode (``forward_segments``). Under the
        context's lock, as ``handle``. Their trees grow at once, so each may hold its share of
        the sequences (``LlamaKV.room``), not all of them as a session drafting alone may."""
        with self.lm.lock:
            self.sharing = max(1, sum(map(batchable, requests)))
            try:
                return draft_batch(self, requests)
            finally:
                self.sharing = 1

    def forward_segments(self, segments: list["_NodeForward"]) -> list[torch.Tensor]:
        """The node forwards of several sessions in one llama_decode: each node gets a sequence
        holding its parent's cells (its own session's), so it sees what its forward alone would
        see; per segment its rows' logits [F_i, V]. Any failure (no free sequence or cell, more
        tokens than one decode takes, a session dropped meanwhile) frees what was taken and
        raises: the lockstep then forwards each session alone, where such errors are its own."""
        total = sum(len(seg.nodes) for seg in segments)
        if total > self.lm.n_batch:
            raise ValueError(f"{total} tree nodes exceed one decode ({self.lm.n_batch} tokens)")
        taken: list[list[int]] = []
        tokens, pos, seq_ids = [], [], []
        try:
            for seg in segments:
                if seg.kv.closed:
                    raise _cache_miss()
                seqs = self._take_seqs(seg.kv, len(seg.nodes))
                taken.append(seqs)
                self._tag(seg.kv, seg.g, seg.nodes, seqs)
                tokens += [seg.g.tokens[n] for n in seg.nodes]
                pos += seg.pos
                seq_ids += [[s] for s in seqs]
            logits = self.lm.decode(tokens, pos, seq_ids, list(range(total)))  # [total, V]
        except BaseException:
            self._untake(s for seqs in taken for s in seqs)
            raise
        out, row = [], 0
        for seg, seqs in zip(segments, taken):
            self._record(seg.kv, seqs, seg.pos)
            out.append(torch.from_numpy(logits[row:row + len(seqs)]))
            row += len(seqs)
        return out

    def _forward_nodes(self, kv: LlamaKV, g: DraftTree, nodes: list[int], pos: list[int]) -> torch.Tensor:
        """One decode of tree ``nodes`` (parents forwarded): node n gets a sequence holding its
        parent's cells, so it sees the prefix, its ancestors and itself. [F, V] logits."""
        if kv.closed:  # dropped while a batch it belongs to ran (a collection or an eviction)
            raise _cache_miss()
        seqs = self._take_seqs(kv, len(nodes))
        try:
            self._tag(kv, g, nodes, seqs)
            tokens = [g.tokens[n] for n in nodes]
            logits = self._retry_out_of_cells(kv, lambda: self.lm.decode(tokens, pos, [[s] for s in seqs],
                                                                          list(range(len(nodes)))))  # [F, V]
        except BaseException:
            self._untake(seqs)
            raise
        self._record(kv, seqs, pos)
        return torch.from_numpy(logits)

    def _tag(self, kv: LlamaKV, g: DraftTree, nodes: list[int], seqs: list[int]) -> None:
        """Sequence ``seqs[j]`` takes the cells node ``nodes[j]``'s parent sees."""
        for node, s in zip(nodes, seqs):
            parent = g.slot[g.parents[node]]
            self.lm.seq_cp(kv.seq if parent < kv.prefix else kv.slots[parent][0], s)

    def _untake(self, seqs) -> None:
        for s in seqs:
            self.lm.seq_rm(s)
            self.pool.give(s)

    @staticmethod
    def _record(kv: LlamaKV, seqs: list[int], pos: list[int]) -> None:
        """The forwarded nodes become the session's next slots."""
        base = kv.length
        for j, s in enumerate(seqs):
            kv.slots[base + j] = (s, pos[j])
        kv.length = base + len(seqs)

    def _reroot(self, kv: LlamaKV, g: DraftTree, sync, root: int) -> DraftTree | None:
        """The kept tree re-rooted at the new root when [append tokens + root] is one of its
        paths and the new root was forwarded: the main sequence takes the path's cells, the new
        root's expanded subtree keeps its sequences, the rest are freed."""
        if g.prefix_len != sync.base_len or kv.prefix != g.prefix_len:
            return None
        path = g.reroot_path([*sync.append_token_ids, root])
        if not path:
            return None
        b = path[-1]
        b_seq, b_pos = kv.slots[g.slot[b]]
        expanded = sorted((n for n in g.kept_subtree(b)[1:] if g.slot[n] >= 0), key=lambda n: g.slot[n])
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
