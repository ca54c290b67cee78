"""Which queued requests a worker hands to its engine together (continuous batching at round
granularity: the requests waiting when a forward starts), and how long a forward waits for
the sessions due next (``Gather``). No sockets, no torch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable
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


class Gather:
    """When a batching worker holds a forward open for a moment: for the sessions it expects next.

    Several sessions in lockstep split into groups that alternate on one worker: a group's next
    requests arrive while the other group's forward runs, so every forward starts with half the
    sessions (seen on the real pair: docs/results.md, commit 847dd03). On a CPU a forward's cost
    is mostly its intercept (reading the weights), so two half-batches cost nearly twice one whole.

    The worker tells it when each session's request arrived and when its reply left; per session
    it keeps the turnaround (reply -> next request, a moving average). When a forward is about to
    start, ``hold_s`` says how long to wait for sessions whose next request is due: every session
    whose reply left, whose next request has not been taken, and whose predicted arrival falls
    within the hold window. The window is ``fraction`` of the worker's recent forward time
    (bounded by ``max_hold_s``) and counts from the hold's start, so a forward is never held longer
    than that; the hold ends as soon as no such session is left. Sessions whose turnaround is long
    (speculating rounds queued at a draft worker) are not waited for; a lone session never is.
    Thread-safe (the socket thread asks it whether to serve a request inline). Bounded: at most
    ``max_sessions`` sessions, the least recently served dropped first.
    """

    def __init__(self, fraction: float = 0.3, *, max_hold_s: float = 0.25, max_sessions: int = 4096,
                 smoothing: float = 0.5) -> None:
        if not 0 <= fraction <= 1 or max_hold_s < 0 or max_sessions < 1 or not 0 < smoothing <= 1:
            raise ValueError("fraction in [0, 1], max_hold_s >= 0, max_sessions >= 1, smoothing in (0, 1]")
        self.fraction, self.max_hold_s, self.max_sessions, self.smoothing = fraction, max_hold_s, max_sessions, smoothing
        # key -> [replied_at or None (its request is in hand), turnaround_s or None (not measured)]
        self._seen: OrderedDict[object, list] = OrderedDict()
        self._forward_s: float | None = None
        self._lock = threading.Lock()
        self.holds = 0  # forwards held open
        self.held_s = 0.0  # seconds spent holding

    def arrived(self, key: object, at: float) -> None:
        """``key``'s request (received at ``at``, monotonic) is being handled."""
        with self._lock:
            seen = self._seen.get(key)
            if seen is None or seen[0] is None:
                return
            took = max(0.0, at - seen[0])
            seen[1] = took if seen[1] is None else seen[1] + self.smoothing * (took - seen[1])
            seen[0] = None

    def replied(self, key: object, at: float) -> None:
        """``key``'s reply left at ``at``."""
        with self._lock:
            seen = self._seen.pop(key, None) or [None, None]
            seen[0] = at
            self._seen[key] = seen
            while len(self._seen) > self.max_sessions:
                self._seen.popitem(last=False)

    def ended(self, key: object) -> None:
        with self._lock:
            self._seen.pop(key, None)

    def forward_took(self, seconds: float) -> None:
        """A batchable forward took ``seconds`` (the hold window is a fraction of this)."""
        with self._lock:
            f = self._forward_s
            self._forward_s = seconds if f is None else f + 0.3 * (seconds - f)

    def window_s(self) -> float:
        f = self._forward_s
        return 0.0 if f is None else min(self.max_hold_s, self.fraction * f)

    def hold_s(self, now: float, started: float, exclude: Container = ()) -> float:
        """Seconds to go on waiting at ``now`` for a hold that began at ``started`` (0: start the
        forward): until the window's end while a session not in ``exclude`` is due within it."""
        window = self.window_s()
        end, horizon = started + window, max(2.0, 4 * (self._forward_s or 0.0))
        if window <= 0 or now >= end:
            return 0.0
        with self._lock:
            for key, (replied, turnaround) in reversed(self._seen.items()):
                if replied is None or turnaround is None or key in exclude:
                    continue
                if replied < started - horizon:
                    break  # ordered by reply: every older session has gone quiet
                due = replied + turnaround
                if started - window <= due <= end:
                    return end - now
        return 0.0

    def held(self, seconds: float) -> None:
        with self._lock:
            self.holds += 1
            self.held_s += seconds
