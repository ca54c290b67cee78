"""What the llama.cpp engines share (``specsplit.engine.llamacpp`` tells how they work): a
session's part of the context's unified cache (``LlamaKV``), and the context, its sequence pool,
session eviction and room-making when the cache is full (``_LlamaEngineMixin``)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from schemas import ErrorCode
from specsplit.engine.base import LINEAR_CHUNK, EngineLimits
from specsplit.engine.llamacpp_model import LlamaCppModel, LlamaOutOfCells, SeqPool
from specsplit.engine.store import SessionStore
from specsplit.errors import SpecError


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

    def append_linear(self, tokens: list[int], chunk: int, on_rows=None) -> np.ndarray:
        """Committed tokens appended to the main sequence, ``chunk`` per decode; the last
        token's logits [V]. Only with no tree slots. ``on_rows``: given every token's logits,
        each decode's [chunk, V] in order."""
        assert not self.slots and self.length == self.prefix
        logits = None
        for a in range(0, len(tokens), chunk):
            part = tokens[a:a + chunk]
            p = self.prefix
            outputs = list(range(len(part))) if on_rows is not None else [len(part) - 1]
            logits = self.lm.decode(part, list(range(p, p + len(part))), [[self.seq]] * len(part), outputs)
            self.prefix += len(part)
            self.length = self.prefix
            if on_rows is not None:
                on_rows(torch.from_numpy(logits))
        return logits[-1]

    @property
    def nbytes(self) -> int:
        """The session's cells (committed prefix and tree slots) in the shared context's KV."""
        return 0 if self.closed else self.length * self.lm.bytes_per_cell


class _LlamaEngineMixin:
    """What both llama engines share: the context, the sequence pool, sessions that free their
    cells when evicted, and room-making when the shared cache is full."""

    lm: LlamaCppModel

    trash: int | None = None  # a sequence id that keeps dropped cells (LlamaTargetEngine)
    sharing: int = 1  # sessions building trees at once (a draft batch): each gets its share of sequences

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
                                                  lambda: (n_seq - len(self.store)) // self.sharing, self.trash),
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
        collection with no victims). Kept cells widen every later decode's attention span, which
        slows it, since the kernel computes masked cells too (docs/results.md, 22dd4b4); and the
        next session's cells then start at cell 0, laid out as in a fresh context (flash attention's
        KV tiles follow absolute cell positions, which moves its rounding)."""
        if self.trash is None or len(self.store) or self.lm.seq_pos_max(self.trash) < 0:
            return
        # the cells only (data=False): zeroing the buffers too cost a large memset in front of the
        # next request (docs/results.md, 7f2db8d) and changes nothing: a cell no sequence holds is
        # masked out, its stale K/V never read
        self.lm.lib.llama_memory_clear(self.lm.mem, False)
        self.pool.reset()
        self.idle_clears += 1

    def _retry_out_of_cells(self, kv: LlamaKV, fn):
        """fn(), evicting the least recently used other sessions while the shared cache is full
        (never one a request holds: the one served, or a member of a batch, whose cells and
        sequences are in use).
        With a trash sequence nothing frees cells but a collection: every session is dropped,
        the cache cleared, and this request answered CACHE_MISS (its client resends the context)."""
        while True:
            try:
                return fn()
            except LlamaOutOfCells:
                if self.trash is not None:
                    self._collect()
                    raise _cache_miss()
                if self.store.evict_oldest(keep=lambda s: s.kv is kv or s.lock.locked()) is None:
                    raise SpecError(ErrorCode.OVERLOADED, "the worker's KV cache is full", retryable=True)

    def _collect(self) -> None:
        for session in self.store.clear():
            session.kv.closed = True
        self.lm.lib.llama_memory_clear(self.lm.mem, True)
        self.pool.reset()
        self.collections += 1

    def _take_seqs(self, kv: LlamaKV, count: int) -> list[int]:
        """``count`` free sequence ids; other sessions' kept draft trees are dropped (oldest first,
        never a locked session's: a batch's members are drafting theirs) to make them, and
        OVERLOADED when that is not enough (nothing taken)."""
        while len(self.pool) < count:
            victim = self.store.oldest(keep=lambda s: s.kv is kv or not s.kv.slots or s.lock.locked())
            if victim is None:
                raise SpecError(ErrorCode.OVERLOADED, "worker has no free sequence for this tree", retryable=True)
            victim.kv.crop_to(victim.kv.prefix)
            victim.draft_tree = None
        return [self.pool.take() for _ in range(count)]

    def forward_linear(self, kv: LlamaKV, token_ids: list[int], chunk: int = LINEAR_CHUNK,
                       on_rows=None) -> torch.Tensor:
        """Committed tokens appended to the session's main sequence; the last one's logits [V]
        (``on_rows``: each decode's logits of every token, as ``LlamaKV.append_linear``)."""
        size = min(chunk, self.lm.n_batch)
        return torch.from_numpy(self._retry_out_of_cells(kv, lambda: kv.append_linear(token_ids, size, on_rows)))



def _cache_miss() -> SpecError:
    return SpecError(ErrorCode.CACHE_MISS, "the worker's cache was collected; resend with base_len 0")

