"""SpecPV partial verification on the target: the per-session partial view, and the attention
function that verifies a tree against it (see ../shared/SPECPV.md and schemas.SpecPVSpec).

The session's full cache (``SessionKV``) holds the tokens encoded against the whole prefix; its
length is the *fully verified* length F. Beside it, ``PartialView`` keeps
- ``summaries``: per layer and KV head, the element-wise max and min of the keys of every
  complete block of the full cache [Hkv, blocks, D], extended as the cache grows (new complete
  blocks only) and cut when it is cropped;
- ``buffer``: a small cache with the K/V of the tokens accepted under partial views since the
  last full verification (``pending``: their ids, i.e. committed[F:-1]), bounded by
  ``buffer_tokens`` plus one tree.

A partial round forwards the tree on top of the buffer. In every layer ``view_attention``
scores the candidate blocks (after the sink, before the window) against the tree's own queries
with Quest's upper bound of q.k over a block (q+ . Kmax + q- . Kmin, max over the tree's nodes
and the query heads of a KV head), takes the top ``retrieval_blocks`` per KV head in token order,
and attends over [sink | retrieved | window | buffer | tree]; keys carry their real positions
(RoPE is applied before caching), so the view is one contiguous KV segment. When the retrieval
budget covers every candidate block the view *is* the prefix, and the logits are bit-identical
to a full verification's. Everything runs on the cache's device; nothing here copies to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schemas import SpecPVSpec
from specsplit.engine.batch import _base_attention, register_wrapper, using_attention
from specsplit.engine.kvcache import SessionKV

_PREFIX = "specsplit_specpv_"


class BlockSummaries:
    """Per layer: Kmax, Kmin [Hkv, capacity, D] of the full cache's complete blocks 0..n-1."""

    def __init__(self, num_layers: int, block_size: int, max_blocks: int, chunk_blocks: int = 64):
        self.block_size, self.max_blocks, self.chunk = block_size, max_blocks, chunk_blocks
        self.n = 0  # blocks summarized
        self.kmax: list[torch.Tensor | None] = [None] * num_layers
        self.kmin: list[torch.Tensor | None] = [None] * num_layers

    def crop(self, length: int) -> None:
        """The full cache was cut to ``length`` tokens: blocks past it are stale."""
        self.n = min(self.n, length // self.block_size)

    def extend(self, kv: SessionKV) -> None:
        """Summarize the complete blocks the full cache gained since the last call."""
        bs, first = self.block_size, self.n
        last = min(kv.length // bs, self.max_blocks)
        if last <= first:
            return
        for i, layer in enumerate(kv.layers):
            keys = layer.keys[0, :, first * bs:last * bs]  # [Hkv, (last-first)*bs, D]
            h, _, d = keys.shape
            blocks = keys.reshape(h, last - first, bs, d)
            self._reserve(i, last, keys)
            self.kmax[i][:, first:last] = blocks.amax(dim=2)
            self.kmin[i][:, first:last] = blocks.amin(dim=2)
        self.n = last

    def _reserve(self, i: int, need: int, like: torch.Tensor) -> None:
        cur = self.kmax[i]
        if cur is not None and cur.shape[1] >= need:
            return
        cap = min(self.max_blocks, -(-need // self.chunk) * self.chunk)
        for name in ("kmax", "kmin"):
            old = getattr(self, name)[i]
            buf = like.new_empty((like.shape[0], cap, like.shape[2]))
            if old is not None:
                buf[:, : self.n] = old[:, : self.n]
            getattr(self, name)[i] = buf

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.kmax, *self.kmin) if t is not None)


@dataclass(frozen=True, slots=True)
class ViewPlan:
    """Where the view's parts lie in a full cache of ``full_len`` tokens (host ints only)."""

    full: SessionKV
    summaries: BlockSummaries
    full_len: int
    sink_end: int  # tokens [0, sink_end) are the sink
    win_start: int  # tokens [win_start, full_len) are the window (block-aligned start)
    first_block: int  # candidate blocks: first_block .. first_block + candidates - 1
    candidates: int
    retrieve: int  # blocks taken per KV head (== candidates: the whole prefix)
    block_size: int

    @property
    def whole_prefix(self) -> bool:
        return self.retrieve >= self.candidates

    @property
    def view_len(self) -> int:
        """Tokens of the full cache the view holds."""
        if self.whole_prefix:
            return self.full_len
        return self.sink_end + self.retrieve * self.block_size + (self.full_len - self.win_start)


def plan_view(spec: SpecPVSpec, full: SessionKV, summaries: BlockSummaries) -> ViewPlan:
    bs, f = spec.block_size, full.length
    sink_end = min(f, spec.sink_blocks * bs)
    win_start = max(sink_end, (max(0, f - spec.window_blocks * bs) // bs) * bs)
    candidates = (win_start - sink_end) // bs
    return ViewPlan(full, summaries, f, sink_end, win_start, sink_end // bs, candidates,
                    min(spec.retrieval_blocks, candidates), bs)


def _retrieved(plan: ViewPlan, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
    """The top blocks of one layer for this tree's queries, per KV head, in token order:
    (K, V) [1, Hkv, retrieve * block_size, D]."""
    s = plan.summaries
    hkv = keys.shape[1]
    q = query[0]  # [H, N, D]; query head h reads KV head h // (H // Hkv) (transformers' repeat_kv)
    q = q.reshape(hkv, -1, q.shape[-1])  # [Hkv, G*N, D]
    lo, hi = plan.first_block, plan.first_block + plan.candidates
    kmax, kmin = s.kmax[layer][:, lo:hi], s.kmin[layer][:, lo:hi]  # [Hkv, C, D]
    # Quest's bound of q.k over a block: sum_d max(q_d * Kmax_d, q_d * Kmin_d)
    bound = q.clamp(min=0) @ kmax.transpose(1, 2) + q.clamp(max=0) @ kmin.transpose(1, 2)  # [Hkv, G*N, C]
    top = bound.amax(dim=1).topk(plan.retrieve, dim=-1).indices.sort(dim=-1).values + lo  # [Hkv, R] blocks
    # whole blocks copied as rows of [blocks, bs * D] (index_select: a memcpy per block, much
    # faster than an element-wise gather of the same tokens; docs/results.md, commit 77b2875)
    bs, r = plan.block_size, plan.retrieve

    def take(x: torch.Tensor) -> torch.Tensor:
        dx = x.shape[-1]
        return torch.stack([x[0, h, : hi * bs].reshape(hi, bs * dx).index_select(0, top[h])
                            for h in range(hkv)]).view(1, hkv, r * bs, dx)

    return take(keys), take(values)


def view_parts(plan: ViewPlan, layer: int, query: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The full cache's part of the view in token order, as pieces to concatenate once:
    (K pieces, V pieces), each [1, Hkv, *, D] (together ``plan.view_len`` tokens)."""
    fl = plan.full.layers[layer]
    keys, values = fl.keys[:, :, : plan.full_len], fl.values[:, :, : plan.full_len]
    if plan.whole_prefix:
        return [keys], [values]
    mid_k, mid_v = _retrieved(plan, layer, query, keys, values)
    return ([keys[:, :, : plan.sink_end], mid_k, keys[:, :, plan.win_start:]],
            [values[:, :, : plan.sink_end], mid_v, values[:, :, plan.win_start:]])


def view_kv(plan: ViewPlan, layer: int, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) [1, Hkv, view_len, D] of the full cache's part of the view."""
    ks, vs = view_parts(plan, layer, query)
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2)


def _make_view_attention(base_name: str):
    last: list = [None]  # (the forward's mask, view_len, the view's mask): one per forward, not per layer

    def view_attention(module, query, key, value, attention_mask, *args, specpv_view: ViewPlan | None = None,
                       **kwargs):
        """key/value [1, Hkv, B+N, D]: the buffer and the tree; attention_mask [1, 1, N, B+N]."""
        base = _base_attention(base_name, module)
        if specpv_view is None:
            return base(module, query, key, value, attention_mask, *args, **kwargs)
        ks, vs = view_parts(specpv_view, module.layer_idx, query)
        k = torch.cat([*ks, key], dim=2)  # [1, Hkv, view_len + B + N, D]: one copy
        v = torch.cat([*vs, value], dim=2)
        n = query.shape[2]
        held = last[0]
        if held is not None and held[0] is attention_mask and held[1] == specpv_view.view_len:
            mask = held[2]  # the same object for every layer (attention functions may plan per mask)
        else:
            mask = torch.cat([attention_mask.new_zeros((*attention_mask.shape[:2], n, specpv_view.view_len)),
                              attention_mask], dim=-1)  # [1, 1, N, view_len + B + N]: the whole view is visible
            last[0] = (attention_mask, specpv_view.view_len, mask)
        return base(module, query, k, v, mask, *args, **kwargs)

    return view_attention


def attention_name(model) -> str | None:
    """The name under which the partial-view wrapper of ``model``'s attention is registered, or
    None when its attention cannot take the view (kernels without custom additive masks: flash,
    flex, paged). Any other registered function (sdpa, eager, the int8 target's float64
    attention) is wrapped: it gets the view's keys, values and mask as if they were the cache's."""
    return register_wrapper(model, _PREFIX, _make_view_attention)


# within: ``model``'s attention layers call the partial-view wrapper (which behaves as the model's
# own attention unless a ``specpv_view`` is passed to the forward)
view_attention_of = using_attention


class PartialView:
    """A session's partial-view state beside its full cache (bounded: the buffer holds at most
    ``buffer_tokens`` + one tree; summaries one row per block of the session's capacity)."""

    def __init__(self, spec: SpecPVSpec, num_layers: int, max_tree_nodes: int, max_session_tokens: int):
        self.spec = spec
        self.pending: list[int] = []  # ids of the buffered tokens: committed[F:-1]
        self.buffer = SessionKV(num_layers, spec.buffer_tokens + max_tree_nodes,
                                chunk=min(256, spec.buffer_tokens + max_tree_nodes))
        self.summaries = BlockSummaries(num_layers, spec.block_size, max_session_tokens // spec.block_size + 1)
        self.rounds_since_full = 0
        # exact mode: partial rounds between full ones; starts at 1, doubles after a refresh that
        # confirmed everything (up to refresh_every) and halves after a rollback (slow start), so
        # a view that disagrees with the full cache wastes few provisional tokens
        self.interval = 1 if spec.exact else spec.refresh_every
        self.cooldown = 0  # exact mode: full rounds left before the view is tried again
        self.fallbacks = 0  # rounds verified fully because an invariant failed (the first is logged)

    def logical_len(self, full_len: int) -> int:
        return full_len + len(self.pending)

    def crop(self, full: SessionKV, length: int) -> None:
        """The session keeps its first ``length`` tokens (a CacheSync's base_len)."""
        f = full.length
        if length < f:
            full.crop_to(length)
            self.summaries.crop(length)
            self.reset_buffer()
        else:
            keep = min(len(self.pending), length - f)
            del self.pending[keep:]
            self.buffer.crop_to(keep)

    def after_refresh(self, rolled_back: bool) -> None:
        """A full verification ran: adapt the exact mode's refresh interval (and after a rollback
        at interval 1, verify fully for ``refresh_every`` rounds before trying the view again)."""
        if not (self.spec.exact and self.pending):
            return
        if rolled_back and self.interval == 1:  # even one partial round disagrees: rest a while
            self.cooldown = self.spec.refresh_every
        self.interval = max(1, self.interval // 2) if rolled_back else min(self.spec.refresh_every, 2 * self.interval)

    def reset_buffer(self) -> None:
        """After a full verification (or a crop into the full cache): nothing is buffered."""
        self.pending.clear()
        self.buffer.crop_to(0)
        self.rounds_since_full = 0

    def check(self, full: SessionKV) -> str | None:
        """An invariant that fails, in words, or None."""
        if self.buffer.length != len(self.pending):
            return f"buffer holds {self.buffer.length} tokens for {len(self.pending)} pending ids"
        if self.summaries.n * self.spec.block_size > full.length:
            return f"{self.summaries.n} blocks summarized beyond the full cache's {full.length} tokens"
        return None

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes + self.summaries.nbytes
