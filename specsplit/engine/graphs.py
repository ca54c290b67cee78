"""Forwards over the KV pool's slots at static shapes, replayed as CUDA graphs.

A forward of B sessions x at most T new tokens each, over caches of at most L entries, runs at a
bucket's shape (B, T, L: the smallest bucket of each that fits; and which inputs it copies)
through one body whose every tensor has a fixed address, so on CUDA it is captured once per
bucket (``torch.cuda.CUDAGraph``)
and replayed: one launch instead of a few hundred kernel launches, which is what an eager forward
of a small model spends its time on (docs/results.md, GPU).

Per (B, T) the static inputs are ``meta`` [B, 2T+2] (each row: the token ids, padded; their
position ids; the session's pool slot; its cache length P) and the new tokens' visibility: a
forward whose sessions describe their new tokens on the host (``Segment.tree``: the target's
trees, every cached entry visible) copies ``meta`` and ``new_vis`` [B, T, T] in two host copies
and the body builds the mask; any other copies each session's visibility [t, P+t] into ``vis``
[B, T, Lmax]. The output is ``logits`` [B, T, V]. The body is ``specsplit.engine.fused``'s decoder
where it runs the model (llama, qwen2, qwen3: ~16-18 kernels a layer on CUDA; with
``SPECSPLIT_CUDA_GRAPH_BODY=triton`` ~9, through ``specsplit.engine.kernels``), else the model's own
modules (``transformers``: ~48). Each layer writes the new K/V into the session's slot at P..; the
torch bodies read its slot's first L entries (a gather of (slot, KV head) runs) and attend under
an additive mask, the Triton body's attention reads the slot in place up to P + T.
Padding tokens of a session land after its length (nothing reads them, the next forward
overwrites them); padding sessions run on the pool's scratch slot, which no session holds.
Nothing of a call is read on the host inside the body.

Mode ``cuda`` captures and replays; mode ``static`` runs the same body eagerly (how the CPU tests
check it against the engine's plain forward). A forward that does not fit a bucket (more tokens
or sessions, a cache without a pool slot, attention kwargs, another attention function) returns
None and the engine runs it eagerly; so does every bucket whose capture failed (logged once).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache

from specsplit.engine.batch import Segment, using_attention
from specsplit.engine.fused import build as build_fused
from specsplit.engine.kvpool import KVPool, PooledKV
from specsplit.engine.masks import FULL, SLIDING, SlidingWindows
from specsplit.models.attention import (
    ACCEL_MAX_SCORES, ACCEL_VALUE_CHUNK, GQA_ATTENTION, grouped_attention, weighted_values,
)

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # new tokens per session per forward
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)  # sessions per forward
MIN_KEYS = 256  # the smallest cache bucket; then doubling up to the pool's slot length
WARM_KEYS = 2048  # a worker captures one session's graphs up to this cache bucket at start (``warm``)
MODES = ("cuda", "static")
# the decoder through Triton kernels, their GEMMs too (engine.kernels, engine.matmul), in fewer torch kernels
# (engine.fused), or the model's modules
BODIES = ("triton_gemm", "triton", "fused", "transformers")
GRAPH_ATTENTION = "specsplit_graph_gqa"
GROUPED = ("sdpa", GQA_ATTENTION)  # attention a graph's body replaces with grouped matmuls


def graph_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """A bucket's attention, grouped matmuls for every forward: query [B, Hq, M, D] against the
    bucket's key/value [B, Hkv, L, D] under the additive mask [B, 1, M, L]; returns ([B, M, Hq, D],
    None). The query heads of one KV head share one matmul; scores and softmax in float32 (as
    sdpa keeps them), probabilities x values in the values' dtype (``weighted_values``: chunks
    summed in float32). sdpa's masked kernel spent ~40 us a layer on one query over 1K keys and
    copied every KV head per query head for more (repeat_kv); the extra launches here cost
    nothing in a replay (docs/results.md, GPU)."""
    b, hq, m, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    chunk = 0 if query.device.type == "cpu" else ACCEL_VALUE_CHUNK
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None:  # Gemma 2's softcapping, gpt-oss's sinks
        return grouped_attention(query, key, value, attention_mask, scaling, torch.float32, chunk,
                                 kwargs.get("softcap"), kwargs.get("s_aux")), None
    q = query.float().reshape(b, hkv, (hq // hkv) * m, d)
    scores = torch.matmul(q, key.float().transpose(-1, -2)).view(b, hkv, hq // hkv, m, length)
    scores.mul_(d ** -0.5 if scaling is None else scaling).add_(attention_mask[..., :length][:, :, None].float())
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(b, hkv, (hq // hkv) * m, length)
    out = weighted_values(probs, value, chunk).view(b, hq, m, d)
    return out.transpose(1, 2).contiguous(), None


def register_graph_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(GRAPH_ATTENTION, graph_attention)
    return GRAPH_ATTENTION


def smallest(n: int, buckets) -> int | None:
    """The first of ``buckets`` (ascending) that is at least ``n``, or None."""
    return next((b for b in buckets if b >= n), None)


def key_buckets(max_len: int) -> tuple[int, ...]:
    """Cache lengths a forward is shaped to: MIN_KEYS, doubling, and ``max_len`` last."""
    out, b = [], MIN_KEYS
    while b < max_len:
        out.append(b)
        b *= 2
    return (*out, max_len)


class _SlotCache(Cache):
    """The cache a bucket's body hands the model: each layer's ``update`` writes the new K/V
    [B, Hkv, T, D] into the pool at ``rows`` and returns the first ``keys`` entries of the
    sessions' slots [B, Hkv, keys, D] (``heads``: their (slot, KV head) runs, slot x Hkv + head)."""

    def __init__(self, pool: KVPool, rows: torch.Tensor, heads: torch.Tensor, keys: int):
        super().__init__(layers=[])
        self.pool, self.rows, self.heads, self.keys = pool, rows, heads, keys

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        out = []
        for buf, new in ((self.pool.keys[layer_idx], key_states), (self.pool.values[layer_idx], value_states)):
            s, h, max_len, d = buf.shape
            buf.view(-1, d).index_copy_(0, self.rows, new.reshape(-1, d).to(buf.dtype))
            # rows of whole (slot, head) runs: one contiguous copy of keys x D per KV head of each session
            runs = buf.view(s * h, max_len * d)[:, : self.keys * d].index_select(0, self.heads)
            out.append(runs.view(-1, h, self.keys, d))
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # never asked for when positions and a 4D mask are passed


