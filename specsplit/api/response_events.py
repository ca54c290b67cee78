"""A Responses API answer (``specsplit.api.responses``): the response object and its stream's
typed events, built from a generation's events. No torch."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from specsplit.api.generation import Delta, Done
from specsplit.api.logprobs import chat_logprobs
from specsplit.api.protocol import ApiError
from specsplit.api.streaming import event_bytes  # noqa: F401  (responses.py's)

if TYPE_CHECKING:
    from specsplit.api.responses import ResponsesRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def qualified(namespace: str, name: str) -> str:
    """A namespace's function as the model sees it and calls it: ``<namespace>__<name>`` (the
    chat templates take flat function lists; MCP clients name their servers' tools alike)."""
    return f"{namespace}__{name}"


def namespaced(tools: list[dict[str, Any]] | None) -> dict[str, tuple[str, str]]:
    """The qualified name of each function in a ``namespace`` tool: its namespace and name."""
    return {qualified(t["name"], f.get("name")): (t["name"], f.get("name"))
            for t in tools or () if t.get("type") == "namespace" for f in t["tools"]}


class Builder:
    """One response's object and its stream's events (``sequence_number`` in order), built from
    the generation's events: a message item while text comes, a function_call item per call."""

    def __init__(self, req: ResponsesRequest, model: str, piece) -> None:
        self.req, self.model, self.piece = req, model, piece
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.items: list[dict] = []
        self.message: dict | None = None  # the message item text goes to now
        self.seq = 0
        self.status = "queued" if req.background else "in_progress"
        self.usage, self.incomplete, self.error = None, None, None
        self.namespaces = namespaced(req.tools)  # a qualified name called: its namespace and name

    def response(self) -> dict:
        r = self.req
        tools = [{**t, "strict": t.get("strict") is not False} if t.get("type") == "function" else t
                 for t in r.tools or ()]
        fmt = (r.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status,
            "completed_at": int(time.time()) if self.status == "completed" else None,
            "error": self.error, "incomplete_details": self.incomplete, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "model": self.model, "output": self.items,
            "parallel_tool_calls": r.parallel_tool_calls is not False,  # (the default: true)
            "previous_response_id": r.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": r.store, "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": fmt, "verbosity": "medium"}, "tool_choice": r.tool_choice or "auto", "tools": tools,
            "top_logprobs": r.top_logprobs or 0, "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": "disabled", "usage": self.usage, "user": r.user, "metadata": r.metadata or {},
            "background": bool(r.background), "service_tier": "default", "prompt_cache_key": r.prompt_cache_key,
            "safety_identifier": r.safety_identifier, "max_tool_calls": None,
        }

    def _event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        """The first events: created, then in progress (queued, for a background response, until
        its generation begins: ``begin``)."""
        return [self._event("response.created", response=self.response()),
                self._event(f"response.{self.status}", response=self.response())]

    def begin(self) -> list[dict]:
        self.status = "in_progress"
        return [self._event("response.in_progress", response=self.response())]

    def cancel(self) -> None:
        """A background response cancelled: what it had written so far, its open item incomplete."""
        if self.message is not None:
            self.message["status"], self.message = "incomplete", None
        self.status = "cancelled"

    def _logprobs(self, entries) -> list[dict]:
        asked = LOGPROBS_INCLUDE in (self.req.include or ())
        return chat_logprobs(list(entries), self.piece)["content"] if asked and entries else []

    def _text(self, text: str, logprobs) -> list[dict]:
        if not text and not logprobs:
            return []
        events = []
        if self.message is None:
            self.message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                            "role": "assistant", "content": []}
            self.items.append(self.message)
            events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                      item={**self.message, "content": []}))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.message["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=self.message["id"],
                                      output_index=len(self.items) - 1, content_index=0, part=dict(part)))
        part, lp = self.message["content"][0], self._logprobs(logprobs)
        part["text"] += text
        part["logprobs"].extend(lp)
        events.append(self._event("response.output_text.delta", item_id=self.message["id"],
                                  output_index=self.items.index(self.message), content_index=0, delta=text,
                                  logprobs=lp))
        return events

    def _close_message(self, status: str) -> list[dict]:
        m, self.message = self.message, None
        if m is None:
            return []
        m["status"] = status
        index, part = self.items.index(m), m["content"][0]
        return [self._event("response.output_text.done", item_id=m["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=part["logprobs"]),
                self._event("response.content_part.done", item_id=m["id"], output_index=index, content_index=0,
                            part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=dict(m))]

    def _call(self, call) -> list[dict]:
        events = self._close_message("completed")
        namespace, name = self.namespaces.get(call.name, (None, call.name))
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed", "call_id": call.id,
                "name": name, "arguments": call.arguments, **({"namespace": namespace} if namespace else {})}
        self.items.append(item)
        index = len(self.items) - 1
        return [*events,
                self._event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=call.arguments),
                self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=name, arguments=call.arguments),
                self._event("response.output_item.done", output_index=index, item=dict(item))]

    def feed(self, ev: Delta | Done) -> list[dict]:
        """The events one of the generation's events makes; after its Done, the last one."""
        events = self._text(ev.text, ev.logprobs)
        for call in ev.calls:
            events += self._call(call)
        if isinstance(ev, Done):
            cut = ev.finish_reason == "length"
            if not self.items:  # an empty answer is an empty message
                events += self._empty()
            events += self._close_message("incomplete" if cut else "completed")
            self.status = "incomplete" if cut else "completed"
            self.incomplete = {"reason": "max_output_tokens"} if cut else None
            self.usage = {"input_tokens": ev.prompt_tokens, "input_tokens_details": {"cached_tokens": ev.cached_tokens},
                          "output_tokens": ev.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": ev.prompt_tokens + ev.completion_tokens}
            events.append(self._event(f"response.{self.status}", response=self.response()))
        return events

    def _empty(self) -> list[dict]:
        self.message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                        "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": [],
                                                          "logprobs": []}]}
        self.items.append(self.message)
        return [self._event("response.output_item.added", output_index=len(self.items) - 1,
                            item={**self.message, "content": []}),
                self._event("response.content_part.added", item_id=self.message["id"],
                            output_index=len(self.items) - 1, content_index=0, part=dict(self.message["content"][0]))]

    def fail(self, error: ApiError) -> list[dict]:
        self.status = "failed"
        self.error = {"code": error.code or ("server_error" if error.status >= 500 else "invalid_request"),
                      "message": error.message}
        return [self._event("response.failed", response=self.response())]

    def assistant_turn(self) -> dict:
        """The output as the chat turn a later response continues after."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function", "function": {
            "name": qualified(i["namespace"], i["name"]) if "namespace" in i else i["name"],
            "arguments": i["arguments"]}} for i in self.items if i["type"] == "function_call"]
        turn: dict = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            turn["tool_calls"] = calls
        return turn
