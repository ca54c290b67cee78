"""A preallocated KV pool: every session's cache in a fixed slot, allocated once at engine start.

Per decoder layer one K and one V tensor [slots, Hkv, max_session_tokens, D] on the engine's
device and dtype (views of one tensor of all layers). A new session takes a free slot and its ``SessionKV`` writes into that slot's
views (``SlotLayer``): a cache never grows or moves, so its addresses are static (what CUDA graphs
captured over the buffers need); rollback, ``compact`` and ``crop_to`` work as on growing buffers.

A slot goes back to the pool when its session leaves the store (LRU, TTL, end, drop), but only
once no request holds that session: a session evicted while a request is being served keeps its
slot ("retired") until that request released the session's lock, so a new session never writes
K/V that are still being read. A released session's cache is detached from the slot; a request
that still holds it gets CACHE_MISS (``Engine.check_locked``), and any write raises.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from specsplit.engine.kvcache import ChunkedLayer, SessionKV

GB = 10**9  # the pool's size setting counts bytes in units of 10^9
AUTO = "auto"  # the size setting's default: sized to the device at start (``auto_slots``)
# what an automatic pool leaves free on the device: the largest of a fraction of its memory and a
# floor, for activations, prefill chunks, the graphs' static buffers (a bucket's logits alone reach
# ~0.6 GB for a 150K vocabulary) and other processes' growth
AUTO_RESERVE_FRACTION = 0.1
AUTO_RESERVE_BYTES = 3 * GB
# and takes at most this share of the card, so a second worker started on it (the other role of a
# one-GPU fleet, another replica) still finds room for a pool of its own
AUTO_MAX_SHARE = 0.5


@dataclass(frozen=True)
class PoolShape:
    """What one slot holds: ``layers`` x (K, V) of [Hkv, max_len, D] in ``dtype``."""

    layers: int
    kv_heads: int
    head_dim: int
    max_len: int
    dtype: torch.dtype

    @property
    def slot_bytes(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.max_len * self.head_dim * item


def pool_shape(model, max_len: int, dtype: torch.dtype) -> PoolShape:
    """The slot shape of ``model``'s decoder (its KV heads and head size) at ``max_len`` tokens."""
    cfg = model.config.get_text_config(decoder=True)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return PoolShape(int(cfg.num_hidden_layers), kv_heads, head_dim, max_len, dtype)


def pool_slots(gb: float, shape: PoolShape, max_sessions: int) -> int:
    """Slots a pool of ``gb`` x 10^9 bytes holds, at most ``max_sessions``; ValueError when it
    holds none (a pool smaller than one session's cache serves nobody)."""
    slots = round(gb * GB) // shape.slot_bytes
    if slots < 1:
        raise ValueError(f"a KV pool of {gb} GB holds no session: one slot ({shape.max_len} tokens, "
                         f"{shape.layers} layers) needs {shape.slot_bytes / GB:.4f} GB")
    return min(slots, max_sessions)


