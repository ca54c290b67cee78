"""Tree verification rules: greedy, and recursive rejection sampling, on the logits' device.

Both take the target's logits at every tree node and return the accepted root->leaf path and
the bonus token, with ONE host copy per request: every per-node decision is computed on the
device for all nodes at once, and only the result crosses to the host. The greedy rule makes the
output equal plain greedy decoding of the target; the sampling rule (SpecInfer-style
multi-candidate rejection sampling) leaves the target's distribution unchanged. See
schemas/PROTOCOL.md, "Verification".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schemas import FlatTree, Logprobs, SamplingSpec
from schemas.base import LOGPROB_FLOOR
from specsplit.engine import sampling as S
from specsplit.engine.infill import InfillVocab
from specsplit.tree import TreeLayout, path_to


SUPPORT_MAX_K = 1024  # a top-k up to this: sampled verification over the nodes' supports, not the vocabulary


@dataclass(frozen=True, slots=True)
class Verdict:
    path: list[int]  # accepted node indices, root (0) first
    bonus: int  # token sampled/argmaxed after the last accepted node
    forced: tuple[int, ...] = ()  # a grammar's session: the tokens it forces after the bonus
    logprobs: Logprobs | None = None  # asked for: of the accepted tokens and the bonus (``logprobs_of``)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A round's result: the accepted path and bonus, or (exact SpecPV) a rollback."""

    verdict: Verdict
    partial: bool = False
    rollback_len: int | None = None  # committed is cut to this length first
    confirmed_len: int | None = None  # committed tokens confirmed after the reply (None: all)
    forward_tokens: int = 0  # new tokens the round forwarded (buffered, sync and tree; 0: unknown)
    cached: int = 0  # sync tokens copied from the prefix cache instead (Engine.take_prefix)
    prompt_logprobs: Logprobs | None = None  # asked for (VerifyRequest.prompt_logprobs)


def logprobs_of(tree: FlatTree, logits: torch.Tensor, verdict: Verdict, top: int) -> Logprobs:
    """The log-probabilities of the tokens ``verdict`` commits (its accepted nodes', then the
    bonus), each under the target's raw distribution at its parent node (logits [N, V], before
    any processing), with the ``top`` most likely tokens there. Computed on the logits' device
    for the path's rows only; two host copies."""
    tokens = [*(tree.token_ids[i] for i in verdict.path[1:]), verdict.bonus]
    rows = logits.index_select(0, torch.tensor(verdict.path, device=logits.device))  # [L, V]
    token, top_ids, top_lp = row_logprobs(rows, tokens, top)
    return Logprobs(token=token, top_ids=top_ids, top=top_lp)


def row_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> tuple[list, list, list]:
    """Each row's log-probability of its token (logits [L, V], raw) and the ``top`` most likely
    tokens there: the lists of ``schemas.Logprobs`` (token, top_ids, top). Two host copies."""
    dev = logits.device
    lp = torch.log_softmax(logits.float(), dim=-1)  # [L, V]
    chosen = lp.gather(1, torch.tensor(tokens, device=dev).unsqueeze(1))  # [L, 1]
    values, ids = lp.topk(top, dim=-1) if top else (chosen[:, :0], chosen[:, :0].long())
    rows = torch.cat([chosen, values], 1).clamp_min(LOGPROB_FLOOR).tolist()
    return [r[0] for r in rows], ids.tolist(), [r[1:] for r in rows]


class PromptRows:
    """A prompt's log-probabilities (``VerifyRequest.prompt_logprobs``), gathered from the rows of
    the forwards that prefill it: row j of the linear tokens predicts ``following[j]`` (the next
    linear token, or the root); rows 0 to ``count`` - 1 are the prompt's. ``take`` each forward's
    rows in order; log-softmax runs SLICE rows at a time, bounding its [rows, V] temporaries."""

    SLICE = 256

    def __init__(self, top: int, following: list[int], count: int) -> None:
        self.top, self.following, self.count = top, following, count
        self.taken = 0  # rows seen so far
        self.token: list[float] = []
        self.top_ids: list[list[int]] = []
        self.top_lp: list[list[float]] = []

    def take(self, logits: torch.Tensor) -> None:
        """The next rows (logits [r, V]) of the linear tokens."""
        first, r = self.taken, logits.shape[0]
        for a in range(0, min(r, self.count - first), self.SLICE):
            b = min(a + self.SLICE, self.count - first, r)
            token, ids, top = row_logprobs(logits[a:b], self.following[first + a:first + b], self.top)
            self.token += token
            self.top_ids += ids
            self.top_lp += top
        self.taken = first + r

    def result(self) -> Logprobs:
        if self.taken < self.count:
            raise RuntimeError(f"{self.taken} rows of the prompt's {self.count} were forwarded")
        return Logprobs(token=self.token, top_ids=self.top_ids, top=self.top_lp)


