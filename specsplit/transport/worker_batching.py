"""The engine thread's batching half of a worker (``WorkerLoop`` mixes this in): the queued
requests a forward takes together (``take_batch``), the hold that waits for the sessions due next
(``Gather``), and one handler call answering them all. See ``specsplit.transport.worker_loop``.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import structlog

from schemas.codec import Envelope, unpack_frames
from schemas.messages import EndSession


@dataclass(frozen=True, slots=True)
class _Job:
    client_id: bytes
    env: list[bytes]
    session_id: str
    request_id: bytes
    decoded: Envelope | None = None  # already decoded on the socket thread (fast-path check)
    arrived: float = 0.0  # time.monotonic() when the socket thread read it

    @property
    def key(self) -> tuple[bytes, str]:
        return self.client_id, self.session_id


def scoped_session_id(client_id: bytes, session_id: str) -> str:
    """The key a worker's engine stores a client's session under: the router's token for the
    client (unforgeable: random, chosen by the router at authentication) and the session id."""
    return f"{client_id.hex()}/{session_id}"



class EngineBatching:
    """Engine-thread methods for batching; the state (``batch_handler``, ``max_batch_tokens``,
    ``batch_cost``, ``gather``, the queue and counters) is the ``WorkerLoop``'s."""

    def _hold(self, jobs: list[_Job]) -> list[_Job | None]:
        """Wait (``Gather.hold_s``: a fraction of a forward at most) for the sessions due next and
        add their requests to ``jobs``; returns the one taken that does not fit, or nothing."""
        costs = [self._cost(j) for j in jobs]
        if any(c is None for c in costs):
            return []
        total, keys, started = sum(costs), {j.key for j in jobs}, time.monotonic()
        rest: list[_Job | None] = []
        waited = False
        while total < self.max_batch_tokens and (wait := self.gather.hold_s(time.monotonic(), started, keys)) > 0:
            waited = True
            try:
                job = self._queue.get(timeout=wait)
            except queue.Empty:
                break
            if job is not None:
                job = self._decoded(job)
            cost = self._cost(job)
            if cost is None or total + cost > self.max_batch_tokens:
                rest = [job]
                break
            jobs.append(job)
            total += cost
            keys.add(job.key)
        if waited:
            self.gather.held(time.monotonic() - started)
        return rest

    def _note_served(self, jobs: list[_Job], took_s: float) -> None:
        """Tell the gather when these requests came and their replies left."""
        if self.gather is None:
            return
        now = time.monotonic()
        for job in jobs:
            self.gather.arrived(job.key, job.arrived)
            if job.decoded is not None and isinstance(job.decoded.msg, EndSession):
                self.gather.ended(job.key)
            else:
                self.gather.replied(job.key, now)
        if self._cost(jobs[0]) is not None:
            self.gather.forward_took(took_s)

    def _decoded(self, job: _Job) -> _Job:
        """``job`` with its envelope decoded, or as it is when that fails (``_handle`` answers it)."""
        if job.decoded is not None:
            return job
        try:
            return replace(job, decoded=unpack_frames(job.env))
        except Exception:
            return job

    def _waiting(self) -> Iterator[_Job | None]:
        """The queued jobs, decoded, without blocking (None: the stop sentinel)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            yield job if job is None else self._decoded(job)

    def _cost(self, job: _Job | None) -> int | None:
        if job is None or job.decoded is None:
            return None
        try:
            return self.batch_cost(job.decoded.msg)
        except Exception:
            self.log.exception("batch_policy_failed")
            return None

    def _handle_batch(self, jobs: list[_Job]) -> list[list[bytes]]:
        """Several decoded requests -> their reply frames, in order. Never raises."""
        scoped = [scoped_session_id(job.client_id, job.session_id) for job in jobs]
        msgs = [job.decoded.msg.model_copy(update={"session_id": key})
                if getattr(job.decoded.msg, "session_id", None) == job.session_id else job.decoded.msg
                for job, key in zip(jobs, scoped)]  # a session belongs to its client, as in _handle
        with structlog.contextvars.bound_contextvars(batch=len(jobs)):
            try:
                replies = self.batch_handler(msgs)
                if len(replies) != len(msgs):
                    raise RuntimeError(f"batch handler answered {len(replies)} of {len(msgs)} requests")
            except Exception as exc:
                replies = [self._exception_reply(exc, jobs[0].decoded.kind)] * len(jobs)
        self.batches += 1
        self.batched_requests += len(jobs)
        replies = [r.model_copy(update={"session_id": job.session_id}) if getattr(r, "session_id", None) == key else r
                   for job, key, r in zip(jobs, scoped, replies)]
        return [self._reply_frames(job, reply) for job, reply in zip(jobs, replies)]
