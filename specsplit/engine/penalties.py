"""Presence, frequency and repetition penalties on the target, at every tree node.

The target's logits at a node become what plain decoding with the same penalties computes after
that node's path (vLLM's rules, in its order): the repetition penalty divides a positive logit
(multiplies a negative one) of every token seen in the prompt or the output; then the frequency
penalty subtracts ``frequency x count`` and the presence penalty ``presence`` from every token
the output holds. "The output" at a node is the committed tokens from the prompt's end on, then
the node's path. The verification rules then run unchanged, so greedy output equals plain greedy
decoding with the penalties, and sampling draws from the penalized distribution. The draft
proposes unpenalized: where a penalty changes the choice, its tokens are rejected.

A session's committed tokens live on the session (``PenaltyState``) and advance with each
accepted path; a request that does not continue them (a resend from an empty cache, a retried
round, a prefix-cache copy) rebuilds them from its own tokens and the session's, and one that
cannot (its cache holds tokens no one names) is a CACHE_MISS, so the client resends the whole
context, as for a grammar. Only the columns of tokens seen are touched: the work is the tokens
seen times the tree's nodes, not the vocabulary.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from schemas import ErrorCode
from specsplit.errors import SpecError


@dataclass
class PenaltyState:
    """A session's committed tokens from position 0 (the prompt's first ``prompt_len``)."""

    prompt_len: int
    tokens: list[int] = field(default_factory=list)


def at_root(session, req) -> PenaltyState:
    """The session's committed tokens up to and including the request's root."""
    sync = req.sync
    if sync.prompt_len < 1:
        raise SpecError(ErrorCode.BAD_REQUEST, "penalties need the sync's prompt_len")
    st: PenaltyState | None = getattr(session, "penalties", None)
    if st is None or st.prompt_len != sync.prompt_len or len(st.tokens) < sync.base_len:
        held = session.tokens[:sync.base_len] if len(session.tokens) >= sync.base_len else None
        if held is None:
            session.penalties = None
            raise SpecError(ErrorCode.CACHE_MISS, "no penalty state for the cached tokens: resend them")
        st = session.penalties = PenaltyState(sync.prompt_len, list(held))
    del st.tokens[sync.base_len:]  # a retried round, or a cut: back to the cache's end
    st.tokens += [*sync.append_token_ids, req.tree.token_ids[0]]
    return st


def biased(bias, logits: torch.Tensor) -> torch.Tensor:
    """The logits [N, V] with each ``TokenBias`` added to its token's column at every node (a copy;
    token ids checked against the vocabulary already)."""
    out = logits.clone()
    index = torch.tensor([b.token_id for b in bias], dtype=torch.long, device=logits.device)
    add = torch.tensor([b.bias for b in bias], dtype=logits.dtype, device=logits.device)
    out.index_add_(1, index, add.expand(logits.shape[0], -1).contiguous())
    return out


def accepted(session, req, path: list[int]) -> None:
    """The round's accepted nodes after the root are committed."""
    st: PenaltyState | None = getattr(session, "penalties", None)
    if st is not None:
        st.tokens += [req.tree.token_ids[i] for i in path[1:]]


def penalize(session, req, layout, logits: torch.Tensor) -> torch.Tensor:
    """The tree's logits [N, V] with the request's penalties applied at every node (a copy)."""
    s, st = req.sampling, at_root(session, req)
    tokens, parents = req.tree.token_ids, layout.parents
    output = Counter(st.tokens[st.prompt_len:])
    rep = s.repetition_penalty if s.repetition_penalty is not None else 1.0
    prompt = set(st.tokens[:st.prompt_len]) if rep != 1.0 else set()
    cols = sorted(set(output) | prompt | set(tokens[1:]))
    col = {t: j for j, t in enumerate(cols)}
    n, dev = len(tokens), logits.device
    rows, at = [], []  # each node's path after the root: one more of its tokens in the node's output
    for i in range(1, n):
        node = i
        while node > 0:
            rows.append(i)
            at.append(col[tokens[node]])
            node = parents[node]
    base = torch.zeros(len(cols), dtype=torch.float32)
    for t, c in output.items():
        base[col[t]] = c
    cnt = base.to(dev).expand(n, -1).clone()  # [N, K]: the output's counts after each node's path
    if rows:
        cnt.index_put_((torch.tensor(rows, device=dev), torch.tensor(at, device=dev)),
                       torch.ones(len(rows), device=dev), accumulate=True)
    index = torch.tensor(cols, dtype=torch.long, device=dev)
    sub = logits.index_select(1, index).float()  # [N, K]
    if rep != 1.0:
        seen = (cnt > 0) | torch.tensor([t in prompt for t in cols], dtype=torch.bool, device=dev)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - (s.frequency_penalty or 0.0) * cnt - (s.presence_penalty or 0.0) * (cnt > 0).float()
    out = logits.clone()
    out.index_copy_(1, index, sub.to(logits.dtype))
    return out