@dataclass
class _Inputs:
    """The static buffers of one (B, T): every bucket (B, T, L, compact) reads and writes these."""

    meta: torch.Tensor  # [B, 2T+2] int64: token ids, position ids, slot, cache length
    vis: torch.Tensor | None  # [B, T, Lmax] bool: what each new token sees (the general variant; made on first use)
    new_vis: torch.Tensor  # [B, T, T] bool: among the new tokens (compact: every cached entry seen)
    logits: torch.Tensor  # [B, T, V] in the model's dtype


class GraphRunner:
    """Forwards of an engine's ``model`` over ``pool`` at bucketed static shapes (``mode``:
    "cuda" replays captured graphs, "static" runs the bodies eagerly)."""

    def __init__(self, model, pool: KVPool, vocab_size: int, mode: str = "cuda", log=None, body: str = "fused",
                 gemm_tune: bool = True, windows: SlidingWindows | None = None, one_session: bool = False):
        if mode not in MODES:
            raise ValueError(f"graph mode {mode!r}: one of {MODES}")
        if body not in BODIES:
            raise ValueError(f"graph body {body!r}: one of {BODIES}")
        if pool.scratch is None:
            raise ValueError("CUDA graphs need a KV pool with a scratch slot")
        if mode == "cuda" and pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {pool.device}")
        self.model, self.pool, self.vocab_size, self.mode, self.log = model, pool, vocab_size, mode, log
        self.device, self.dtype = pool.device, pool.shape.dtype
        self.attention = model.config._attn_implementation  # the model's: a forward on another runs eagerly
        self.body_attention = register_graph_attention() if self.attention in GROUPED else self.attention
        # the decoder in fewer kernels (specsplit.engine.fused; through Triton's where asked and they
        # run) where it runs this model, else its modules
        # sliding windows: the modules' body, under the windows' masks (``_window_masks``);
        # one_session: a rotary type recomputed per forward (masks.forward_dependent_rope)
        self.windows, self.one_session = windows, one_session
        if body == "transformers" or windows is not None:
            self.fused, self.fused_not = None, ("SPECSPLIT_CUDA_GRAPH_BODY=transformers" if windows is None
                                                else f"sliding-window attention ({windows.window} tokens)")
        else:
            self.fused, self.fused_not = build_fused(model, pool, kernels=body.startswith("triton"),
                                                     gemm=body == "triton_gemm", tune=gemm_tune)
        self.body = ("transformers" if self.fused is None else "fused" if self.fused.kernels is None
                     else "triton_gemm" if self.fused.gemm else "triton")
        if log is not None:
            log.info("graph_body", body=self.body, asked=body, why=self.fused_not)
            if self.body == "triton_gemm" and self.fused.tune and self.fused.matmul.tuned():
                log.info("gemm_tiles_tuned", tiles=self.fused.matmul.tuned())
        self.max_len = pool.shape.max_len
        self.key_buckets = key_buckets(self.max_len)
        self._inputs: dict[tuple[int, int], _Inputs] = {}  # at most |BATCH| x |TOKEN| entries
        # (B, T, L, compact) -> graph; None: its capture failed. At most twice |BATCH| x |TOKEN| x |keys|
        self._graphs: dict[tuple[int, int, int, bool], torch.cuda.CUDAGraph | None] = {}
        self._arange = torch.arange(max(self.max_len, max(TOKEN_BUCKETS)), dtype=torch.long, device=self.device)
        self._heads = torch.arange(pool.shape.kv_heads, dtype=torch.long, device=self.device)
        self._mempool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self._lock = threading.Lock()
        # a body holds float32 scores [B, Hq, T, L] (the fused body its mask too): larger shapes run
        # eagerly, where attention over many keys takes sdpa's memory-efficient kernel
        self.query_heads = int(model.config.get_text_config(decoder=True).num_attention_heads)
        # (the Triton body holds neither: its attention reads the pool in place, block by block)
        self.max_scores = float("inf") if self.body.startswith("triton") else ACCEL_MAX_SCORES
        self.captures, self.capture_ms, self.served = 0, 0.0, 0  # served: forwards run through a bucket
        self._recent: deque[tuple[float, float]] = deque(maxlen=64)  # (perf_counter at a capture's start, ms)

    # ---- shapes ------------------------------------------------------------------------
    def bucket(self, items) -> tuple[int, int, int, bool] | None:
        """(B, T, L, compact) for ``items``, or None when they do not fit one. Compact: every
        item describes its new tokens on the host (``Segment.tree``)."""
        if self.one_session and len(items) > 1:
            return None
        b = smallest(len(items), BATCH_BUCKETS)
        t = smallest(max(len(it.token_ids) for it in items), TOKEN_BUCKETS)
        if b is None or t is None:
            return None
        keys = smallest(max(it.kv.length for it in items) + t, self.key_buckets)
        if keys is None or b * self.query_heads * t * keys > self.max_scores:
            return None
        return b, t, keys, all(it.tree is not None for it in items)

    def fits(self, items, model_kwargs) -> bool:
        return (not model_kwargs and self.model.config._attn_implementation == self.attention
                and all(isinstance(it.kv, PooledKV) and not it.kv.released and it.kv.pool is self.pool
                        for it in items))

    # ---- a forward ---------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, items: list[Segment], **model_kwargs) -> list[torch.Tensor] | None:
        """Per item float32 logits of its last ``keep`` tokens [keep, V] (on the device), every
        cache grown by its tokens, as the engine's forward would; None (nothing moved) when the
        items fit no bucket or its capture failed."""
        if not items or not self.fits(items, model_kwargs):
            return None
        shape = self.bucket(items)
        if shape is None:
            return None
        with self._lock:
            b, t, keys, compact = shape
            inp = self._buffers(b, t, compact)
            graph = self._graph(shape, inp) if self.mode == "cuda" else None
            if self.mode == "cuda" and graph is None:
                return None
            self._fill(inp, items, t, keys, compact)
            if graph is not None:
                graph.replay()
            else:
                self._body(inp, *shape)
            self.served += 1
            for it in items:
                it.kv.advance(len(it.token_ids))
            if len(items) == 1:
                n = len(items[0].token_ids)
                # a copy even in float32: the next replay overwrites the static buffer
                return [inp.logits[0, n - items[0].keep: n].to(torch.float32, copy=True)]
            rows = [i * t + r for i, it in enumerate(items)
                    for r in range(len(it.token_ids) - it.keep, len(it.token_ids))]
            kept = inp.logits.view(b * t, -1).index_select(0, torch.tensor(rows, device=self.device)).float()
            return list(kept.split([it.keep for it in items]))

    def _buffers(self, b: int, t: int, compact: bool) -> _Inputs:
        inp = self._inputs.get((b, t))
        if inp is None:
            dev = self.device
            meta = torch.zeros(b, 2 * t + 2, dtype=torch.long, device=dev)
            meta[:, 2 * t] = self.pool.scratch
            inp = self._inputs[(b, t)] = _Inputs(
                meta=meta, vis=None, new_vis=torch.zeros(b, t, t, dtype=torch.bool, device=dev),
                logits=torch.zeros(b, t, self.vocab_size, dtype=self.dtype, device=dev))
        if not compact and inp.vis is None:  # B x T x the slot's length: only where a forward needs it
            inp.vis = torch.zeros(b, t, self.max_len, dtype=torch.bool, device=self.device)
        return inp

    def _fill(self, inp: _Inputs, items, t: int, keys: int, compact: bool) -> None:
        """The call's values into the static buffers. One host copy for ids, positions, slots and
        lengths (padding sessions: the scratch slot, length 0); compact: one more for the new
        tokens' visibility; else per session its positions and visibility (device to device)."""
        meta = np.zeros(tuple(inp.meta.shape), dtype=np.int64)
        meta[:, 2 * t] = self.pool.scratch
        new_vis = np.zeros(tuple(inp.new_vis.shape), dtype=bool) if compact else None
        for i, it in enumerate(items):
            n = len(it.token_ids)
            meta[i, :n] = it.token_ids
            meta[i, 2 * t], meta[i, 2 * t + 1] = it.kv.slot, it.kv.length
            if compact:
                meta[i, t:t + n] = it.tree.positions()
                new_vis[i, :n, :n] = it.tree.new_visibility()
        inp.meta.copy_(torch.from_numpy(meta))
        if compact:
            inp.new_vis.copy_(torch.from_numpy(new_vis))
            return
        inp.vis[:, :, :keys].zero_()
        for i, it in enumerate(items):
            n, p = len(it.token_ids), it.kv.length
            inp.vis[i, :n, : p + n].copy_(it.visible)
            inp.meta[i, t:t + n].copy_(it.position_ids)

    def _visibility(self, inp: _Inputs, lengths: torch.Tensor, b: int, t: int, keys: int) -> torch.Tensor:
        """[B, T, keys] bool from the compact inputs: every cached entry (column < length), and
        among the new tokens (columns length.. length+T) what ``new_vis`` says."""
        rel = self._arange[:keys][None, :] - lengths[:, None]  # [B, L]: column - length
        new = inp.new_vis.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, keys))  # [B, T, L]
        return (rel < 0)[:, None, :] | (new & (rel >= 0)[:, None, :] & (rel < t)[:, None, :])

    def _body(self, inp: _Inputs, b: int, t: int, keys: int, compact: bool) -> None:
        """The forward at shape (b, t, keys) from the static inputs into ``inp.logits``."""
        ids, pos, slots, lengths = inp.meta[:, :t], inp.meta[:, t:2 * t], inp.meta[:, 2 * t], inp.meta[:, 2 * t + 1]
        if self.body.startswith("triton"):  # visibility read inside the attention kernel
            self.fused.forward_kernels(ids, pos, slots, lengths, inp.new_vis if compact else inp.vis, compact, keys,
                                       inp.logits)
            return
        where = lengths[:, None] + self._arange[:t]  # [B, T] cache positions the new tokens take
        visible = self._visibility(inp, lengths, b, t, keys) if compact else inp.vis[:, :, :keys]
        if self.fused is not None:
            self.fused.forward(ids, pos, slots, where, visible, keys, inp.logits)
            return
        heads, max_len = self._heads, self.max_len
        runs = slots[:, None] * heads.numel() + heads[None, :]  # [B, Hkv]
        rows = runs[:, :, None] * max_len + where[:, None, :]  # [B, Hkv, T]
        mask = self._mask(visible)
        if self.windows is not None:
            mask = self._window_masks(visible, mask, pos, lengths, t, keys)
        with using_attention(self.model, self.body_attention):
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask,
                             past_key_values=_SlotCache(self.pool, rows.reshape(-1), runs.reshape(-1), keys),
                             use_cache=True, logits_to_keep=0)
        inp.logits.copy_(out.logits)

    def _mask(self, visible: torch.Tensor) -> torch.Tensor:
        """Additive [B, 1, T, keys] of a visibility [B, T, keys]."""
        mask = torch.zeros(visible.shape[0], 1, *visible.shape[1:], dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible[:, None], torch.finfo(self.dtype).min)

    def _window_masks(self, visible, full, pos, lengths, t: int, keys: int):
        """The attention_mask under sliding windows, as ``SlidingWindows.mask`` builds a single
        forward's: a key at position k hidden from a query at q once q - k >= window. Column c
        holds position c below the session's length and the new token c - length's position
        after it; all on the device, at the bucket's shapes."""
        cols = self._arange[:keys]
        rel = cols[None, :] - lengths[:, None]  # [B, keys]
        new = (rel >= 0) & (rel < t)
        keypos = torch.where(new, pos.gather(1, rel.clamp(0, t - 1)), cols[None, :])  # [B, keys]
        near = visible & (pos[:, :, None] - keypos[:, None, :] < self.windows.window)  # [B, T, keys]
        sliding = self._mask(near)
        return {FULL: full, SLIDING: sliding} if self.windows.per_layer else sliding

    def warm(self, compact: bool, max_keys: int = WARM_KEYS) -> int:
        """Capture at start the graphs one session's forwards take first (every token bucket,
        cache buckets up to ``max_keys``; ``compact``: forwards that describe their tokens on the
        host, the target's trees; else the draft's), so a worker's first requests do not wait
        for captures; the captures made ("cuda" mode only: "static" has none)."""
        if self.mode != "cuda":
            return 0
        t0, before = time.perf_counter(), self.captures
        with self._lock:
            for t in TOKEN_BUCKETS:
                for keys in self.key_buckets:
                    if keys <= max(max_keys, self.key_buckets[0]) and self.query_heads * t * keys <= self.max_scores:
                        self._graph((1, t, keys, compact), self._buffers(1, t, compact))
        if self.log is not None:
            self.log.info("cuda_graphs_warmed", captures=self.captures - before,
                          ms=round((time.perf_counter() - t0) * 1e3, 1))
        return self.captures - before

    def capture_ms_since(self, t0: float) -> float:
        """Milliseconds of captures (failed ones too) that started at ``t0`` (``time.perf_counter``)
        or later: a one-time cost the engine leaves out of the forward times it reports, from
        which the orchestrator's cost model prices each forward size (on the H200 a capture took
        ~65 ms against a 4.6 ms replay: one such sample, weighted 0.15, prices its size ~3x too
        high, and a size priced too high is not chosen, so not re-measured)."""
        return sum(ms for start, ms in tuple(self._recent) if start >= t0)

    def _graph(self, shape, inp: _Inputs):
        """The bucket's graph, captured on first use (a warm-up run on the scratch slot first);
        None when its capture failed (then its forwards run eagerly)."""
        if shape in self._graphs:
            return self._graphs[shape]
        b, t, keys, compact = shape
        t0 = time.perf_counter()
        graph = self._capture(shape, inp)
        self._graphs[shape] = graph
        ms = (time.perf_counter() - t0) * 1e3
        self.captures += 1
        self.capture_ms += ms
        self._recent.append((t0, ms))
        if self.log is not None and graph is not None:
            self.log.info("cuda_graph_captured", batch=b, tokens=t, keys=keys, compact=compact, ms=round(ms, 1))
        return graph

    def _capture(self, shape, inp: _Inputs):
        """``shape``'s graph over ``inp``, or None when its capture failed (logged)."""
        b, t, keys, compact = shape
        try:
            inp.meta[:, 2 * t] = self.pool.scratch
            inp.meta[:, 2 * t + 1] = 0
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._body(inp, *shape)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                self._body(inp, *shape)
        except Exception as exc:  # e.g. a host sync inside the model: this bucket stays eager
            graph = None
            if self.log is not None:
                self.log.warning("cuda_graph_capture_failed", batch=b, tokens=t, keys=keys, compact=compact,
                                 error=f"{type(exc).__name__}: {exc}"[:500], action="eager forwards for this shape")
        return graph

    def describe(self) -> dict:
        tiles = self.fused.matmul.tuned() if self.fused is not None and self.fused.gemm and self.fused.tune else {}
        return {"mode": self.mode, "body": self.body, **({"gemm_tiles": tiles} if tiles else {}),
                "captures": self.captures, "capture_ms": round(self.capture_ms, 1),
                "failed": sum(g is None for g in self._graphs.values()), "served": self.served}
