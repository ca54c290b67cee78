"""Attention masks and positions for tree forwards, built on the engine's device.

The index lists come from ``specsplit.tree`` (host, pure Python); each tensor here is created
on ``device`` in one operation, so nothing on the forward path is built on the host and copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specsplit.errors import ModelRefused
from specsplit.tree import ancestor_pairs


def tree_visibility(parents, device: torch.device) -> torch.Tensor:
    """[N, N] bool: m[i, j] is True iff j is i or an ancestor of i."""
    n = len(parents)
    rows, cols = ancestor_pairs(parents)
    m = torch.zeros(n, n, dtype=torch.bool, device=device)
    m[torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(cols, dtype=torch.long, device=device)] = True
    return m


def linear_then_tree(n_linear: int, parents, device: torch.device) -> torch.Tensor:
    """[S+N, S+N] bool visibility of S linear tokens (causal) followed by a tree on top of them."""
    n = len(parents)
    total = n_linear + n
    vis = torch.zeros(total, total, dtype=torch.bool, device=device)
    if n_linear:
        vis[:n_linear, :n_linear] = torch.ones(n_linear, n_linear, dtype=torch.bool, device=device).tril()
        vis[n_linear:, :n_linear] = True
    vis[n_linear:, n_linear:] = tree_visibility(parents, device)
    return vis


def causal(t: int, cached: int, device: torch.device) -> torch.Tensor:
    """[T, P+T] bool: T linear tokens on top of P cached ones."""
    vis = torch.ones(t, cached + t, dtype=torch.bool, device=device)
    vis[:, cached:] = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return vis


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility [T, P+T] -> additive float mask [1, 1, T, P+T] (0 allowed, dtype min
    elsewhere), on the visibility's device."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def positions(depths, start: int, device: torch.device) -> torch.Tensor:
    """Position ids of tree nodes: cache length + depth. # [N]"""
    return torch.tensor(depths, dtype=torch.long, device=device) + start


@dataclass(frozen=True, slots=True)
class TreeInputs:
    """A forward's new tokens as the host describes them: ``linear`` tokens at positions
    ``first``.. on top of ``first`` cached entries (every new token sees all of those), then a
    tree (``parents``, ``depths``) rooted after them. ``on_device`` builds the tensors an eager
    forward takes; a graph replay (``specsplit.engine.graphs``) copies ``positions`` and
    ``new_visibility`` to the device in one packed copy instead."""

    first: int
    linear: int
    parents: Sequence[int]
    depths: Sequence[int]

    @property
    def tokens(self) -> int:
        return self.linear + len(self.parents)

    def positions(self) -> list[int]:
        start = self.first + self.linear  # the root's position
        return [*range(self.first, start), *(start + d for d in self.depths)]

    def new_visibility(self) -> np.ndarray:
        """[T+N, T+N] bool among the new tokens: causal over the linear ones, which every tree
        node sees, and each node its ancestors and itself."""
        s, n = self.linear, len(self.parents)
        vis = np.zeros((s + n, s + n), dtype=bool)
        vis[:s, :s] = np.tri(s, dtype=bool)
        vis[s:, :s] = True
        rows, cols = ancestor_pairs(self.parents)
        vis[np.asarray(rows, dtype=np.intp) + s, np.asarray(cols, dtype=np.intp) + s] = True
        return vis

    def on_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Visibility [T+N, P+T+N] bool and position ids [T+N] on ``device``."""
        start, n = self.first + self.linear, len(self.parents)
        visible = torch.ones(self.linear + n, start + n, dtype=torch.bool, device=device)
        visible[:, self.first:] = linear_then_tree(self.linear, self.parents, device)
        pos = torch.cat([torch.arange(self.first, start, dtype=torch.long, device=device),
                         positions(self.depths, start, device)])
        return visible, pos


FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True, slots=True)
class SlidingWindows:
    """A model's sliding-window attention, which the engines' own masks must carry: a query at
    position q sees a key at position k only if ``q - k < window`` (transformers'
    ``sliding_window_overlay``). ``per_layer``: the model reads a mask per layer type
    (``config.layer_types``, some layers full, some sliding) from a dict, else its every layer
    slides (Mistral, Phi-3) and takes one mask."""

    window: int
    per_layer: bool

    def mask(self, visible: torch.Tensor, position_ids: torch.Tensor, cached: int, dtype: torch.dtype):
        """The ``attention_mask`` of a forward of T new tokens (visibility [T, P+T], positions
        [T]) on top of ``cached`` entries whose positions are their slots (a target's committed
        cache): the additive mask, or a dict of them by layer type."""
        keys = torch.cat([torch.arange(cached, dtype=torch.long, device=visible.device), position_ids])
        near = visible & (position_ids[:, None] - keys[None, :] < self.window)
        sliding = additive_mask(near, dtype)
        return {FULL: additive_mask(visible, dtype), SLIDING: sliding} if self.per_layer else sliding


def forward_mask(visible: torch.Tensor, position_ids: torch.Tensor, cached: int, dtype: torch.dtype,
                 windows: SlidingWindows | None):
    """The ``attention_mask`` of a forward of T new tokens on ``cached`` entries: the additive
    mask of ``visible`` [T, P+T], or the ``windows``' masks where a key can be out of reach."""
    if windows is not None and cached + len(position_ids) > windows.window:
        return windows.mask(visible, position_ids, cached, dtype)
    return additive_mask(visible, dtype)


def sliding_windows(config, max_positions: int) -> SlidingWindows | None:
    """The sliding windows of a model ``config`` that a session of up to ``max_positions`` tokens
    can reach (a window at least that long hides nothing: None), or None where no layer slides.
    Raises ModelRefused for a layer type the engines' masks do not describe (chunked, linear)."""
    if config is None:  # a model that builds its own state (llama.cpp's)
        return None
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        other = sorted(set(types) - {FULL, SLIDING})
        if other:
            raise ModelRefused(f"the engines cannot run layer types {other}, only {FULL} and {SLIDING} layers")
        if SLIDING not in types:
            return None
    if not isinstance(window, int) or window <= 0 or window >= max_positions:
        return None
    return SlidingWindows(window, per_layer=types is not None)


DYNAMIC_ROPE = ("dynamic", "longrope")  # transformers recomputes their frequencies in each forward


def forward_dependent_rope(config) -> str | None:
    """The rotary type of ``config`` whose frequencies transformers recomputes from a forward's
    largest position (dynamic NTK, LongRoPE: Phi-3 and Phi-4 mini), else None. One forward over
    several sessions would give each the frequencies of the session furthest along, so such a
    model's sessions are forwarded one at a time."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_type = bool(params) and all(isinstance(v, dict) for v in params.values())  # by layer type
    for p in (params.values() if per_type else [params]):
        kind = p.get("rope_type") or p.get("type")
        if kind in DYNAMIC_ROPE:
            return kind
    return None
