"""One forward over the new tokens of several sessions: a flattened token batch.

The new tokens of k sessions (each session's sync tokens + tree) are concatenated into one
sequence of T tokens ``[1, T]`` with per-token positions (so RoPE is each session's own);
embeddings, norms, every Linear layer and the lm_head run once over all T tokens, which is where
batching saves (each weight is read once per forward, not once per session). Attention alone is
per session: ``segment_attention`` (registered with transformers' attention interface, wrapping
the model's own attention function) stores each segment's new K/V in its session's own cache
layer, exactly as ``SessionKV.update`` does in a single-session forward, and calls the wrapped
function on that segment's queries, that session's keys/values [1, Hkv, P_i + T_i, D] and that
session's mask [1, 1, T_i, P_i + T_i]. The model itself gets no cache (``use_cache=False``) and
a placeholder 4D mask, which transformers passes through untouched.

So every attention call sees exactly the tensors it sees when the session is verified alone. A
token's result can differ from one-at-a-time only where a Linear layer's row depends on how many
rows share the GEMM: never for the int8 target (``RowInt8Linear`` is row-wise batch-invariant and
its attention is float64), which is therefore bit-identical; float32 BLAS picks kernels by shape,
so there logits agree to rounding (~1e-6) and accepted tokens agree except at exact near-ties.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from specsplit.engine.kvcache import SessionKV
from specsplit.engine.masks import SlidingWindows, TreeInputs, forward_mask

_PREFIX = "specsplit_segments_"
PLAN_KWARG = "specsplit_segments"
UNSUPPORTED_ATTENTION = ("flash", "flex", "paged")  # kernels that take no custom additive mask


@dataclass(frozen=True, slots=True)
class Segment:
    """One session's part of a batched forward: ``token_ids`` (T_i new tokens) on top of
    ``kv`` (P_i cached), ``position_ids`` [T_i] and ``visible`` [T_i, P_i + T_i] bool on the
    engine's device; logits are kept for its last ``keep`` tokens. Or, with ``tree``, the host's
    description of both (``TreeInputs``), the tensors built only for an eager forward."""

    kv: SessionKV
    token_ids: list[int]
    position_ids: torch.Tensor | None
    visible: torch.Tensor | None
    keep: int
    tree: TreeInputs | None = None

    def on_device(self, device: torch.device) -> Segment:
        """This segment with its position ids and visibility as tensors on ``device``."""
        if self.visible is not None:
            return self
        visible, pos = self.tree.on_device(device)
        return replace(self, position_ids=pos, visible=visible)

    def check(self) -> None:
        t = len(self.token_ids)
        if self.position_ids.shape != (t,) or self.visible.shape != (t, self.kv.length + t) or not 0 < self.keep <= t:
            raise ValueError(f"segment of {t} tokens on {self.kv.length} cached: position_ids "
                             f"{tuple(self.position_ids.shape)}, visible {tuple(self.visible.shape)}, keep {self.keep}")


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """What ``segment_attention`` needs per layer (passed through the model's kwargs): the token
    range [bounds[i], bounds[i+1]) of segment i, its cache and its additive mask [1, 1, T_i, P_i+T_i]
    (a sliding-window target's: a dict of them by layer type, ``SlidingWindows.mask``)."""

    bounds: tuple[int, ...]
    caches: tuple[SessionKV, ...]
    masks: tuple[torch.Tensor | dict[str, torch.Tensor], ...]


def layer_mask(mask, module) -> torch.Tensor:
    """A segment's mask for the attention layer ``module``: its layer type's where the mask is
    one per type (the model's ``config.layer_types``)."""
    if isinstance(mask, dict):
        return mask[module.config.layer_types[module.layer_idx]]
    return mask


def _base_attention(name: str, module):
    if name == "eager":  # the model family's own eager function
        return getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def _make_segment_attention(base_name: str):
    def segment_attention(module, query, key, value, attention_mask, *args, specsplit_segments: SegmentPlan | None = None,
                          **kwargs):
        """query [1, H, T, D], key/value [1, Hkv, T, D] (the new tokens of every segment);
        returns ([1, T, H, D], None) as transformers' attention functions do."""
        base = _base_attention(base_name, module)
        plan = specsplit_segments
        if plan is None:
            return base(module, query, key, value, attention_mask, *args, **kwargs)
        pos = kwargs.pop("position_ids", None)
        outs = []
        b = plan.bounds
        for i, (kv, mask) in enumerate(zip(plan.caches, plan.masks)):
            a, z = b[i], b[i + 1]
            # the session's own cache layer, as Cache.update in a forward of this session alone
            k, v = kv.layers[module.layer_idx].update(key[:, :, a:z], value[:, :, a:z])  # [1, Hkv, P_i+T_i, D]
            if pos is not None:
                kwargs["position_ids"] = pos[:, a:z]
            out, _ = base(module, query[:, :, a:z], k, v, layer_mask(mask, module), *args, **kwargs)  # [1, T_i, H, D]
            outs.append(out)
        return torch.cat(outs, dim=1), None  # [1, T, H, D]

    return segment_attention


def register_wrapper(model, prefix: str, make_wrapper) -> str | None:
    """Register ``make_wrapper(base_name)`` (an attention function wrapping ``model``'s own) with
    transformers' attention interface as ``prefix + base_name``, its masks built as for the base;
    returns that name, or None when ``model``'s attention takes no custom additive mask (flash,
    flex, paged kernels) or is already such a wrapper. Shared by the segment, SpecPV-view and
    draft-window wrappers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = model.config._attn_implementation or "eager"
    if base.startswith(prefix) or any(k in base for k in UNSUPPORTED_ATTENTION):
        return None
    if base != "eager" and base not in ALL_ATTENTION_FUNCTIONS:
        return None
    name = prefix + base
    AttentionInterface.register(name, make_wrapper(base))
    if base in ALL_MASK_ATTENTION_FUNCTIONS:  # masks (were one ever built under the wrapper) as for the base
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def segment_attention_name(model) -> str | None:
    """The name under which the segment wrapper of ``model``'s attention is registered, or None
    when its attention takes no custom additive mask (flash, flex, paged kernels)."""
    return register_wrapper(model, _PREFIX, _make_segment_attention)


@contextmanager
def using_attention(model, name: str):
    """Within: ``model``'s attention layers call the attention function registered as ``name``."""
    cfg = model.config
    base = cfg._attn_implementation
    cfg._attn_implementation = name
    try:
        yield
    finally:
        cfg._attn_implementation = base


@dataclass(frozen=True, slots=True)
class FlatBatch:
    """The model inputs of a batched forward, built on the engine's device."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    keep_rows: torch.Tensor  # [K]: rows whose logits are kept, K = sum of keep
    plan: SegmentPlan


def flatten(segments: list[Segment], dtype: torch.dtype, device: torch.device,
            windows: SlidingWindows | None = None) -> FlatBatch:
    """Concatenate the segments' tokens and positions; each segment's mask as an additive one
    (with a target's sliding ``windows``, as its single forwards build them)."""
    bounds, keep, ids = [0], [], []
    for s in segments:
        s.check()
        ids.extend(s.token_ids)
        bounds.append(len(ids))
        keep.extend(range(len(ids) - s.keep, len(ids)))
    return FlatBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.cat([s.position_ids for s in segments])[None],
        keep_rows=torch.tensor(keep, dtype=torch.long, device=device),
        plan=SegmentPlan(tuple(bounds), tuple(s.kv for s in segments),
                         tuple(forward_mask(s.visible, s.position_ids, s.kv.length, dtype, windows) for s in segments)),
    )


def select_fused(requests, batchable) -> list[int]:
    """Indices of the requests that share a batched forward: each session's first request, when
    ``batchable(request)``. A session's later requests in the same batch (and the rest) are
    served alone afterwards, in order: one session's requests never share a forward."""
    fused, seen = [], set()
    for i, req in enumerate(requests):
        sid = getattr(req, "session_id", None)
        if sid not in seen and batchable(req):
            fused.append(i)
        seen.add(sid)
    return fused


def admitted_and_locked(engine, requests, indices: list[int], replies: list):
    """For each candidate request: ``engine.admit`` it and take its session's lock, then run
    ``engine.check_locked``; yields (index, request, what admit returned) with the lock held. A
    refusal becomes that request's reply (and its lock, if taken, is released). Only the engine
    thread takes several session locks, so the order cannot deadlock."""
    from specsplit.engine.store import Session
    from specsplit.errors import SpecError

    for i in indices:
        req = requests[i]
        try:
            admitted = engine.admit(req)
        except SpecError as exc:
            replies[i] = exc.to_reply(req.session_id, req.round)
            continue
        session = next(x for x in admitted if isinstance(x, Session))
        session.lock.acquire()
        try:
            engine.check_locked(session, req.round, req.sync)
        except SpecError as exc:
            session.lock.release()
            replies[i] = exc.to_reply(req.session_id, req.round)
            continue
        yield i, req, admitted
