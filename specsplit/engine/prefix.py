"""Prefix cache: the K/V of contexts forwarded before, copied into new sessions that start alike.

A conversation's next turn, or a request with the same system prompt or few-shot examples as an
earlier one, starts with tokens a worker already forwarded. Without this cache a new session
forwards its whole context again (a 2,000-token history: seconds on a CPU). With it, the worker
keeps, within a byte budget, the K/V of each new session's context once forwarded, and of the
committed tokens of sessions that ended (or were evicted); a later session's first request copies
the longest cached prefix of its context into its own cache and forwards only the rest.

Keys are hash chains over whole blocks of tokens (as vLLM's automatic prefix caching): a hit is
then confirmed token by token, so a hash collision costs a miss, never another context's K/V.
Entries are copies (no block is shared with a live session, so no session's rollback, compaction
or pool slot can change one); the least recently used go first when the budget is spent.

What may be reused is the engine's call (``Engine.take_prefix``): a target that prefills long
prompts on another attention than it decodes with only reuses positions computed the way its own
prefill would compute them (``TargetEngine.reusable``), so its output stays its greedy decoding's.
Cross-request caches leak timing (a hit answers sooner): see docs/operations.md to turn it off.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from schemas import CacheSync
from specsplit.engine.kvcache import SessionKV
from specsplit.engine.store import Session

BLOCK = 64  # tokens per hashed block: a prefix is reused in whole blocks


def chain(tokens: Sequence[int], block: int) -> list[int]:
    """The hash after each whole block of ``tokens``: each one covers every token before it."""
    out, h = [], 0
    for a in range(0, len(tokens) - block + 1, block):
        h = hash((h, *tokens[a:a + block]))
        out.append(h)
    return out


@dataclass(eq=False)
class Entry:
    """A cached prefix: its tokens, their K and V [layers, Hkv, length, D], and how many leading
    positions were prefilled on a prompt attention (``prompt_path``; 0: none)."""

    tokens: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    prompt_path: int
    hashes: list[int]

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class PrefixCache:
    """Entries of at most ``max_bytes`` in all, and at most ``max_entries``; thread-safe."""

    def __init__(self, max_bytes: int, block: int = BLOCK, max_entries: int = 4096):
        if max_bytes < 0 or block < 1 or max_entries < 1:
            raise ValueError("a prefix cache needs max_bytes >= 0, block >= 1 and max_entries >= 1")
        self.max_bytes, self.block, self.max_entries = max_bytes, block, max_entries
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # id(entry) -> entry, least recent first
        self._index: dict[int, list[Entry]] = {}  # block-chain hash -> the entries holding that prefix
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = self.queried_tokens = self.reused_tokens = self.evicted = 0
        self.on_lookup = lambda queried, reused: None  # e.g. a worker's metrics

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def match(self, tokens: Sequence[int], limit: int,
              usable: Callable[[Entry, int], int] | None = None) -> tuple[Entry | None, int]:
        """The entry holding the longest prefix of ``tokens`` of whole blocks and at most
        ``limit`` tokens, and how many tokens of it may be used: ``usable(entry, n)`` of the
        ``n`` it holds (default: all), the most over the entries holding any; (None, 0) when
        none gives a token."""
        hashes = chain(tokens[:limit], self.block)
        with self._lock:
            levels = []  # per block, the entries holding the prefix through it
            for h in hashes:
                holders = self._index.get(h)
                if not holders:
                    break
                levels.append(list(holders))
        best, best_n = None, 0
        for i in range(len(levels) - 1, -1, -1):  # deepest first: the most any entry here can give
            if (i + 1) * self.block <= best_n:
                break
            for e in reversed(levels[i]):  # the most recent first
                same = 0  # confirmed token by token: after a hash collision only the blocks that match count
                while same < (i + 1) * self.block and e.tokens[same:same + self.block] == list(tokens[same:same + self.block]):
                    same += self.block
                got = usable(e, same) if usable is not None and same else same
                if got > best_n:
                    best, best_n = e, got
        if best is not None:
            with self._lock:
                if id(best) in self._entries:
                    self._entries.move_to_end(id(best))
        return best, best_n

    def count(self, queried: int, reused: int) -> None:
        """Record a lookup of ``queried`` tokens that reused ``reused`` of them (0: a miss)."""
        with self._lock:
            self.hits += reused > 0
            self.misses += reused == 0
            self.queried_tokens += queried
            self.reused_tokens += reused
        self.on_lookup(queried, reused)

    def put(self, tokens: Sequence[int], kv: SessionKV, prompt_path: int = 0) -> int:
        """Keep the K/V of ``tokens`` (the first ``len(tokens)`` entries of ``kv``), whole blocks
        only; an entry it extends is replaced, one that holds it all is kept instead. Returns the
        tokens kept (0: none: shorter than a block, already held, or larger than the budget)."""
        layers = kv.layers
        n = min(len(tokens), kv.length) // self.block * self.block
        if not layers or n == 0 or not layers[0].is_initialized:
            return 0
        k0, v0 = layers[0].keys, layers[0].values  # [1, H, L, D]
        per_token = len(layers) * (k0.shape[1] * k0.shape[3] * k0.element_size()
                                   + v0.shape[1] * v0.shape[3] * v0.element_size())
        n = min(n, self.max_bytes // max(1, per_token) // self.block * self.block)
        if n == 0:
            return 0
        tokens = list(tokens[:n])
        hashes = chain(tokens, self.block)
        prompt_path = min(prompt_path, n)
        with self._lock:  # an entry holding the same tokens, computed the same way
            held = next((e for e in self._index.get(hashes[-1], ())
                         if e.tokens[:n] == tokens and min(e.prompt_path, n) == prompt_path), None)
            if held is not None:
                self._entries.move_to_end(id(held))
                return 0
        keys = k0.new_empty((len(layers), k0.shape[1], n, k0.shape[3]))
        values = v0.new_empty((len(layers), v0.shape[1], n, v0.shape[3]))
        for i, layer in enumerate(layers):
            keys[i].copy_(layer.keys[0, :, :n])
            values[i].copy_(layer.values[0, :, :n])
        entry = Entry(tokens, keys, values, prompt_path, hashes)
        with self._lock:
            for i, h in enumerate(hashes):  # entries that are a prefix of this one, computed alike: it replaces them
                for old in [e for e in self._index.get(h, ()) if len(e.hashes) == i + 1 and e.tokens == tokens[:len(e.tokens)]
                            and e.prompt_path == min(prompt_path, len(e.tokens))]:
                    self._remove_locked(old)
            for h in hashes:
                self._index.setdefault(h, []).append(entry)
            self._entries[id(entry)] = entry
            self.bytes += entry.nbytes
            while self._entries and (self.bytes > self.max_bytes or len(self._entries) > self.max_entries):
                self._remove_locked(next(iter(self._entries.values())))
                self.evicted += 1
        return n

    def restore(self, entry: Entry, n: int, kv: SessionKV) -> None:
        """Append the entry's first ``n`` positions to ``kv`` (an empty cache)."""
        for i, layer in enumerate(kv.layers):
            layer.update(entry.keys[i, :, :n][None], entry.values[i, :, :n][None])

    def _remove_locked(self, entry: Entry) -> None:
        if self._entries.pop(id(entry), None) is None:
            return
        self.bytes -= entry.nbytes
        for h in entry.hashes:
            holders = self._index.get(h)
            if holders is not None:
                holders[:] = [e for e in holders if e is not entry]
                if not holders:
                    del self._index[h]


