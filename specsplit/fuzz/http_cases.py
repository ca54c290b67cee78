"""HTTP fuzzer, part 1: seeded cases against ``specsplit api`` and what each may be answered.

A case is one connection: either a request sent with httpx (``HTTPX``; ``STREAM_CUT``: a stream
read for a few events, then hung up) or ``RAW`` steps written to a socket (send, trickle a byte at
a time, sleep, half-close, hang up). It carries its oracle: the statuses it may get (``expect``,
always within ``DOCUMENTED``), whether the server may close it unanswered (``may_close``: slow,
truncated and hung-up cases only) and, for a well-formed request, the answer's shape.

Case ``i`` of seed ``s`` comes from its own ``random.Random(f"{s}/{i}")``: any one case is
rebuilt alone from (seed, index), whatever ran before it. The families (``http_families``): valid
requests, wrong types for every field of both request schemas (read from the schemas), unknown
fields, huge fields, malformed JSON, wrong methods and paths, bad headers, slow, truncated and
hung-up requests. Torch-free and socket-free.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
from dataclasses import dataclass, field

from specsplit.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions, TextPart
from specsplit.api.messages import MessagesRequest
from specsplit.api.responses import ResponsesRequest

HTTPX, RAW, STREAM_CUT = "httpx", "raw", "stream_cut"
DOCUMENTED = frozenset({200, 400, 404, 405, 408, 413, 429, 503})
COMPLETIONS, CHAT, RESPONSES, MESSAGES = "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"
SLACK_S = 4.0  # beyond a server timeout, what a loaded box may add before the close is seen
ANSWER_BOUND_S = 20.0  # an error or a small generation
LONG_BOUND_S = 90.0  # a valid request that may generate up to the context length
WORDS = ("the", "cat", "sat", "on", "a", "mat", "hello", "world", "fuzz", "token", "zero", "one", "é", "日本", "🙂")
BAD_VALUES = (None, True, False, "x", "", "1", "true", 1.5, -1, 0, -0.0, 2**53 + 1, 2**64, -(2**63) - 1, 10**40,
              1e308, float("nan"), float("inf"), float("-inf"), [], {}, [1, 2], ["x"], [None], {"a": 1}, [[[]]],
              "é" * 3000, "\ud800", [1.5], [True])
DELETE = object()  # a field left out
RESPONSE_FORMATS = [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {
    "name": "n", "schema": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}}]
# vLLM's constraints (one a request: never with a response_format that is one)
STRUCTURED = [("structured_outputs", {"choice": ["yes", "no"]}), ("structured_outputs", {"regex": "[a-c]{1,3}"}),
              ("structured_outputs", {"json": {"type": "integer"}, "disable_any_whitespace": True}),
              ("guided_grammar", 'root ::= "x" | "y" "z"?'), ("guided_json", {"type": "object"})]


@dataclass(frozen=True)
class HttpCase:
    index: int
    family: str  # "family/variant", for reports
    transport: str  # HTTPX | RAW | STREAM_CUT
    method: str = "POST"
    path: str = COMPLETIONS
    headers: tuple[tuple[str, str], ...] = ()  # HTTPX / STREAM_CUT
    body: bytes = b""  # HTTPX / STREAM_CUT
    steps: tuple[tuple, ...] = ()  # RAW: ("send", b) ("trickle", b, interval_s) ("sleep", s) ("eof",) ("hangup",)
    expect: frozenset[int] = frozenset({400})
    may_close: bool = False  # the server may close it unanswered
    shape: str = ""  # a 200 must be: "completion" | "chat" | "response" | "message" | "json" | "text" ("" : any)
    stream: bool = False  # a 200 is an event stream
    choices: int = 1  # choices a completion / chat answer holds
    events: int = 0  # STREAM_CUT: events read before hanging up
    bound_s: float = ANSWER_BOUND_S  # from connecting to the answer (or the server's close)

    def reproducer(self, limit: int = 600) -> str:
        """What was sent, as Python literals (long bytes cut, with their full length)."""
        def cut(b: bytes) -> str:
            return repr(b[:limit]) + (f"...<{len(b)} bytes>" if len(b) > limit else "")

        if self.transport == RAW:
            steps = ", ".join(f"({s[0]!r}, {cut(s[1])}{''.join(f', {x!r}' for x in s[2:])})" if len(s) > 1
                              and isinstance(s[1], bytes) else repr(s) for s in self.steps)
            return f"raw socket steps: [{steps}]"
        extra = f", read {self.events} events then hang up" if self.transport == STREAM_CUT else ""
        return f"httpx {self.method} {self.path} headers={list(self.headers)} body={cut(self.body)}{extra}"


@dataclass
class Draft:
    """A case being built: a body object (or raw bytes) and its expectation."""

    path: str
    obj: object = None
    raw: bytes | None = None
    expect: set[int] = field(default_factory=lambda: {400})
    shape: str = ""
    choices: int = 1

    def data(self, ensure_ascii: bool = True) -> bytes:
        if self.raw is not None:
            return self.raw
        return encode(self.obj, ensure_ascii)


def encode(obj, ensure_ascii: bool = True) -> bytes:
    """JSON as a client might write it (NaN / Infinity literals and lone surrogates kept)."""
    return json.dumps(obj, ensure_ascii=ensure_ascii, separators=(",", ":")).encode("utf-8", "surrogatepass")


def raw_request(method: str, path: str, body: bytes, headers: list[str] | None = None,
                version: str = "HTTP/1.1") -> bytes:
    head = [f"{method} {path} {version}", "Host: 127.0.0.1", "Connection: close"]
    head += ["Content-Type: application/json", f"Content-Length: {len(body)}"] if headers is None else headers
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def schema_fields(chat: bool) -> list[str]:
    """Every field of a request schema, nested ones as dotted paths (from the schemas themselves)."""
    top = list((ChatCompletionRequest if chat else CompletionRequest).model_fields)
    nested = [f"stream_options.{f}" for f in StreamOptions.model_fields]
    if chat:
        nested += [f"messages.0.{f}" for f in ChatMessage.model_fields]
        nested += ["messages.0", "messages.0.content.0"] + [f"messages.0.content.0.{f}" for f in TextPart.model_fields]
    else:
        nested += ["prompt.0", "stop.0"]
    return top + nested


def response_fields() -> list[str]:
    """Every field of the Responses API's request, and the input's and text format's parts."""
    return [*ResponsesRequest.model_fields, "input.0", "input.0.type", "input.0.role", "input.0.content",
            "input.0.content.0", "input.0.content.0.type", "input.0.content.0.text", "text.format", "text.format.type",
            "text.format.schema", "tools.0", "tools.0.name", "tools.0.parameters", "include.0", "metadata.k"]


