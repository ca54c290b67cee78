"""SessionStore: per-session state bounded by max_sessions (LRU) and a TTL.

Thread-safe. A session evicted while a request is being served keeps working for that request
(the request holds a reference); the next request for it finds nothing and gets CACHE_MISS.
With a fixed pool of caches (``specsplit.engine.kvpool``) a new session may find none free: the
least recently used session no request holds makes room, and StoreFull says none does.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from specsplit.engine.kvcache import SessionKV


class StoreFull(Exception):
    """No cache can be made for a new session: every one is held by a request."""


@dataclass(eq=False)
class Session:
    session_id: str
    kv: SessionKV
    last_round: int = -1
    last_used: float = 0.0
    draft_tree: object = None  # a greedy draft tree kept for the next request (DraftEngine)
    specpv: object = None  # the SpecPV partial view beside the cache (TargetEngine; engine.specpv)
    # the committed tokens whose K/V the cache holds from position 0, as far as the worker can
    # name them (what a prefix cache keeps of it: Engine.take_prefix, Engine.keep_prefix)
    tokens: list = field(default_factory=list)
    prompt_path: int = 0  # leading positions prefilled on a prompt attention (TargetEngine)
    reused: int = 0  # tokens the last request copied from the prefix cache
    dropped: bool = False  # removed after a failure: its cache is not to be trusted
    grammar: object = None  # the grammar's state of a constrained session (engine.grammar.SessionGrammar)
    penalties: object = None  # a penalized session's committed tokens (engine.penalties.PenaltyState)
    lock: threading.Lock = field(default_factory=threading.Lock)


class SessionStore:
    """LRU + TTL map of session_id -> Session."""

    def __init__(
        self,
        make_kv: Callable[[], SessionKV],
        *,
        max_sessions: int = 64,
        ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[Session], None] | None = None,
    ):
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self._make_kv, self.max_sessions, self.ttl_s, self._clock = make_kv, max_sessions, ttl_s, clock
        # called with every session removed (expired, evicted, dropped, ended): a cache that lives
        # outside the session object (a llama.cpp context's cells) frees it there
        self._on_evict = on_evict or (lambda s: None)
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0

    def _expire_locked(self, now: float) -> None:
        while self._sessions:
            sid, s = next(iter(self._sessions.items()))
            if now - s.last_used <= self.ttl_s:
                break
            del self._sessions[sid]
            self.evicted += 1
            self._on_evict(s)

    def _new_kv_locked(self) -> SessionKV:
        """A cache for a new session. ``make_kv`` returns None when a fixed pool of caches is full
        (``specsplit.engine.kvpool``): then the least recently used session no request holds is
        evicted (its ``on_evict`` frees its cache) until one is made. StoreFull when every
        session is held by a request: nothing was evicted then (unless a request took a victim's
        lock as it was evicted, which retires that victim's cache instead of freeing it)."""
        kv = self._make_kv()
        while kv is None:
            victim = next((s for s in self._sessions.values() if not s.lock.locked()), None)
            if victim is None:
                raise StoreFull(f"every one of the worker's {len(self._sessions)} session caches is in use")
            del self._sessions[victim.session_id]
            self.evicted += 1
            self._on_evict(victim)
            kv = self._make_kv()
        return kv

    def get(self, session_id: str) -> Session | None:
        """The live session, touched (most recently used), or None."""
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            s = self._sessions.get(session_id)
            if s is not None:
                s.last_used = now
                self._sessions.move_to_end(session_id)
            return s

    def get_or_create(self, session_id: str) -> Session:
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            s = self._sessions.get(session_id)
            if s is None:
                kv = self._new_kv_locked()
                while len(self._sessions) >= self.max_sessions:
                    _, old = self._sessions.popitem(last=False)
                    self.evicted += 1
                    self._on_evict(old)
                s = Session(session_id, kv, last_used=now)
                self._sessions[session_id] = s
            else:
                s.last_used = now
                self._sessions.move_to_end(session_id)
            return s

    def drop(self, session: Session) -> None:
        """Remove exactly this session object (not a newer one under the same id)."""
        session.dropped = True
        with self._lock:
            if self._sessions.get(session.session_id) is session:
                del self._sessions[session.session_id]
                self._on_evict(session)

    def end_session(self, session_id: str) -> bool:
        with self._lock:
            s = self._sessions.pop(session_id, None)
            if s is not None:
                self._on_evict(s)
            return s is not None

    def clear(self) -> list[Session]:
        """Remove every session without calling ``on_evict``; returns them."""
        with self._lock:
            out = list(self._sessions.values())
            self._sessions.clear()
            self.evicted += len(out)
            return out

    def oldest(self, keep: Callable[[Session], bool] = lambda s: False) -> Session | None:
        """The least recently used session for which ``keep`` is False, or None."""
        with self._lock:
            return next((s for s in self._sessions.values() if not keep(s)), None)

    def evict_oldest(self, keep: Callable[[Session], bool] = lambda s: False) -> Session | None:
        """Remove (and return) the least recently used session for which ``keep`` is False."""
        with self._lock:
            victim = next((s for s in self._sessions.values() if not keep(s)), None)
            if victim is not None:
                del self._sessions[victim.session_id]
                self.evicted += 1
                self._on_evict(victim)
            return victim

    def sweep(self) -> None:
        with self._lock:
            self._expire_locked(self._clock())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def bytes_by_session(self) -> dict[str, int]:
        with self._lock:
            return {sid: s.kv.nbytes + getattr(s.specpv, "nbytes", 0) for sid, s in self._sessions.items()}

    def bytes_held(self) -> int:
        return sum(self.bytes_by_session().values())