def take_prefix(cache: PrefixCache | None, session: Session, sync: CacheSync, root: int,
                reusable: Callable[[CacheSync, int, int], int]) -> CacheSync:
    """``Engine.take_prefix``: the session's tokens follow ``sync`` (+ ``root``); from an empty
    cache, the longest cached prefix of its tokens that ``reusable(sync, prompt_path, n)``
    allows is copied into the session's cache (``session.reused`` tokens). Returns the sync to
    apply: ``sync``, or one that keeps the copied prefix and appends the rest."""
    tokens = session.tokens
    if sync.base_len <= len(tokens):  # else the tokens it keeps are not all named here: what is stays true
        del tokens[sync.base_len:]
        tokens.extend(sync.append_token_ids)
        tokens.append(root)
    session.reused = 0
    if sync.base_len:
        return sync
    session.prompt_path = 0
    append = sync.append_token_ids
    if cache is None or len(append) < cache.block:
        return sync
    entry, n = cache.match(append, len(append), lambda e, held: reusable(sync, e.prompt_path, held))
    cache.count(len(append), n)
    if not n:
        return sync
    session.kv.crop_to(0)
    session.specpv = None  # a partial view summarizes the cache it replaces (TargetEngine rebuilds one)
    cache.restore(entry, n, session.kv)
    session.prompt_path, session.reused = min(entry.prompt_path, n), n
    return sync.model_copy(update={"base_len": n, "append_token_ids": append[n:]})


def keep_prefix(cache: PrefixCache, session: Session, committed_len: Callable[[Session], int],
                held: bool = False) -> None:
    """``Engine.keep_prefix``: the K/V of the tokens the session names, unless it was dropped
    after a failure, its pool slot went back, or (``held`` False) a request holds it."""
    if session.dropped or getattr(session.kv, "released", False):
        return
    if not held and not session.lock.acquire(blocking=False):
        return
    try:
        n = min(committed_len(session), session.kv.length, len(session.tokens))
        cache.put(session.tokens[:n], session.kv, session.prompt_path)
    finally:
        if not held:
            session.lock.release()