# the Responses API's optional fields, with values it takes
RESPONSE_OPTIONS = (
    ("top_p", [0.5, 1.0]), ("top_k", [-1, 0, 5]), ("seed", [0, 7]), ("stop", ["\n", ["a", "the"]]), ("user", ["u1"]),
    ("store", [False, True]), ("metadata", [{"k": "v"}]), ("prompt_cache_key", ["k1"]), ("truncation", ["disabled"]),
    ("text", [{"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {"format": {
        "type": "json_schema", "name": "n", "schema": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}}]),
    ("include", [["message.output_text.logprobs"]]), ("top_logprobs", [0, 3]), ("parallel_tool_calls", [False]),
    ("reasoning", [{"effort": None}]), ("service_tier", ["auto"]), ("instructions", ["Be brief."]),
    # what Codex CLI sends with every request (tests/data/codex-request.json)
    ("client_metadata", [{"x-codex-window-id": "w:0", "turn_id": "t1"}]), ("reasoning", [{"summary": "auto"}]),
    ("include", [["reasoning.encrypted_content"]]),
)


def message_fields() -> list[str]:
    """Every field of the Messages API's request, and its messages', blocks', tools' and format's parts."""
    return [*MessagesRequest.model_fields, "messages.0", "messages.0.role", "messages.0.content",
            "messages.0.content.0", "messages.0.content.0.type", "messages.0.content.0.text", "system.0",
            "system.0.text", "tools.0", "tools.0.name", "tools.0.input_schema", "tool_choice.type",
            "output_config.format", "output_config.format.schema", "metadata.user_id", "stop_sequences.0"]


# the Messages API's optional fields, with values it takes
MESSAGE_OPTIONS = (
    ("top_p", [0.5, 1.0]), ("top_k", [0, 5]), ("stop_sequences", [["\n"], ["a", "the"]]),
    ("metadata", [{"user_id": "u1"}]), ("service_tier", ["auto"]),
    # what Claude Code sends with every request (tests/data/claude-code-request.json)
    ("thinking", [{"type": "disabled"}, {"type": "adaptive"}, {"type": "enabled", "budget_tokens": 1024}]),
    ("context_management", [{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}]),
    ("diagnostics", [{"request_id": "r1"}]),
    ("system", ["Be brief.", [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]]),
    ("output_config", [{"format": {"type": "json_schema", "schema": {"type": "array", "items": {"type": "integer"},
                                                                     "maxItems": 3}}}, {"effort": "high"}]),
)  # (no tools: the fuzzed fleet's tiny template takes none)


