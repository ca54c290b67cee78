"""Which queued requests a worker hands to its engine together (continuous batching at round
granularity: the requests waiting when a forward starts). Plain functions, no sockets, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from schemas.messages import DraftRequest, Message, VerifyRequest

J = TypeVar("J")
_END = object()


def verify_tokens(msg: Message) -> int | None:
    """A target's batch policy: a VerifyRequest costs the new tokens its forward carries (sync
    tokens + tree nodes); anything else is handled alone (None)."""
    if isinstance(msg, VerifyRequest):
        return len(msg.sync.append_token_ids) + msg.tree.num_nodes
    return None


def draft_tokens(msg: Message) -> int | None:
    """A draft's batch policy: a DraftRequest costs the new tokens its forwards may carry (sync
    tokens + root + its tree budget); anything else (growth) is handled alone (None)."""
    if isinstance(msg, DraftRequest):
        return len(msg.sync.append_token_ids) + 1 + msg.tree.max_nodes
    return None


def take_batch(first: J, waiting: Iterable[J], cost_of: Callable[[J], int | None],
               max_tokens: int) -> tuple[list[J], list[J]]:
    """The batch that starts with ``first``: it takes jobs from ``waiting`` (the queue, drained
    without blocking) while each is batchable (``cost_of`` not None) and the batch's tokens stay
    within ``max_tokens``. Returns (batch, rest): ``rest`` holds the one job taken that did not
    join (handled next, so the queue's order is kept), or nothing. ``first`` always goes, alone
    when it is not batchable or ``max_tokens`` is 0; nothing is taken once the budget is full."""
    total = cost_of(first)
    if total is None or max_tokens <= 0:
        return [first], []
    batch, it = [first], iter(waiting)
    while total < max_tokens:
        job = next(it, _END)
        if job is _END:
            break
        cost = cost_of(job)
        if cost is None or total + cost > max_tokens:
            return batch, [job]
        batch.append(job)
        total += cost
    return batch, []
