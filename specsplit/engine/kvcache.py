"""Per-session KV cache on transformers' Cache interface.

``SessionKV`` is a ``transformers.Cache`` whose layers keep K/V in buffers that grow up to a
configured per-session maximum (never the model's whole context): to what is needed rounded up to
``chunk`` tokens, and by at least an eighth of the capacity each time, so a short session holds
little more than it writes and a long one is reallocated O(log) times, O(1) copies per token
overall (fixed 256-token steps reserved several times what the 1,000-session soak's short
sessions wrote, and copied a 16K session's cache 64 times on the way; docs/results.md, a1938a3).
Rollback to a length is O(1) (only the length moves); ``compact`` moves the accepted tree path
right after the prefix.
Any decoder-only family whose attention honours a custom 4D mask (Llama, Qwen2, Qwen3, Mistral
without sliding window, ...) works: the model calls ``update`` per layer as with DynamicCache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class CacheFull(Exception):
    """The session would exceed its configured maximum length."""


GROWTH = 8  # a buffer that must grow gains at least 1/GROWTH of its capacity


def grown_capacity(cap: int, need: int, chunk: int, max_len: int) -> int:
    """The capacity a buffer of ``cap`` tokens takes to hold ``need`` (> cap): ``need`` or
    ``cap`` + cap/GROWTH, whichever is more, rounded up to ``chunk``, at most ``max_len``."""
    want = max(need, cap + cap // GROWTH)
    return min(max_len, -(-want // chunk) * chunk)


class ChunkedLayer(DynamicLayer):
    """One layer's K/V: [1, H, capacity, D] buffers, ``length`` valid entries."""

    def __init__(self, max_len: int, chunk: int):
        super().__init__()
        self.max_len, self.chunk, self.length = max_len, chunk, 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self._k = key_states.new_empty((b, h, 0, d))
        self._v = value_states.new_empty((b, h, 0, value_states.shape[-1]))
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def _reserve(self, need: int) -> None:
        if need > self.max_len:
            raise CacheFull(f"session needs {need} cached tokens, limit is {self.max_len}")
        cap = self._k.shape[2]
        if need <= cap:
            return
        new_cap = grown_capacity(cap, need, self.chunk, self.max_len)
        for name in ("_k", "_v"):
            old = getattr(self, name)
            buf = old.new_empty((*old.shape[:2], new_cap, old.shape[3]))
            buf[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, buf)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        self._reserve(self.length + n)
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        self.length += n
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_len

    def crop_to(self, length: int) -> None:
        self.length = min(self.length, length)
        if self.is_initialized:
            self._views()

    def crop(self, tokens_to_remove: int) -> None:  # transformers' convention: negative count
        self.crop_to(self.length - abs(tokens_to_remove))

    def move(self, src: torch.Tensor, dst_start: int) -> None:
        """Copy entries at positions ``src`` [M] to ``dst_start .. dst_start+M``."""
        if not self.is_initialized or src.numel() == 0:
            return
        m = src.numel()
        self._k[:, :, dst_start : dst_start + m] = self._k.index_select(2, src)
        self._v[:, :, dst_start : dst_start + m] = self._v.index_select(2, src)

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._views()

    @property
    def nbytes(self) -> int:
        if self._k is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()


class SessionKV(Cache):
    """A session's KV cache: one ChunkedLayer per decoder layer, batch 1."""

    released = False  # a pooled cache whose slot went back to its pool (specsplit.engine.kvpool)

    def __init__(self, num_layers: int, max_len: int, chunk: int = 64):
        super().__init__(layers=[ChunkedLayer(max_len, chunk) for _ in range(num_layers)])
        self.max_len = max_len

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def crop_to(self, length: int) -> None:
        """O(1) rollback: keep the first ``length`` tokens."""
        for layer in self.layers:
            layer.crop_to(length)

    def crop(self, tokens_to_remove: int) -> None:
        self.crop_to(self.length - abs(tokens_to_remove))

    def compact(self, src_positions: list[int], dst_start: int) -> None:
        """Move the cache entries at ``src_positions`` (ascending) to start at ``dst_start`` and
        drop everything after them. Used to keep the accepted tree path right after the prefix."""
        in_place = src_positions == list(range(dst_start, dst_start + len(src_positions)))
        if src_positions and not in_place and self.layers and self.layers[0].is_initialized:
            src = torch.tensor(src_positions, dtype=torch.long, device=self.layers[0].device)  # [M]
            for layer in self.layers:
                layer.move(src, dst_start)
        self.crop_to(dst_start + len(src_positions))

    def room(self) -> int:
        return self.max_len - self.length

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