class Builder:
    """Valid bodies, and drafts finished into cases, for an API serving ``model`` that takes
    bodies up to ``max_body`` bytes, headers within ``header_timeout_s``, bodies within
    ``body_timeout_s`` (the families in ``http_families`` build on it)."""

    def __init__(self, seed: int, *, model: str, max_body: int, header_timeout_s: float,
                 body_timeout_s: float) -> None:
        self.seed, self.model, self.max_body = seed, model, max_body
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.rng = random.Random(seed)

    # ---------------------------------------------------------------- valid bodies
    def ids(self, lo: int = 1, hi: int = 24) -> list[int]:
        return [self.rng.randrange(3, 256) for _ in range(self.rng.randint(lo, hi))]

    def text(self, lo: int = 1, hi: int = 8) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))

    def sampling(self, body: dict) -> None:
        g = self.rng
        body["temperature"] = g.choice([0, 0, 0.7, 1.0, 2])
        for name, values in (("top_p", [0.5, 1.0]), ("top_k", [-1, 0, 5]), ("seed", [0, 7, 2**63, -(2**63)]),
                             ("stop", ["\n", ["a", "the"]]), ("user", ["u1"]), ("frequency_penalty", [0, 0.5]),
                             ("presence_penalty", [-0.5, 1]), ("repetition_penalty", [1, 1.2]),
                             ("logit_bias", [{"5": 2.0}, {"7": -100, "9": 1}]),
                             ("logprobs", [None]), ("response_format", RESPONSE_FORMATS)):
            if g.random() < 0.2:
                body[name] = g.choice(values)
        if g.random() < 0.1 and body.get("response_format", {"type": "text"})["type"] == "text":
            name, value = g.choice(STRUCTURED)
            body[name] = value

    def completion(self, stream: bool | None = None, max_tokens: int | None = None) -> Draft:
        g = self.rng
        kind = g.random()
        prompt = (self.ids() if kind < 0.5 else self.text() if kind < 0.8 else
                  [self.ids(1, 8) for _ in range(g.randint(1, 3))] if kind < 0.9 else [self.text(), self.text()])
        n = g.choice([1, 1, 1, 2])
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens or g.randint(1, 4), "n": n}
        self.sampling(body)
        if g.random() < 0.15:
            body["logprobs"] = g.choice([0, 2, 20])
        self._stream(body, stream)
        prompts = len(prompt) if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1
        return Draft(COMPLETIONS, body, expect={200}, shape="completion", choices=n * prompts)

    def chat(self, stream: bool | None = None, max_tokens: int | None = None) -> Draft:
        g = self.rng
        content = self.text() if g.random() < 0.7 else [{"type": "text", "text": self.text()}]
        messages = ([{"role": g.choice(["system", "developer"]), "content": self.text()}] if g.random() < 0.4 else [])
        messages.append({"role": "user", "content": content})
        budget = max_tokens or g.randint(1, 4)
        body = {"model": self.model, "messages": messages}
        for name in g.choice([["max_tokens"], ["max_completion_tokens"], ["max_tokens", "max_completion_tokens"]]):
            body[name] = budget
        self.sampling(body)
        if g.random() < 0.15:
            body["logprobs"] = True
            if g.random() < 0.5:
                body["top_logprobs"] = g.choice([0, 3, 20])
        self._stream(body, stream)
        return Draft(CHAT, body, expect={200}, shape="chat")

    def responses(self, stream: bool | None = None, max_tokens: int | None = None) -> Draft:
        """A Responses API request: a text, or message items (a system or developer turn first
        now and then; text or input_text parts)."""
        g = self.rng
        if g.random() < 0.5:
            given: str | list = self.text()
        else:
            content = self.text() if g.random() < 0.5 else [{"type": "input_text", "text": self.text()}]
            given = [{"role": g.choice(["system", "developer"]), "content": self.text()}] if g.random() < 0.3 else []
            given.append({"type": "message", "role": "user", "content": content} if g.random() < 0.5
                         else {"role": "user", "content": content})
        body = {"model": self.model, "input": given, "max_output_tokens": max_tokens or g.randint(1, 4),
                "temperature": g.choice([0, 0, 0.7, 1.0, 2])}
        for name, values in RESPONSE_OPTIONS:
            if g.random() < 0.15:
                body[name] = copy.deepcopy(g.choice(values))  # (cases change their bodies' parts)
        if stream if stream is not None else g.random() < 0.3:
            body["stream"] = True
        return Draft(RESPONSES, body, expect={200}, shape="response")

    def messages(self, stream: bool | None = None, max_tokens: int | None = None) -> Draft:
        """An Anthropic Messages API request: a text, or text blocks; an assistant's prefill now and then."""
        g = self.rng
        content = self.text() if g.random() < 0.5 else [{"type": "text", "text": self.text()}]
        messages = [{"role": "user", "content": content}]
        if g.random() < 0.15:
            messages.append({"role": "assistant", "content": self.text()})
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens or g.randint(1, 4),
                "temperature": g.choice([0, 0, 0.7, 1.0])}
        for name, values in MESSAGE_OPTIONS:
            if g.random() < 0.12 and not (name == "output_config" and len(messages) > 1):
                body[name] = copy.deepcopy(g.choice(values))
        if stream if stream is not None else g.random() < 0.3:
            body["stream"] = True
        return Draft(MESSAGES, body, expect={200}, shape="message")

    def _stream(self, body: dict, stream: bool | None) -> None:
        if stream if stream is not None else self.rng.random() < 0.3:
            body["stream"] = True
            if self.rng.random() < 0.5:
                body["stream_options"] = {"include_usage": self.rng.random() < 0.5}

    def request(self) -> Draft:
        return self.completion() if self.rng.random() < 0.6 else self.chat()

    # ---------------------------------------------------------------- finishing a case
    def httpx_case(self, index: int, family: str, d: Draft, method: str = "POST",
                   headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)) -> HttpCase:
        body = d.data(self.rng.random() < 0.5)
        expect = self.over_limit(body, d.expect)
        return HttpCase(index, family, HTTPX, method, d.path, headers, body, expect=frozenset(expect),
                        shape=d.shape, stream=self.streams(d), choices=d.choices, bound_s=self.bound(d))

    def raw_case(self, index: int, family: str, d: Draft, steps: list[tuple], *, may_close: bool = False,
                 bound_s: float | None = None, body: bytes | None = None) -> HttpCase:
        expect = self.over_limit(body, d.expect) if body is not None else d.expect
        return HttpCase(index, family, RAW, path=d.path, steps=tuple(steps), expect=frozenset(expect),
                        may_close=may_close,
                        shape=d.shape, stream=self.streams(d), choices=d.choices,
                        bound_s=bound_s if bound_s is not None else self.bound(d))

    def over_limit(self, body: bytes, expect: set[int]) -> set[int]:
        return {413} if len(body) > self.max_body else expect

    @staticmethod
    def streams(d: Draft) -> bool:
        return isinstance(d.obj, dict) and d.obj.get("stream") is True

    @staticmethod
    def bound(d: Draft) -> float:
        """A request that may generate up to the context length gets the long bound."""
        body = d.obj if isinstance(d.obj, dict) else {}
        budgets = [body.get(k) for k in ("max_tokens", "max_completion_tokens", "max_output_tokens") if k in body]
        small = any(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 64 for b in budgets)
        return ANSWER_BOUND_S if small or 200 not in d.expect else LONG_BOUND_S


def set_path(obj, path: str, value) -> None:
    """Set (or with ``DELETE`` remove) the dotted ``path`` in ``obj``, making what is missing
    (``prompt.0`` of a string prompt makes it a list; ``content.0`` a list of text parts)."""
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    for k, nxt in itertools.pairwise(keys):
        obj = _child(obj, k, isinstance(nxt, int))
    last = keys[-1]
    if value is DELETE:
        if isinstance(obj, dict):
            obj.pop(last, None)
        elif last < len(obj):
            del obj[last]
        return
    if isinstance(obj, list):
        obj.extend([None] * (last + 1 - len(obj)))
    obj[last] = value


def _child(obj, k, want_list: bool):
    if isinstance(obj, list):
        obj.extend([None] * (k + 1 - len(obj)))
    cur = obj[k] if isinstance(obj, list) else obj.get(k)
    if want_list and not isinstance(cur, list):
        cur = [{"type": "text", "text": cur}] if isinstance(cur, str) and k == "content" else \
            ([] if cur is None else [cur])
    elif not want_list and not isinstance(cur, dict):
        cur = {}
    obj[k] = cur
    return cur
