"""Admission of sessions into one orchestrator: a cap on running sessions, a bounded fair queue
behind it, and refusal at once beyond that. Plain state (no sockets, no asyncio), tested alone.

- At most ``active`` sessions run (draft/verify) at once. Sized to what the workers hold
  (SPECSPLIT_WORKER_MAX_SESSIONS per worker's KV cache LRU), so a running session is never
  evicted by the sessions running beside it: an admitted session finishes.
- Up to ``max_sessions`` are admitted in all (running + waiting); a request beyond that gets
  OVERLOADED at once (retryable: the producer backs off, or resumes on another orchestrator).
- One client (a producer's socket identity) holds at most ``client_share`` of ``max_sessions``,
  so a flood from one client cannot fill the queue ahead of another.
- Waiting sessions start in round-robin order over clients (FIFO within a client): one client
  cannot starve another however many it queued.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Waiting:
    client: bytes
    session_id: str
    item: Any  # what the server needs to start it (request id, request)
    since: float = field(default_factory=time.monotonic)  # when it started waiting


class Admission:
    def __init__(self, *, active: int, max_sessions: int, client_share: float = 0.75) -> None:
        if active < 1 or max_sessions < 1 or not 0 < client_share <= 1:
            raise ValueError("active >= 1, max_sessions >= 1, 0 < client_share <= 1")
        self.active, self.max_sessions = active, max(max_sessions, active)
        self.client_max = max(1, int(self.max_sessions * client_share))
        self.running: dict[str, bytes] = {}  # session_id -> client
        self._queues: OrderedDict[bytes, deque[Waiting]] = OrderedDict()  # rotation order of clients
        self._waiting: dict[str, Waiting] = {}
        self._per_client: dict[bytes, int] = {}  # admitted (running + waiting) per client

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.running or session_id in self._waiting

    @property
    def admitted(self) -> int:
        return len(self.running) + len(self._waiting)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def offer(self, client: bytes, session_id: str, item: Any) -> str:
        """"run" (start it now), "wait" (queued) or a refusal reason (answer OVERLOADED)."""
        if self.admitted >= self.max_sessions:
            return f"{self.admitted} sessions admitted (max {self.max_sessions})"
        if self._per_client.get(client, 0) >= self.client_max:
            return f"this client holds {self.client_max} sessions, its share of {self.max_sessions}"
        self._per_client[client] = self._per_client.get(client, 0) + 1
        if len(self.running) < self.active and not self._waiting:
            self.running[session_id] = client
            return "run"
        w = Waiting(client, session_id, item)
        self._waiting[session_id] = w
        self._queues.setdefault(client, deque()).append(w)
        return "wait"

    def finish(self, session_id: str) -> list[Waiting]:
        """A running session ended: the waiting sessions to start now (round-robin)."""
        client = self.running.pop(session_id, None)
        if client is not None:
            self._release(client)
        return self._fill()

    def withdraw(self, session_id: str, client: bytes | None = None) -> Waiting | None:
        """Drop a waiting session (cancelled before it started); None when it is not waiting, or
        when ``client`` is given and is not the one that queued it (sessions belong to their
        producer)."""
        w = self._waiting.get(session_id)
        if w is None or (client is not None and w.client != client):
            return None
        del self._waiting[session_id]
        q = self._queues.get(w.client)
        if q is not None:
            q.remove(w)
            if not q:
                del self._queues[w.client]
        self._release(w.client)
        return w

    def clear_waiting(self) -> list[Waiting]:
        """Drop every waiting session (the orchestrator is stopping); returns them."""
        out = list(self._waiting.values())
        for w in out:
            self.withdraw(w.session_id)
        return out

    def _release(self, client: bytes) -> None:
        n = self._per_client.get(client, 0) - 1
        if n > 0:
            self._per_client[client] = n
        else:
            self._per_client.pop(client, None)

    def _fill(self) -> list[Waiting]:
        started = []
        while len(self.running) < self.active and self._queues:
            client, q = next(iter(self._queues.items()))
            w = q.popleft()
            if q:
                self._queues.move_to_end(client)  # next client's turn
            else:
                del self._queues[client]
            del self._waiting[w.session_id]
            self.running[w.session_id] = w.client
            started.append(w)
        return started
