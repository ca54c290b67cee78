"""An Anthropic Messages API answer (``specsplit.api.messages``): the message object and its
stream's events, built from a generation's events. No torch.

Blocks come in the order written: a ``text`` block while text comes, a ``tool_use`` block per
call (its input whole, in one ``input_json_delta``), text after a call a new block. An answer
with no text and no call is one empty text block. ``stop_reason``: ``end_turn``, ``max_tokens``,
``stop_sequence`` (with the one met), ``tool_use``, or ``model_context_window_exceeded`` (a
budget past the context, cut to it, ran out). Usage, as Anthropic counts it:
``input_tokens`` are the prompt's tokens the target computed, ``cache_read_input_tokens`` those
its prefix cache held (their sum is the prompt).
"""

from __future__ import annotations

import json
import uuid

from specsplit.api.generation import Delta, Done


class MessageBuilder:
    """One message and its stream's events, from the generation's events."""

    def __init__(self, model: str, prompt_tokens: int, window: bool = False) -> None:
        """``window``: the budget was cut to the context's room (a length end is the context's)."""
        self.model, self.prompt_tokens, self.window = model, prompt_tokens, window
        self.id = f"msg_{uuid.uuid4().hex}"
        self.content: list[dict] = []
        self.open: int | None = None  # the index of the text block text goes to now
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = self._usage(0, 0)
        self.started = False  # the stream's opening events went out

    def _usage(self, cached: int, output: int) -> dict:
        return {"input_tokens": self.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": output, "service_tier": "standard"}

    def message(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": self.usage}

    def start(self) -> list[dict]:
        """The stream's opening events, once (a stream kept alive opens before its first tokens)."""
        if self.started:
            return []
        self.started = True
        return [{"type": "message_start", "message": {**self.message(), "content": []}}, {"type": "ping"}]

    def _text(self, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if self.open is None:
            self.content.append({"type": "text", "text": ""})
            self.open = len(self.content) - 1
            events.append({"type": "content_block_start", "index": self.open,
                           "content_block": {"type": "text", "text": ""}})
        self.content[self.open]["text"] += text
        events.append({"type": "content_block_delta", "index": self.open,
                       "delta": {"type": "text_delta", "text": text}})
        return events

    def _close(self) -> list[dict]:
        index, self.open = self.open, None
        return [] if index is None else [{"type": "content_block_stop", "index": index}]

    def _call(self, call) -> list[dict]:
        events = self._close()
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        if not isinstance(arguments, dict):  # (a call's arguments are an object; keep what was written)
            arguments = {"value": arguments}
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": arguments}
        self.content.append(block)
        index = len(self.content) - 1
        return [*events,
                {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": json.dumps(arguments, ensure_ascii=False)}},
                {"type": "content_block_stop", "index": index}]

    def feed(self, ev: Delta | Done) -> list[dict]:
        """The events one of the generation's events makes; after its Done, the last ones."""
        events = self._text(ev.text)
        for call in ev.calls:
            events += self._call(call)
        if isinstance(ev, Done):
            if not self.content:  # an empty answer is an empty text block
                self.content.append({"type": "text", "text": ""})
                self.open = 0
                events.append({"type": "content_block_start", "index": 0,
                               "content_block": {"type": "text", "text": ""}})
            events += self._close()
            length = "model_context_window_exceeded" if self.window else "max_tokens"
            self.stop_reason = {"length": length, "tool_calls": "tool_use"}.get(ev.finish_reason, "end_turn")
            if ev.stop_word is not None and self.stop_reason == "end_turn":
                self.stop_reason, self.stop_sequence = "stop_sequence", ev.stop_word
            self.prompt_tokens = ev.prompt_tokens
            self.usage = self._usage(min(ev.cached_tokens, ev.prompt_tokens), ev.completion_tokens)
            usage = {k: v for k, v in self.usage.items() if k != "service_tier"}
            events += [{"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                           "stop_sequence": self.stop_sequence}, "usage": usage},
                       {"type": "message_stop"}]
        return events
