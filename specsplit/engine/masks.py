"""Attention masks and positions for tree forwards, built on the engine's device.

The index lists come from ``specsplit.tree`` (host, pure Python); each tensor here is created
on ``device`` in one operation, so nothing on the forward path is built on the host and copied.
"""

from __future__ import annotations

import torch

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
