"""Router state without sockets: admitted workers with their liveness, and requests in flight.

Plain state transitions, driven by the router's poll loop with explicit ``now`` timestamps
(``time.monotonic()``), so they are tested without sockets. Everything here is bounded.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict, deque
from dataclasses import dataclass

from brokers.auth import BoundedTable
from brokers.rendezvous import pick, route_key
from schemas.messages import WorkerHello


@dataclass(slots=True)
class WorkerInfo:
    """An admitted worker: its hello and when it expires unless heard from again."""

    worker_id: bytes
    hello: WorkerHello
    admitted_at: float
    expires_at: float


@dataclass(frozen=True, slots=True)
class Admission:
    """Outcome of a WORKER_HELLO. ``replaced``: the identity was already admitted (the worker
    restarted or reconnected), so whatever it had in flight is lost."""

    ok: bool
    reason: str = ""
    replaced: bool = False


MAX_PLACEMENTS = 65_536  # route keys whose worker a router remembers (~10 MB at most)


class WorkerRegistry:
    """Live workers of one service. A worker is live until ``ttl_s`` passes without a message.

    Sessions stay where they were routed while that worker is live (``pick``): a worker joining,
    or coming back after a crash, takes new sessions, not the ones whose caches are elsewhere."""

    def __init__(self, service: str, *, ttl_s: float, max_workers: int = 256,
                 max_placements: int = MAX_PLACEMENTS) -> None:
        self.service = service
        self.ttl_s = ttl_s
        self.max_workers = max_workers
        self._workers: dict[bytes, WorkerInfo] = {}
        self._live: tuple[bytes, ...] = ()
        self._placed: OrderedDict[str, bytes] = OrderedDict()  # route key -> its worker, least recent first
        self.max_placements = max_placements

    def __contains__(self, worker_id: bytes) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    @property
    def live(self) -> tuple[bytes, ...]:
        """Identities of the live workers, sorted."""
        return self._live

    def get(self, worker_id: bytes) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def admit(self, worker_id: bytes, hello: WorkerHello, now: float) -> Admission:
        """Admit ``worker_id`` unless its hello disagrees with the service or with the workers
        already admitted (vocab_size, tokenizer_hash). A refused identity that was admitted
        before is removed: that identity now belongs to a process we cannot route to."""
        replaced = worker_id in self._workers
        reason = self._mismatch(worker_id, hello)
        if reason:
            self.remove(worker_id)
            return Admission(False, reason, replaced)
        if not replaced and len(self._workers) >= self.max_workers:
            return Admission(False, f"router already has max_workers={self.max_workers}")
        self._workers[worker_id] = WorkerInfo(worker_id, hello, now, now + self.ttl_s)
        self._refresh()
        return Admission(True, "", replaced)

    def _mismatch(self, worker_id: bytes, hello: WorkerHello) -> str:
        if hello.service != self.service:
            return f"worker serves {hello.service!r}, this router serves {self.service!r}"
        for other in self._workers.values():
            if other.worker_id == worker_id:
                continue
            ref = other.hello
            if (hello.vocab_size, hello.tokenizer_hash) != (ref.vocab_size, ref.tokenizer_hash):
                return (
                    f"vocab_size/tokenizer_hash {hello.vocab_size}/{hello.tokenizer_hash!r} differ "
                    f"from admitted workers' {ref.vocab_size}/{ref.tokenizer_hash!r}"
                )
        return ""

    def model_ids(self) -> set[str]:
        return {w.hello.model_id for w in self._workers.values()}

    def touch(self, worker_id: bytes, now: float) -> bool:
        """Any message from a worker proves it alive. False when the worker is not admitted."""
        info = self._workers.get(worker_id)
        if info is None:
            return False
        info.expires_at = now + self.ttl_s
        return True

    def remove(self, worker_id: bytes) -> WorkerInfo | None:
        info = self._workers.pop(worker_id, None)
        if info is not None:
            self._refresh()
        return info

    def expire(self, now: float) -> list[bytes]:
        """Remove and return the workers not heard from within ``ttl_s``."""
        dead = [w for w, info in self._workers.items() if info.expires_at <= now]
        for worker_id in dead:
            del self._workers[worker_id]
        if dead:
            self._refresh()
        return dead

    def pick(self, session_id: str) -> bytes | None:
        """The worker for the session's route key (``route_key``: its id, or its group): the one
        it was last given while that one is live, else the rendezvous hash over the live workers
        (None when there are none). Without the memory, a session that moved when its worker
        died would move back once a new process took the slot, and prefill its whole context
        there a second time; a worker added to scale out would take 1/N of the running sessions
        away from their caches. Past ``max_placements`` the least recently routed keys are
        forgotten: they go by the hash again (a CACHE_MISS at worst, as after a router restart)."""
        key = route_key(session_id)
        worker = self._placed.get(key)
        if worker is not None and worker in self._workers:
            self._placed.move_to_end(key)
            return worker
        worker = pick(key, self._live)
        if worker is None:
            self._placed.pop(key, None)
            return None
        self._placed[key] = worker
        self._placed.move_to_end(key)
        while len(self._placed) > self.max_placements:
            self._placed.popitem(last=False)
        return worker

    def ended(self, session_id: str) -> None:
        """A session ended: its placement is forgotten (a group's stays for its next sessions)."""
        if route_key(session_id) == session_id:
            self._placed.pop(session_id, None)

    def _refresh(self) -> None:
        self._live = tuple(sorted(self._workers))


@dataclass(slots=True)
class Inflight:
    """A request forwarded to a worker and not yet answered. ``client_id`` is the return
    address the worker saw (the client's token); ``route`` the client's routing id at the
    frontend (where the reply goes; the token when empty)."""

    client_id: bytes
    request_id: bytes
    session_id: str
    worker_id: bytes
    sent_at: float
    route: bytes = b""

    def __post_init__(self) -> None:
        if not self.route:
            self.route = self.client_id


class InflightTable:
    """Requests in flight, by (client_id, request_id) and by worker. At most ``max_entries``;
    entries older than ``ttl_s`` are swept (their clients timed out long ago)."""

    def __init__(self, *, max_entries: int = 65_536, ttl_s: float = 300.0) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[tuple[bytes, bytes], Inflight] = OrderedDict()
        self._by_worker: dict[bytes, set[tuple[bytes, bytes]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: Inflight) -> bool:
        """Track ``entry``; False (and nothing tracked) when the table is full."""
        key = (entry.client_id, entry.request_id)
        if key in self._entries:  # a client reused a request id: the newer request wins
            self.pop(*key)
        elif len(self._entries) >= self.max_entries:
            return False
        self._entries[key] = entry
        self._by_worker.setdefault(entry.worker_id, set()).add(key)
        return True

    def get(self, client_id: bytes, request_id: bytes) -> Inflight | None:
        return self._entries.get((client_id, request_id))

    def pop(self, client_id: bytes, request_id: bytes) -> Inflight | None:
        entry = self._entries.pop((client_id, request_id), None)
        if entry is not None:
            keys = self._by_worker.get(entry.worker_id)
            if keys is not None:
                keys.discard((client_id, request_id))
                if not keys:
                    del self._by_worker[entry.worker_id]
        return entry

    def pop_worker(self, worker_id: bytes) -> list[Inflight]:
        """Remove and return everything in flight on ``worker_id`` (oldest first)."""
        keys = self._by_worker.pop(worker_id, set())
        out = [self._entries.pop(k) for k in keys if k in self._entries]
        out.sort(key=lambda e: e.sent_at)
        return out

    def count(self, worker_id: bytes) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def sweep(self, now: float) -> list[Inflight]:
        """Remove and return entries older than ``ttl_s``."""
        out: list[Inflight] = []
        limit = now - self.ttl_s
        while self._entries:
            entry = next(iter(self._entries.values()))
            if entry.sent_at > limit:
                break
            self.pop(entry.client_id, entry.request_id)
            out.append(entry)
        return out


class EndCopies:
    """The END_SESSION copies a router sends to workers other than the session's.

    Sent ones wait for their acks (which nobody waits for) under a request id of the router's
    own (16 bytes, never one of its clients' 8-byte ids); an ack later than ``ttl_s`` is not one.
    A worker the router expired (silent, maybe only stalled) may come back holding caches of
    sessions that ended meanwhile: the ends are kept for it (``away`` / ``owe``) and sent when it
    is admitted again (``back``), for ``away_ttl_s`` (a worker's session TTL, 900 s by default)
    and at most ``max_owed`` a worker and ``max_away`` workers, the oldest dropped first."""

    def __init__(self, max_entries: int, ttl_s: float = 60.0, *, away_ttl_s: float = 900.0,
                 max_owed: int = 4096, max_away: int = 64) -> None:
        self._sent = BoundedTable(max_entries, ttl_s)
        self._ids = itertools.count()
        self._prefix = b"\xfe" + os.urandom(7)
        self.away_ttl_s, self.max_owed, self.max_away = away_ttl_s, max_owed, max_away
        self._owed: OrderedDict[bytes, tuple[float, deque]] = OrderedDict()  # worker -> (since, ends)

    def __len__(self) -> int:
        return len(self._sent)

    def next_id(self) -> bytes:
        return self._prefix + next(self._ids).to_bytes(8, "big")

    def sent(self, request_id: bytes, worker_id: bytes) -> None:
        self._sent.put(request_id, worker_id)

    def acked(self, request_id: bytes, worker_id: bytes) -> bool:
        """Whether this reply is the ack of a copy sent to ``worker_id`` (then forgotten)."""
        if not request_id.startswith(self._prefix) or self._sent.get(request_id, touch=False) != worker_id:
            return False
        self._sent.pop(request_id)
        return True

    def away(self, worker_id: bytes, now: float) -> None:
        """``worker_id`` was expired: keep the ends it misses from now on."""
        self._owed.pop(worker_id, None)
        self._owed[worker_id] = (now, deque(maxlen=self.max_owed))
        while len(self._owed) > self.max_away:
            self._owed.popitem(last=False)

    def owe(self, end: object, now: float) -> None:
        """An END_SESSION (``end``: what the router needs to send it) every absent worker misses."""
        while self._owed and now - next(iter(self._owed.values()))[0] > self.away_ttl_s:
            self._owed.popitem(last=False)
        for _, ends in self._owed.values():
            ends.append(end)

    def back(self, worker_id: bytes, now: float) -> list:
        """The ends ``worker_id`` missed while away (none: it was not, or too long ago)."""
        since, ends = self._owed.pop(worker_id, (now, ()))
        return list(ends) if now - since <= self.away_ttl_s else []
