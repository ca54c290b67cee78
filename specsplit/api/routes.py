"""Conversation affinity without a key: a request that continues an earlier one goes where it went.

The API is stateless, so a conversation's next turn resends the whole history, and every request
is a new session routed by a hash of its id: with N target workers a turn meets the worker whose
prefix cache holds the last turn one time in N. ``prompt_cache_key`` fixes that for clients that
send it; most OpenAI clients do not.

``PromptRoutes`` remembers recent prompts (a 16-byte digest and the length of each, under its
routing group; least recently used out first), each without its last token: a chat template's
generation prompt ends in a newline that the answer's text, sent back in the next turn, may be
tokenized into. A request whose prompt begins with a whole earlier prompt so held (the last
turn's, or the same prompt again) takes that prompt's group, so the router
(``brokers.rendezvous.route_key``) sends it to the same draft and target workers; any other
request starts a group of its own, spread as any new session is. Only whole earlier prompts
count, never a shared part of them: conversations that share a system prompt (or few-shot
examples) but not their turns stay spread over the workers, as do their loads. Torch-free.
"""

from __future__ import annotations

import bisect
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from hashlib import blake2b

DIGEST_BYTES = 16


class PromptRoutes:
    """Groups of recent prompts, bounded by ``max_entries`` (0: off, every request its own)."""

    def __init__(self, max_entries: int, on_route: Callable[[bool], None] | None = None) -> None:
        self.max_entries = max_entries
        self.on_route = on_route  # told of each request routed: True when it continued a remembered prompt
        self._groups: OrderedDict[tuple[int, bytes], str] = OrderedDict()  # (length, digest) -> group
        self._lengths: list[int] = []  # the distinct lengths held, sorted
        self._count: dict[int, int] = {}  # entries held per length

    def __len__(self) -> int:
        return len(self._groups)

    def group_for(self, ids: Sequence[int]) -> str | None:
        """The routing group of the longest remembered prompt that ``ids`` begins with, else a new
        one; ``ids`` is remembered under it (less its last token). None when off or ``ids`` is
        empty."""
        if self.max_entries <= 0 or not ids:
            return None
        data = array("q", ids).tobytes()  # checked ids (below the vocabulary's size)
        held = max(len(ids) - 1, 1)  # remembered without its last token (where the answer's text joins)
        known = self._lengths[:bisect.bisect_right(self._lengths, len(ids))]
        h, at, found, mine = blake2b(digest_size=DIGEST_BYTES), 0, None, b""
        for n in sorted({*known, held}):  # ascending: one pass over the prompt
            h.update(data[8 * at:8 * n])
            at = n
            key = (n, h.digest())
            if n == held:
                mine = key[1]
            if key in self._groups:
                found = key
        group = uuid.uuid4().hex[:16]
        if found is not None:
            group = self._groups[found]
            self._groups.move_to_end(found)
        self._remember((held, mine), group)
        if self.on_route is not None:
            self.on_route(found is not None)
        return group

    def _remember(self, key: tuple[int, bytes], group: str) -> None:
        if key in self._groups:
            self._groups.move_to_end(key)
            self._groups[key] = group
            return
        self._groups[key] = group
        n = key[0]
        if n not in self._count:
            bisect.insort(self._lengths, n)
        self._count[n] = self._count.get(n, 0) + 1
        while len(self._groups) > self.max_entries:
            (old, _), _ = self._groups.popitem(last=False)
            self._count[old] -= 1
            if not self._count[old]:
                del self._count[old]
                del self._lengths[bisect.bisect_left(self._lengths, old)]
