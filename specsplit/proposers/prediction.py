"""Predicted outputs (OpenAI's ``prediction``): a request may say what it expects most of the
answer to be (a file to edit, a document to revise); this proposer hangs the prediction's next
tokens under each round's root. It follows the answer along the prediction; where the answer
departs from it, it finds its place again where the answer's last tokens recur in the
prediction. Verified like any node: the answer is the target's own, and the prediction only
changes how many tokens a round commits. Proposes nothing in sessions without one."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from specsplit.proposers.base import Budget, Proposal, Proposer, register

RESYNC_MIN = 3  # tokens of the answer's end that must recur in the prediction to find its place again
RESYNC_MAX = 16


def resync(pred: list[int], out: Sequence[int], after: int) -> int | None:
    """Where to continue in ``pred`` after the answer ``out``: just past the longest recurrence
    of ``out``'s last tokens (at least ``RESYNC_MIN`` of them, or all of a shorter ``out``);
    among equals the first at or past ``after`` (where the answer last followed it), else the
    first. None: none."""
    need = min(RESYNC_MIN, len(out))
    if need == 0:
        return None
    best: tuple[int, bool, int] | None = None  # (length, at or past after, -position)
    j = 0
    while True:
        try:
            j = pred.index(out[-1], j)  # (list.index: a scan in C)
        except ValueError:
            break
        k = 1
        while k < RESYNC_MAX and k <= j and k < len(out) and pred[j - k] == out[-1 - k]:
            k += 1
        cand = (k, j + 1 >= after, -(j + 1))
        if best is None or cand > best:
            best = cand
        j += 1
    return -best[2] if best is not None and best[0] >= need else None


def followed(pred: Sequence[int], out: Sequence[int], budget: int = 1_000_000) -> int:
    """How many of the prediction's tokens the answer took up, in order (OpenAI's
    ``accepted_prediction_tokens``): the answer walked along the prediction, each token that is
    the prediction's next counted; where the answer departs, its place is found again by
    ``resync``'s rule (its last RESYNC_MIN or more tokens recur there), only forward of where it
    last followed, so no prediction token counts twice. ``budget``: token comparisons spent
    finding places again (bounds the work for a long prediction the answer leaves)."""
    where: dict[int, list[int]] = {}
    for j, t in enumerate(pred):
        where.setdefault(t, []).append(j)
    at: int | None = 0
    last = n = 0
    for i, t in enumerate(out):
        if at is None and i and budget > 0:
            best: tuple[int, int] | None = None  # (length, -position)
            seen = where.get(out[i - 1], ())
            for j in seen[bisect.bisect_left(seen, max(0, last - 1)):]:
                k = 1
                while k < RESYNC_MAX and k <= j and k < i and pred[j - k] == out[i - 1 - k]:
                    k += 1
                budget -= k
                if best is None or (k, -(j + 1)) > best:
                    best = (k, -(j + 1))
            if best is not None and best[0] >= min(RESYNC_MIN, i):
                at = -best[1]
        if at is not None and at < len(pred) and pred[at] == t:
            at += 1
            last, n = at, n + 1
        else:
            at = None
    return n


@register
class PredictedOutput(Proposer):
    name = "prediction"

    def __init__(self, session, shared) -> None:
        super().__init__(session, shared)
        req = getattr(session, "req", None)
        self.pred: list[int] = list(getattr(req, "prediction_token_ids", None) or ())
        self.start = getattr(req, "prompt_len", 0)  # where the answer begins in the context
        self.at: int | None = 0  # the next prediction token, while the answer follows it
        self.last = 0  # where the answer last followed it
        self.seen = 0  # answer tokens already walked

    def suggest(self, committed: Sequence[int], budget: Budget) -> Proposal | None:
        if not self.pred:
            return None
        out = committed[self.start:]
        if len(out) < self.seen:  # tokens rolled back (exact SpecPV): find the place again
            self.at, self.seen = None, len(out)
        for t in out[self.seen:]:  # walk the new tokens along the prediction
            if self.at is not None and self.at < len(self.pred) and self.pred[self.at] == t:
                self.at += 1
                self.last = self.at
            else:
                self.at = None
        self.seen = len(out)
        key = 1  # (calibrated apart: a chain the answer follows, one found again)
        if self.at is None:
            self.at, key = resync(self.pred, out, self.last), 0
        if self.at is None or self.at >= len(self.pred):
            return None
        chain = self.pred[self.at:self.at + budget.chain_tokens]
        return Proposal(chain=chain, keys=[key] * len(chain))