def verify_greedy(tree: FlatTree, layout: TreeLayout, logits: torch.Tensor) -> Verdict:
    """logits [N, V]: the target's argmax at every node (the one host copy), then ``greedy_verdict``."""
    return greedy_verdict(tree, layout, S.argmax_rows(logits).tolist())


def greedy_verdict(tree: FlatTree, layout: TreeLayout, argmax: list[int]) -> Verdict:
    """Accept a child iff it equals the target's argmax at its parent (``argmax``: per node) and
    its parent was accepted; the deepest accepted node wins (lowest index on ties); bonus = argmax
    there. On the host: N small ints, where a device rule costs a dozen kernel launches."""
    tokens, parents, depths = tree.token_ids, layout.parents, layout.depths
    accepted = [True] * len(tokens)
    best = 0
    for i in range(1, len(tokens)):
        p = parents[i]  # < i: topological order
        accepted[i] = accepted[p] and tokens[i] == argmax[p]
        if accepted[i] and depths[i] > depths[best]:
            best = i
    return Verdict(path_to(best, parents), argmax[best])


def verify_sampling(
    tree: FlatTree, layout: TreeLayout, logits: torch.Tensor, sampling: SamplingSpec, g: torch.Generator,
    infill: InfillVocab | None = None,
) -> Verdict:
    """Recursive rejection sampling. At node v with children c_1..c_k (draw order), residual
    r = p_v; child c_j with token x is accepted with prob min(1, r(x)/q_j(x)); on rejection
    r <- normalize(max(r - q_j, 0)). If none is accepted the bonus is drawn from r; at a leaf
    from p_v. Children drawn i.i.d. from one q (sampled tree, duplicates allowed) or distinct
    deterministic proposals (point masses) both keep the output distributed exactly as p.

    Computed for every node at once: the j-th child test of every node (as reached, i.e. after
    its j-1 elder siblings were rejected) and every node's bonus draw; the walk from the root
    then reads them on the host. With top-k (at most ``SUPPORT_MAX_K``), over each node's
    columns only (``_on_supports``). ``infill``: p is llama.cpp's infill sampler's choice
    (``sampling.apply_infill``)."""
    n, vocab = logits.shape
    dev = logits.device
    rows = S.top_k_rows(logits, sampling.top_k, sampling, infill) \
        if 0 < sampling.top_k <= min(SUPPORT_MAX_K, vocab - 1) else None
    if rows is not None:
        return _walk(layout, *_on_supports(tree, layout, rows, g))
    r = S.probs_from_logits(logits, sampling, infill=infill)  # [N, V] residuals, p to start with
    dt = r.dtype
    u_test = torch.rand(n, generator=g, dtype=dt, device=dev)  # [N]: child c's test uses u_test[c]
    u_bonus = torch.rand(n, 1, generator=g, dtype=dt, device=dev)  # [N, 1]: node v's bonus draw
    tokens = torch.tensor(tree.token_ids, dtype=torch.long, device=dev)  # [N]
    q_shared = (S.dense_rows(tree.child_dist_ids, tree.child_dist_probs, vocab, dtype=dt, device=dev)
                if tree.sampled else None)  # [N, V]: the distribution node v's children were drawn from
    accepted = torch.zeros(n, dtype=torch.bool, device=dev)  # [N], by child index
    for j in range(max(len(c) for c in layout.children)):
        kid = torch.tensor([c[j] if j < len(c) else 0 for c in layout.children], dtype=torch.long, device=dev)
        has = kid > 0  # [N]: node v has a j-th child (node 0, the root, is nobody's child)
        x = tokens[kid]  # [N]
        q = q_shared if q_shared is not None else torch.nn.functional.one_hot(x, vocab).to(dt)  # [N, V]
        qx, rx = q.gather(1, x[:, None])[:, 0], r.gather(1, x[:, None])[:, 0]
        # entries of nodes without a j-th child land on index 0 (the root), which is never read
        accepted.scatter_(0, kid, (u_test[kid] * qx < rx) & has)
        resid = torch.clamp(r - q, min=0.0)
        total = resid.sum(dim=-1, keepdim=True)  # 0 means r == q, where rejection has probability 0
        r = torch.where(has[:, None] & (total > 0), resid / torch.where(total > 0, total, 1.0), r)
    return _walk(layout, accepted, S.inverse_cdf(r, u_bonus)[:, 0])