def auto_slots(shape: PoolShape, want: int, free_bytes: int, total_bytes: int) -> int:
    """Slots of an automatic pool: ``want`` (the sessions a worker keeps, plus the graphs'
    scratch slot), or as many as ``free_bytes`` hold after the reserve, within AUTO_MAX_SHARE of
    the card; 0 when not even one."""
    reserve = max(AUTO_RESERVE_BYTES, round(AUTO_RESERVE_FRACTION * total_bytes))
    room = min(free_bytes - reserve, round(AUTO_MAX_SHARE * total_bytes))
    return max(0, min(want, room // shape.slot_bytes))


class SlotLayer(ChunkedLayer):
    """One layer's K/V in a pool slot: fixed [1, Hkv, max_len, D] views, never reallocated."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        super().__init__(k.shape[2], k.shape[2])
        self._k, self._v = k, v
        self.dtype, self.device = k.dtype, k.device
        self.is_initialized = True
        self._views()

    # keys / values: the slot's first ``length`` entries, sliced when read (a request moves the
    # length of every layer, often several times; slicing each layer each time cost host time)
    @property
    def keys(self):
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value) -> None:
        pass  # derived from the slot and the length

    @property
    def values(self):
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value) -> None:
        pass

    def _views(self) -> None:
        pass

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("this session's KV pool slot was released")  # only a detached layer gets here

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized and (key_states.dtype != self._k.dtype or key_states.shape[1] != self._k.shape[1]
                                    or key_states.shape[3] != self._k.shape[3]):
            raise ValueError(f"K/V {tuple(key_states.shape)} {key_states.dtype} do not fit the KV pool's slot "
                             f"{tuple(self._k.shape)} {self._k.dtype}")
        return super().update(key_states, value_states, *args, **kwargs)

    def detach(self) -> None:
        """Forget the slot: nothing of this layer can read or write it any more."""
        self._k = self._v = None
        self.keys = self.values = None
        self.length = 0
        self.is_initialized = False


class PooledKV(SessionKV):
    """A session's cache in pool slot ``slot`` (``SessionKV`` over ``SlotLayer``s)."""

    def __init__(self, pool: KVPool, slot: int):
        Cache.__init__(self, layers=[SlotLayer(k[slot:slot + 1], v[slot:slot + 1])
                                     for k, v in zip(pool.keys, pool.values)])
        self.max_len, self.slot, self.pool = pool.shape.max_len, slot, pool
        self.released = False

    def compact(self, src_positions: list[int], dst_start: int) -> None:
        """As ``SessionKV.compact``, every layer's K and V moved at once: one gather and one copy
        over the pool's tensor of all layers, where moving layer by layer launched four kernels
        a layer (on a GPU, ~100 launches a session a round for a 28-layer model)."""
        self.pool.compact_sessions([(self, src_positions, dst_start)])

    def moves(self, src_positions: list[int], dst_start: int) -> bool:
        """Whether compacting ``src_positions`` to ``dst_start`` moves any entry."""
        m = len(src_positions)
        return bool(src_positions) and src_positions != list(range(dst_start, dst_start + m)) and not self.released

    def advance(self, n: int) -> None:
        """``n`` more entries were written into the slot after ``length`` (a graph's forward,
        ``specsplit.engine.graphs``): count them."""
        for layer in self.layers:
            layer.length += n

    def detach(self) -> None:
        self.released = True
        for layer in self.layers:
            layer.detach()


class KVPool:
    """``slots`` session caches of ``shape`` allocated once on ``device``; thread-safe. With
    ``scratch``, one more slot (index ``slots``) that no session gets: static-shape forwards
    (``specsplit.engine.graphs``) write their padding sessions there."""

    def __init__(self, shape: PoolShape, slots: int, device: torch.device, scratch: bool = False):
        if slots < 1:
            raise ValueError("a KV pool needs at least one slot")
        self.shape, self.slots, self.device = shape, slots, torch.device(device)
        self.scratch = slots if scratch else None
        size = (slots + scratch, shape.kv_heads, shape.max_len, shape.head_dim)
        # zeros, not empty: a later reader of the whole buffer (a captured graph under a mask) must
        # never meet NaN garbage
        # every layer's K and V in one tensor [layers, 2, slots, Hkv, max_len, D]: per layer, K and V
        # are the two halves of ``kv[l]`` (a graph's body reads a session's keys and values in one
        # gather: specsplit.engine.fused), and a session's compaction moves its entries in every
        # layer at once (``PooledKV.compact``)
        self.all = torch.zeros((shape.layers, 2, *size), dtype=shape.dtype, device=self.device)
        self.kv = list(self.all.unbind(0))
        self.keys = [kv[0] for kv in self.kv]
        self.values = [kv[1] for kv in self.kv]
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._retired: list = []  # sessions that left the store while a request held them
        self._lock = threading.Lock()

    def compact_sessions(self, moves) -> None:
        """Several sessions' compactions (``SessionKV.compact``: (cache, source positions, first
        destination)), every session's entries of every layer moved at once: one host copy of
        the indices, one gather and one copy over the pool, however many sessions (a batched
        verify compacted each of its sessions with its own three)."""
        slots, src, dst = [], [], []
        for kv, positions, start in moves:
            if kv.moves(positions, start):
                slots += [kv.slot] * len(positions)
                src += positions
                dst += range(start, start + len(positions))
        if slots:
            s, a, b = torch.tensor([slots, src, dst], dtype=torch.long, device=self.device)
            # [entries, layers, 2, Hkv, D] gathered (a copy: sources and destinations may overlap), then put
            self.all[:, :, s, :, b] = self.all[:, :, s, :, a]
        for kv, positions, start in moves:
            kv.crop_to(start + len(positions))

    def make_kv(self) -> PooledKV | None:
        """A cache in a free slot, or None when every slot is held (the store then frees one)."""
        with self._lock:
            if not self._free:
                self._reclaim_locked()
            if not self._free:
                return None
            return PooledKV(self, self._free.pop())

    def release(self, session) -> None:
        """``session`` left the store: its slot is free now if no request holds the session,
        else once that request released the session's lock (see ``make_kv``)."""
        with self._lock:
            if not self._free_if_idle_locked(session):
                self._retired.append(session)

    def _free_if_idle_locked(self, session) -> bool:
        kv = session.kv
        if not isinstance(kv, PooledKV) or kv.released:
            return True
        if not session.lock.acquire(blocking=False):  # a request (maybe this thread's) holds it
            return False
        try:
            kv.detach()
            session.draft_tree = None  # a kept draft tree names slots of this cache
            self._free.append(kv.slot)
        finally:
            session.lock.release()
        return True

    def _reclaim_locked(self) -> None:
        self._retired = [s for s in self._retired if not self._free_if_idle_locked(s)]

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def retired(self) -> int:
        """Slots of sessions that left the store while a request held them, not yet reclaimed."""
        with self._lock:
            return len(self._retired)

    @property
    def nbytes(self) -> int:
        return (self.slots + (self.scratch is not None)) * self.shape.slot_bytes
