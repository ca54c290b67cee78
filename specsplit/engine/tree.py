"""Tree math, in one module: validation, depths, positions, the ancestor mask, root->leaf paths.

A tree is flat: ``parents[i]`` is the index of node i's parent, ``parents[0] == -1`` and
``0 <= parents[i] < i`` (topological order). Node 0 is the root, the newest committed token.
Every other module asks this one for depths, masks and paths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from schemas import ErrorCode, FlatTree

if TYPE_CHECKING:  # torch is imported lazily so torch-free processes can use the pure parts
    import torch


class SpecError(Exception):
    """A typed engine error; ``to_reply`` turns it into an ErrorReply on the wire."""

    def __init__(self, code: ErrorCode, message: str, *, retryable: bool | None = None):
        super().__init__(message)
        self.code = code
        self.retryable = retryable

    def to_reply(self, session_id: str | None = None, round: int | None = None):
        from schemas import ErrorReply

        kw = {} if self.retryable is None else {"retryable": self.retryable}
        return ErrorReply.of(self.code, str(self), session_id=session_id, round=round, **kw)


class TreeError(SpecError):
    """An invalid tree (BAD_REQUEST)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.BAD_REQUEST, message)


@dataclass(frozen=True, slots=True)
class TreeLayout:
    """Validated structure of a flat tree."""

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)


def check_parents(parents: list[int] | tuple[int, ...], *, max_nodes: int, max_depth: int) -> TreeLayout:
    """Validate parent order and caps; return depths and children. Raises TreeError."""
    n = len(parents)
    if n == 0:
        raise TreeError("tree has no nodes")
    if n > max_nodes:
        raise TreeError(f"tree has {n} nodes, limit is {max_nodes}")
    if parents[0] != -1:
        raise TreeError(f"parents[0] must be -1, got {parents[0]}")
    depths = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        p = parents[i]
        if not isinstance(p, int) or not 0 <= p < i:
            raise TreeError(f"parents[{i}] = {p} must satisfy 0 <= parent < {i} (topological order)")
        depths[i] = depths[p] + 1
        if depths[i] > max_depth:
            raise TreeError(f"node {i} has depth {depths[i]}, limit is {max_depth}")
        children[p].append(i)
    return TreeLayout(tuple(parents), tuple(depths), tuple(tuple(c) for c in children))


def check_token_ids(token_ids, vocab_size: int, what: str = "token") -> None:
    """All ids in [0, vocab_size) or TreeError."""
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            raise TreeError(f"{what} id {t} at index {i} is outside the vocabulary [0, {vocab_size})")


def check_child_dists(tree: FlatTree, layout: TreeLayout, vocab_size: int, tol: float = 1e-3) -> None:
    """A sampled tree carries, for every node with children, the distribution its children were
    drawn from; each child token must have positive probability there."""
    if not tree.sampled:
        return
    for v in range(layout.num_nodes):
        ids, probs = tree.child_dist_ids[v], tree.child_dist_probs[v]
        if not layout.children[v]:
            continue
        if not ids:
            raise TreeError(f"node {v} has children but no draft distribution")
        check_token_ids(ids, vocab_size, what=f"distribution of node {v}:")
        if len(set(ids)) != len(ids):
            raise TreeError(f"distribution of node {v} repeats a token id")
        if any(not math.isfinite(p) or p < 0.0 for p in probs):
            raise TreeError(f"distribution of node {v} has a negative or non-finite probability")
        if abs(sum(probs) - 1.0) > tol:
            raise TreeError(f"distribution of node {v} sums to {sum(probs):.6f}, not 1")
        support = dict(zip(ids, probs))
        for c in layout.children[v]:
            if support.get(tree.token_ids[c], 0.0) <= 0.0:
                raise TreeError(f"child {c} (token {tree.token_ids[c]}) has zero draft probability at node {v}")


def validate_tree(tree: FlatTree, *, vocab_size: int, max_nodes: int, max_depth: int) -> TreeLayout:
    """The one validation of an incoming tree: structure, caps, token range, distributions."""
    layout = check_parents(tree.parents, max_nodes=max_nodes, max_depth=max_depth)
    check_token_ids(tree.token_ids, vocab_size)
    check_child_dists(tree, layout, vocab_size)
    return layout


def depths_of(parents) -> list[int]:
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def positions(depths, start: int) -> torch.Tensor:
    """Position ids of tree nodes: cache length + depth. # [N]"""
    import torch

    return torch.tensor(depths, dtype=torch.long) + start


def ancestor_matrix(parents) -> torch.Tensor:
    """[N, N] bool: m[i, j] is True iff j is i or an ancestor of i."""
    import torch

    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if i:
            m[i] = m[parents[i]]
        m[i, i] = True
    return m


def linear_then_tree(n_linear: int, parents) -> torch.Tensor:
    """[S+N, S+N] bool visibility of S linear tokens (causal) followed by a tree on top of them."""
    import torch

    n = len(parents)
    total = n_linear + n
    vis = torch.zeros(total, total, dtype=torch.bool)
    if n_linear:
        vis[:n_linear, :n_linear] = torch.ones(n_linear, n_linear, dtype=torch.bool).tril()
        vis[n_linear:, :n_linear] = True
    vis[n_linear:, n_linear:] = ancestor_matrix(parents)
    return vis


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool visibility [T, P+T] -> additive float mask [1, 1, T, P+T] (0 allowed, dtype min elsewhere)."""
    import torch

    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def path_to(node: int, parents) -> list[int]:
    """Node indices from the root to ``node`` inclusive."""
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def root_to_leaf_paths(parents) -> list[list[int]]:
    """Every root->leaf path, leaves in index order."""
    has_child = [False] * len(parents)
    for p in parents[1:]:
        has_child[p] = True
    return [path_to(i, parents) for i in range(len(parents)) if not has_child[i]]


def subtree(tree: FlatTree, node: int) -> FlatTree:
    """The subtree rooted at ``node``, re-indexed (topological order kept), with its draft
    distributions. Used to re-root a tree drafted one token ahead."""
    keep = [node]
    inside = {node}
    for i in range(node + 1, len(tree.parents)):
        if tree.parents[i] in inside:
            inside.add(i)
            keep.append(i)
    index = {old: new for new, old in enumerate(keep)}
    return FlatTree(
        token_ids=[tree.token_ids[i] for i in keep],
        parents=[-1] + [index[tree.parents[i]] for i in keep[1:]],
        draft_logprobs=[0.0] + [tree.draft_logprobs[i] for i in keep[1:]] if tree.draft_logprobs else [],
        child_dist_ids=[tree.child_dist_ids[i] for i in keep] if tree.sampled else [],
        child_dist_probs=[tree.child_dist_probs[i] for i in keep] if tree.sampled else [],
    )
