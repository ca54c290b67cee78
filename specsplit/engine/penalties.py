"""Presence, frequency and repetition penalties on the target, at every tree node.

The target's logits at a node become what plain decoding with the same penalties computes after
that node's path (vLLM's rules, in its order): the repetition penalty divides a positive logit
(multiplies a negative one) of every token seen in the prompt or the output; then the frequency
penalty subtracts ``frequency x count`` and the presence penalty ``presence`` from every token
the output holds. "The output" at a node is the committed tokens from the prompt's end on, then
the node's path. The verification rules then run unchanged, so greedy output equals plain greedy
decoding with the penalties, and sampling draws from the penalized distribution. The draft
proposes from its own logits processed the same way (``Seen``, ``penalize_paths``), so where a
penalty changes the target's choice it changes the draft's too.

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


def masked(token_ids, logits: torch.Tensor) -> torch.Tensor:
    """The logits [N, V] with those tokens' columns -inf at every node (a copy; ids checked
    against the vocabulary already)."""
    index = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    return logits.index_fill(1, index, float("-inf"))


def accepted(session, req, path: list[int]) -> None:
    """The round's accepted nodes after the root are committed."""
    st: PenaltyState | None = getattr(session, "penalties", None)
    if st is not None:
        st.tokens += [req.tree.token_ids[i] for i in path[1:]]


@dataclass(frozen=True)
class Seen:
    """What every row's penalties start from: the output's token counts up to and including the
    root, and (with a repetition penalty) the prompt's tokens."""

    output: Counter
    prompt: frozenset

    @classmethod
    def of(cls, sampling, tokens: list[int], prompt_len: int) -> Seen:
        """From the committed tokens (the prompt's first ``prompt_len``) through the root."""
        rep = sampling.repetition_penalty not in (None, 1.0)
        return cls(Counter(tokens[prompt_len:]), frozenset(tokens[:prompt_len]) if rep else frozenset())


def penalize(session, req, layout, logits: torch.Tensor) -> torch.Tensor:
    """The tree's logits [N, V] with the request's penalties applied at every node (a copy)."""
    st = at_root(session, req)
    tokens, parents = req.tree.token_ids, layout.parents
    paths: list[list[int]] = [[]]  # each node's path after the root (parents come first): its tokens
    for i in range(1, len(tokens)):  # join the node's output
        paths.append([*paths[parents[i]], tokens[i]])
    return penalize_paths(req.sampling, Seen.of(req.sampling, st.tokens, st.prompt_len), paths, logits)


def penalize_paths(sampling, seen: Seen, paths: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, V] with the penalties applied to row i as plain decoding applies them after
    the output ``seen.output`` + ``paths[i]`` (a copy). Only the columns of tokens seen change."""
    output, prompt = seen.output, seen.prompt
    rep = sampling.repetition_penalty if sampling.repetition_penalty is not None else 1.0
    cols = sorted(set(output) | prompt | {t for p in paths for t in p})
    col = {t: j for j, t in enumerate(cols)}
    n, dev = len(paths), logits.device
    rows = [i for i, p in enumerate(paths) for _ in p]
    at = [col[t] for p in paths for t in p]
    base = torch.tensor([output.get(t, 0) for t in cols], dtype=torch.float32, device=dev)
    cnt = base.expand(n, -1).clone()  # [N, K]: the output's counts after each row's path
    if rows:
        cnt.index_put_((torch.tensor(rows, device=dev), torch.tensor(at, device=dev)),
                       torch.ones(len(rows), device=dev), accumulate=True)
    index = torch.tensor(cols, dtype=torch.long, device=dev)
    sub = logits.index_select(1, index).float()  # [N, K]
    if rep != 1.0:
        seen_any = (cnt > 0) | torch.tensor([t in prompt for t in cols], dtype=torch.bool, device=dev)
        sub = torch.where(seen_any, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - (sampling.frequency_penalty or 0.0) * cnt - (sampling.presence_penalty or 0.0) * (cnt > 0).float()
    out = logits.clone()
    out.index_copy_(1, index, sub.to(logits.dtype))
    return out


@dataclass(frozen=True)
class DraftProcessing:
    """The draft's rows processed as the target processes its own: the logit bias, then the
    penalties after each row's path (``seen`` None: none), then the masked tokens, then the
    grammar's mask after each row's path (``grammar``: a ``specsplit.engine.grammar.DraftGrammar``)."""

    sampling: object
    seen: Seen | None
    grammar: object = None

    def rows(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """``logits`` [N, V], row i a node whose path after the root is ``paths[i]`` (a copy)."""
        bias = [b for b in self.sampling.logit_bias or () if b.token_id < logits.shape[-1]]
        if bias:
            logits = biased(bias, logits)
        if self.seen is not None:
            logits = penalize_paths(self.sampling, self.seen, paths, logits)
        mask = [t for t in self.sampling.masked_token_ids or () if t < logits.shape[-1]]
        if mask:
            logits = masked(mask, logits)
        return self.grammar.mask(logits, paths) if self.grammar is not None else logits


def for_draft(sampling, tokens: list[int], committed: int, prompt_len: int, grammar=None) -> DraftProcessing | None:
    """How a draft processes its rows for a request whose sync names ``committed`` tokens through
    the root (``tokens``: the session's, as far as it knows them) and ``prompt_len`` of them as the
    prompt, ``grammar`` its DraftGrammar (or None); None: not at all. The penalties need the
    output's tokens: without them (the prompt not named, the session's tokens not all known) the
    draft proposes unpenalized, which costs only acceptance."""
    seen = None
    if sampling.penalized and 0 < prompt_len <= committed == len(tokens):
        seen = Seen.of(sampling, tokens, prompt_len)
    if seen is None and not sampling.logit_bias and not sampling.masked_token_ids and grammar is None:
        return None
    return DraftProcessing(sampling, seen, grammar)
