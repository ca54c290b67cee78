"""Rendezvous (highest-random-weight) hashing of a session id over worker keys.

Each (session, worker) pair gets a 64-bit blake2b score; a session goes to the worker with the
highest score. Properties the router relies on (tested in tests/test_brokers.py):
- stable: the choice depends only on the session id and the *set* of workers (not their order);
- minimal movement: removing a worker moves only the sessions it held;
- uniform: sessions spread evenly over workers.
Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b


ROUTE_SEP = "~"  # a session id "GROUP~UNIQUE" is routed by GROUP: its sessions share a worker


def route_key(session_id: str) -> str:
    """What a session is routed by: the part of its id before the first "~" when that part is
    not empty (sessions of one group, e.g. a conversation's turns, go to one worker, whose
    prefix cache holds what they share), else the whole id."""
    group, sep, _ = session_id.partition(ROUTE_SEP)
    return group if sep and group else session_id


def _session_bytes(session_id: str | bytes) -> bytes:
    return session_id.encode() if isinstance(session_id, str) else bytes(session_id)


def score(session_id: str | bytes, worker_key: bytes) -> int:
    """64-bit blake2b of session || worker key (the session is length-prefixed, so that
    ("ab", "c") and ("a", "bc") cannot collide by concatenation)."""
    sid = _session_bytes(session_id)
    h = blake2b(len(sid).to_bytes(2, "big") + sid + worker_key, digest_size=8)
    return int.from_bytes(h.digest(), "big")


def rank(session_id: str | bytes, worker_keys: Iterable[bytes]) -> list[bytes]:
    """Worker keys ordered from most to least preferred for ``session_id``."""
    sid = _session_bytes(session_id)
    return sorted(worker_keys, key=lambda k: (score(sid, k), k), reverse=True)


def pick(session_id: str | bytes, worker_keys: Iterable[bytes]) -> bytes | None:
    """The worker key for ``session_id``, or None when there are no workers."""
    sid = _session_bytes(session_id)
    best: bytes | None = None
    best_score = (-1, b"")
    for key in worker_keys:
        s = (score(sid, key), key)
        if s > best_score:
            best, best_score = key, s
    return best
