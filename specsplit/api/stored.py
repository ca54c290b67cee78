"""Responses kept for ``GET /v1/responses/{id}`` and ``previous_response_id`` (the Responses API's
``store``): in this API process's memory, the oldest out first past a count or a size. No torch.

Each API process keeps its own: behind several API replicas, a response is found only through
the replica that made it (``specsplit.api.responses``; docs/operations.md).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Stored:
    response: dict  # the response object, as it was answered
    messages: tuple[dict, ...]  # its conversation as chat turns (instructions left out), its output last
    items: tuple[dict, ...]  # its own input items, as ``GET /v1/responses/{id}/input_items`` lists them
    size: int  # bytes, as counted against the store's limit


class ResponseStore:
    """At most ``count`` responses and ``max_bytes`` of them (their JSON's length)."""

    def __init__(self, count: int, max_bytes: int) -> None:
        self.count, self.max_bytes = count, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, response: dict, messages: list[dict], items: list[dict] = ()) -> bool:
        """Keep a response (False: the store is off, or it alone is over the size limit)."""
        size = len(json.dumps(response)) + len(json.dumps(messages)) + len(json.dumps(list(items)))
        if self.count == 0 or size > self.max_bytes:
            return False
        self.delete(rid)
        self._items[rid] = Stored(response, tuple(messages), tuple(items), size)
        self.bytes += size
        while len(self._items) > self.count or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, rid: str) -> Stored | None:
        found = self._items.get(rid)
        if found is not None:
            self._items.move_to_end(rid)  # a conversation going on stays
        return found

    def delete(self, rid: str) -> bool:
        old = self._items.pop(rid, None)
        if old is not None:
            self.bytes -= old.size
        return old is not None