def _walk(layout: TreeLayout, accepted: torch.Tensor, bonus: torch.Tensor) -> Verdict:
    """The walk from the root over every node's tests (``accepted`` [N], by child) and bonus
    draws (``bonus`` [N] token ids), after the one host copy."""
    n = accepted.shape[0]
    host = torch.cat([accepted.long(), bonus]).tolist()  # the one host copy
    acc, bonus_of = host[:n], host[n:]
    path, v = [0], 0
    while True:
        nxt = next((c for c in layout.children[v] if acc[c]), -1)
        if nxt < 0:
            return Verdict(path, bonus_of[v])
        path.append(nxt)
        v = nxt


def _on_supports(tree: FlatTree, layout: TreeLayout, rows: tuple[torch.Tensor, torch.Tensor],
                 g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_sampling``'s tests and bonus draws over each node's columns: the tokens of p's
    support (``rows``: top-k probabilities and ids, [N, k]), of the draft's distribution and of
    the node's children, in token order (repeats hold no mass: a token's column is its first),
    not the vocabulary. The same draws as the whole rows (the same uniforms; a cumulative sum in
    token order skips only zeros), on the device: no host copy before the walk's."""
    probs, ids = rows[0], rows[1].contiguous()
    n, dev, dt = probs.shape[0], probs.device, probs.dtype
    u_test = torch.rand(n, generator=g, dtype=dt, device=dev)  # (drawn as the whole rows' are)
    u_bonus = torch.rand(n, 1, generator=g, dtype=dt, device=dev)
    width = max(len(c) for c in layout.children)
    kid_tokens = torch.tensor([[tree.token_ids[c] for c in ch] + [tree.token_ids[0]] * (width - len(ch))
                               for ch in layout.children], dtype=torch.long, device=dev)  # [N, b]
    parts = [ids, kid_tokens]
    if tree.sampled:
        s = max(1, *(len(d) for d in tree.child_dist_ids))
        q_ids = torch.tensor([d + [0] * (s - len(d)) for d in tree.child_dist_ids], dtype=torch.long, device=dev)
        q_vals = torch.tensor([d + [0.0] * (s - len(d)) for d in tree.child_dist_probs], dtype=dt, device=dev)
        parts.append(q_ids)
    cols = torch.cat(parts, dim=1).sort(dim=1).values  # [N, m] token ids, ascending, repeats side by side
    r = torch.zeros(cols.shape, dtype=dt, device=dev).scatter_add_(1, torch.searchsorted(cols, ids), probs)
    q_shared = None
    if tree.sampled:
        q_shared = torch.zeros(cols.shape, dtype=dt, device=dev).scatter_add_(1, torch.searchsorted(cols, q_ids),
                                                                              q_vals)
        total = q_shared.sum(dim=-1, keepdim=True)  # renormalized, as dense_rows does
        q_shared = torch.where(total > 0, q_shared / torch.where(total > 0, total, 1.0), q_shared)
    accepted = torch.zeros(n, dtype=torch.bool, device=dev)
    for j in range(width):
        kid = torch.tensor([c[j] if j < len(c) else 0 for c in layout.children], dtype=torch.long, device=dev)
        has = kid > 0
        at = torch.searchsorted(cols, kid_tokens[:, j:j + 1].contiguous())  # [N, 1]: the j-th child's column
        q = q_shared if q_shared is not None else torch.nn.functional.one_hot(at[:, 0], cols.shape[1]).to(dt)
        qx, rx = q.gather(1, at)[:, 0], r.gather(1, at)[:, 0]
        accepted.scatter_(0, kid, (u_test[kid] * qx < rx) & has)
        resid = torch.clamp(r - q, min=0.0)
        total = resid.sum(dim=-1, keepdim=True)
        r = torch.where(has[:, None] & (total > 0), resid / torch.where(total > 0, total, 1.0), r)
    return accepted, cols.gather(1, S.inverse_cdf(r, u_bonus))[:, 0]
