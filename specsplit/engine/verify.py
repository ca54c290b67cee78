"""Tree verification rules: greedy, and recursive rejection sampling.

Both take the target's logits at every tree node and return the accepted root->leaf path and
the bonus token. The greedy rule makes the output equal plain greedy decoding of the target; the
sampling rule (SpecInfer-style multi-candidate rejection sampling) leaves the target's
distribution unchanged. See schemas/PROTOCOL.md, "Verification".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schemas import FlatTree, SamplingSpec
from specsplit.engine import sampling as S
from specsplit.engine.tree import TreeLayout


@dataclass(frozen=True, slots=True)
class Verdict:
    path: list[int]  # accepted node indices, root (0) first
    bonus: int  # token sampled/argmaxed after the last accepted node


def verify_greedy(tree: FlatTree, layout: TreeLayout, logits: torch.Tensor) -> Verdict:
    """logits [N, V]. Accept a child iff it equals the target's argmax at its parent; the deepest
    accepted node wins (lowest index on ties); bonus = argmax there."""
    argmax = logits.argmax(dim=-1).tolist()  # [N]
    tokens, parents = tree.token_ids, layout.parents
    accepted = [True] + [False] * (layout.num_nodes - 1)
    best = 0
    for i in range(1, layout.num_nodes):
        p = parents[i]
        if accepted[p] and tokens[i] == argmax[p]:
            accepted[i] = True
            if layout.depths[i] > layout.depths[best]:
                best = i
    path = []
    node = best
    while node != -1:
        path.append(node)
        node = parents[node]
    return Verdict(path[::-1], argmax[best])


def _child_q(tree: FlatTree, v: int, child: int, vocab: int) -> torch.Tensor:
    """The distribution child ``child`` of ``v`` was drawn from [V]: the carried draft
    distribution of a sampled tree (renormalized: the wire tolerates sums off by 1e-3, and
    sample_from draws from the normalized vector), or a point mass for a deterministic draft."""
    if tree.sampled:
        q = S.dense(tree.child_dist_ids[v], tree.child_dist_probs[v], vocab)
        return q / q.sum()
    q = torch.zeros(vocab, dtype=torch.float64)
    q[tree.token_ids[child]] = 1.0
    return q


def verify_sampling(
    tree: FlatTree, layout: TreeLayout, logits: torch.Tensor, sampling: SamplingSpec, g: torch.Generator
) -> Verdict:
    """Recursive rejection sampling. At node v with children c_1..c_k (draw order), residual
    r = p_v; child c_j with token x is accepted with prob min(1, r(x)/q_j(x)); on rejection
    r <- normalize(max(r - q_j, 0)). If none is accepted the bonus is drawn from r; at a leaf
    from p_v. Children drawn i.i.d. from one q (sampled tree, duplicates allowed) or distinct
    deterministic proposals (point masses) both keep the output distributed exactly as p."""
    vocab = logits.shape[-1]
    path, v = [0], 0
    while True:
        r = S.probs_from_logits(logits[v : v + 1], sampling)[0]  # [V] float64, only visited nodes
        nxt = -1
        q_shared = None
        for c in layout.children[v]:
            if tree.sampled:
                q_shared = q_shared if q_shared is not None else _child_q(tree, v, c, vocab)
                q = q_shared
            else:
                q = _child_q(tree, v, c, vocab)
            x = tree.token_ids[c]
            if S.uniform(g) * float(q[x]) < float(r[x]):
                nxt = c
                break
            resid = torch.clamp(r - q, min=0.0)
            total = float(resid.sum())
            if total > 0.0:  # total == 0 means r == q, where rejection has probability 0
                r = resid / total
        if nxt < 0:
            return Verdict(path, S.sample_from(r, g)[0])
        path.append(nxt)
        v = nxt
