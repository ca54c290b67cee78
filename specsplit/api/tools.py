"""Tool calling on /v1/chat/completions, in the format Qwen2.5 and other Hermes-trained models use.

The model's chat template shows it the tools (their JSON schemas, as sent) and the history's
calls and results; the model writes a call as ``<tool_call>\n{"name": ..., "arguments": {...}}\n
</tool_call>``. The API parses those blocks out of each choice's text, as it streams, into
OpenAI's ``tool_calls``:

- ``tool_choice`` "auto" (the default with tools): the model decides, unconstrained (OpenAI
  warns the same of its models without strict mode: arguments may not fit the schema), so a
  block that is not a call (not JSON, no name) comes back as text. With a strict function the
  answer is held to a lazy grammar instead: free text that never spells the opening tag, each
  opening tag beginning a call held to the tools' schemas; a bare call object (below) counts
  only when its arguments fit. "none": the tools are not shown, so the answer is text.
  "required" or a named function: the assistant's turn begins with the call's opening
  (``<tool_call>\n{"name": "``, or ``<tool_call>\n{"name": "NAME", "arguments": ``), counted in
  the prompt's tokens, and the rest is held to the tools' schemas (``calls_grammar``: the
  target's constrained decoding).
- Small models do not always close the tags: a block still open when the answer ends is a call
  when its body is one (as vLLM's Hermes parser takes it), and an answer that is nothing but a
  call object naming one of the tools, bare or in a ```json fence, is that call (as llama.cpp's
  parser takes it). While an answer may still be one (it begins with "{" or the fence), its text
  is held back until the end.
- ``parallel_tool_calls: false``: the generation ends at the first call's closing tag.
- A served model whose chat template has no ``<tool_call>`` takes no tools: a 400.

Text and calls come out in the order written. The text is what the model wrote outside calls,
less the whitespace beside a call (the newlines around its tags); a choice with calls and no
other text has ``content`` null, as OpenAI's. Streamed and whole answers go through the same
parser, which gives the same result however the text is split (tests/test_api_tools.py feeds
every split). No torch, no sockets.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas import GrammarSpec
from schemas.messages import MAX_GRAMMAR_CHARS
from specsplit.api.protocol import ApiError, ChatCompletionRequest, NamedToolChoice, schema_error

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template shows tools and calls in the format this module parses."""
    return bool(template) and OPEN in template


# ---------------------------------------------------------------------------- the request
@dataclass(frozen=True)
class ToolPlan:
    """How one request's choices use tools: the tools shown, the turn's forced opening, whether
    one call ends the answer, and the grammar that holds the calls to the tools' schemas."""

    tools: list[dict]
    prefill: str = ""
    single: bool = False
    grammar: GrammarSpec | None = None  # "required", a named function, or "auto" with a strict one
    strict: bool = False  # "auto" with a strict function: a bare call object counts only when it fits

    def parser(self) -> CallParser:
        fits = ArgumentCheck(self.tools) if self.strict else None
        return CallParser(self.prefill, self.single, frozenset(t["function"]["name"] for t in self.tools), fits)


def plan(req: ChatCompletionRequest, special: frozenset[str] = frozenset()) -> ToolPlan | None:
    """None when the model is shown no tools (none sent, or ``tool_choice`` "none"). ``special``:
    the tokenizer's added tokens (a tag that is one is matched as that token by the grammar)."""
    if not req.tools or req.tool_choice == "none":
        return None
    shown = [t.model_dump(exclude_none=True) for t in req.tools]
    single = req.parallel_tool_calls is False
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.name
        prefill = f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": '
        return ToolPlan(shown, prefill, single, calls_grammar(req, special, name))
    if req.tool_choice == "required":
        return ToolPlan(shown, f'{OPEN}\n{{"name": "', single, calls_grammar(req, special))
    if any(t.function.strict for t in req.tools):  # "auto": free text, and calls held to the schemas
        return ToolPlan(shown, "", single, calls_grammar(req, special, lazy=True), strict=True)
    return ToolPlan(shown, "", single)


def calls_grammar(req: ChatCompletionRequest, special: frozenset[str], named: str | None = None,
                  lazy: bool = False) -> GrammarSpec:
    """A Lark grammar (llguidance's) of what follows the turn's forced opening. For a named
    function: its arguments (the function's JSON schema) and the closing tag. For "required": a
    call of one of the tools, its arguments fitting that tool's schema, then (with parallel
    calls) more calls. ``lazy`` ("auto" with a strict function, no opening): free text that never
    spells the opening tag, where each opening tag begins such a call (a lazy grammar: the text
    is unconstrained, the calls are). The model's end token follows. 400 naming ``tools`` when a
    schema cannot be enforced."""
    def tag(t: str) -> str:  # the tokenizer's own token where it has one, else the text
        return t if t in special else json.dumps(t)

    close = json.dumps("}\n") + " " + tag(CLOSE)
    rules, calls = [], []
    for i, t in enumerate(req.tools or ()):
        fn = t.function
        if named is not None and fn.name != named:
            continue
        schema = json.dumps(fn.parameters if fn.parameters is not None else {"type": "object"})
        error = schema_error(schema)
        if error:
            raise ApiError(400, f"the parameters of {fn.name!r} cannot be enforced: {error[:300]}", param="tools")
        rules.append(f"args{i}: %json {schema}")
        if named is None:  # after '{"name": "': the name, then its arguments
            calls.append(json.dumps(fn.name + '", "arguments": ') + f" args{i} {close}")
        else:  # after '"arguments": ': its arguments
            rules.insert(0, f"start: args{i} {close}")
    head, nl = json.dumps('\n{"name": "'), json.dumps("\n")
    many = "?" if req.parallel_tool_calls is False else "*"
    if lazy:
        # TEXT: any text but the opening tag's; where the tag is one token, the text ends at it,
        # else a lazy lexeme ends the text at the tag's first occurrence
        text = r"TEXT: /(.|\n)*/ & ~/(.|\n)*" + OPEN + r"(.|\n)*/"
        opened = [f"tagged: TEXT {OPEN} {head} call"] if OPEN in special else \
            [f"tagged: opened {head} call", f"opened[lazy]: /(.|\\n)*/ {json.dumps(OPEN)}"]
        rules[:0] = [f"start: tagged{many} TEXT", *opened, "call: " + " | ".join(calls), text]
    elif named is None:
        rules[:0] = [f"start: call more{many}", "call: " + " | ".join(calls), f"more: {nl} {tag(OPEN)} {head} call"]
    text = "\n".join(rules) + "\n"
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ApiError(400, f"the tools' schemas make a grammar over {MAX_GRAMMAR_CHARS} characters", param="tools")
    return GrammarSpec(kind="lark", text=text)


class ArgumentCheck:
    """Whether a call's arguments fit its tool's schema (llguidance over the JSON's bytes, so
    no model's tokenizer is needed): for calls no grammar held, under a strict function."""

    def __init__(self, shown: list[dict]) -> None:
        self._schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                         for t in shown}

    def __call__(self, call: ParsedCall) -> bool:
        from llguidance import LLMatcher

        schema = self._schemas.get(call.name)
        if schema is None:
            return False
        data = list(call.arguments.encode())
        m = LLMatcher(_byte_tokenizer(), LLMatcher.grammar_from_json_schema(json.dumps(schema)), log_level=0)
        return m.validate_tokens(data) == len(data) and m.consume_tokens(data) and m.is_accepting()


@functools.cache
def _byte_tokenizer():
    """An llguidance tokenizer whose tokens are the 256 bytes (and an end token)."""
    from llguidance import LLTokenizer, TokenizerWrapper

    class Bytes:
        eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
        tokens = [bytes([b]) for b in range(256)] + [b"\xff[end]"]

        def __call__(self, text: bytes | str) -> list[int]:
            return list(text.encode() if isinstance(text, str) else text)

    return LLTokenizer(TokenizerWrapper(Bytes()), slices=[])


def has_tool_turns(req: ChatCompletionRequest) -> bool:
    return any(m.role == "tool" or m.tool_calls for m in req.messages)


def turns(req: ChatCompletionRequest) -> list[dict]:
    """The conversation for the chat template (a developer turn is a system turn; a call's
    arguments as the JSON value they hold). A tool message must answer a call of the assistant
    message before it (after other tool messages only), as OpenAI requires: a 400 otherwise."""
    out: list[dict] = []
    answerable: set[str] = set()
    for i, m in enumerate(req.messages):
        turn: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.role == "tool":
            if m.tool_call_id not in answerable:
                raise ApiError(400, f"messages[{i}]: a tool message must answer a call of the assistant message "
                                    f"before it; no call there has the id {m.tool_call_id!r}", param="messages")
            turn["tool_call_id"] = m.tool_call_id
        elif m.tool_calls:
            turn["tool_calls"] = [_history_call(i, j, c) for j, c in enumerate(m.tool_calls)]
            answerable = {c.id for c in m.tool_calls}
        else:
            answerable = set()
        out.append(turn)
    return out


def _history_call(i: int, j: int, call) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                       param="messages") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


# ---------------------------------------------------------------------------- the answer
@dataclass(frozen=True)
class ParsedCall:
    """A call the model wrote: ``index`` among its choice's calls."""

    index: int
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self) -> dict:
        return {"index": self.index, **self.message()}


def _call_in(body: str, index: int) -> ParsedCall | None:
    """The call a block's body holds, or None when it holds none (then the block is text)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments")
    if isinstance(args, dict):
        return ParsedCall(index, obj["name"], json.dumps(args, ensure_ascii=False))
    if isinstance(args, str):
        return ParsedCall(index, obj["name"], args)
    return None


def _held(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that begins ``tag`` (it may be the tag's start)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


FENCE = "```json"


def _bare_call(text: str, names: frozenset[str]) -> ParsedCall | None:
    """The call a whole answer is, when it is nothing but a call object naming one of the tools,
    bare or in a ```json fence (as small models often answer), else None."""
    body = text.strip()
    if body.startswith("```"):
        first, _, rest = body.partition("\n")
        if first.strip().lower() != FENCE or not rest.rstrip().endswith("```"):
            return None
        body = rest.rstrip()[:-3]
    call = _call_in(body, 0)
    return call if call is not None and call.name in names else None


class CallParser:
    """One choice's text deltas in, (text, calls) out (see the module docstring). ``prefill`` is
    the turn's forced opening: parsed first, it shows no text. ``names``: the tools shown, which an
    answer that is nothing but a call object may name (held back while it may be one), and which
    counts only when ``fits`` (if given) says its arguments fit the tool's schema. ``ended``:
    with ``single``, the first call was made, and the generation should end."""

    def __init__(self, prefill: str = "", single: bool = False, names: frozenset[str] = frozenset(),
                 fits: Callable[[ParsedCall], bool] | None = None) -> None:
        self.single, self.names, self.fits = single, names, fits
        self.calls: list[ParsedCall] = []
        self.ended = False
        self._buf = ""  # text not settled yet: a block's body so far, or a tail that may begin one
        self._in_block = False
        self._ws = ""  # whitespace held: shown when text follows, dropped beside a call
        self._shown = False  # some text was shown
        self._start: str | None = "" if names and not prefill else None  # the answer while it may be a bare call
        if prefill:
            self._feed(prefill)

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        if self.ended:
            return "", []
        if self._start is None:
            return self._feed(delta)
        self._start += delta
        head = self._start.lstrip()[:len(FENCE)].lower()
        if head.startswith("{") or FENCE.startswith(head):
            return "", []  # may still be a bare call: known at the end
        held, self._start = self._start, None
        return self._feed(held)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The text still held, and the calls it makes: an unfinished block (a call when its body
        is one), an answer that is nothing but a call, a tail that began no tag, and (when no
        call was made) the whitespace at the end."""
        if self.ended:
            return "", []
        made = len(self.calls)
        text = ""
        if self._start is not None:
            held, self._start = self._start, None
            call = _bare_call(held, self.names)
            if call is not None and (self.fits is None or self.fits(call)):
                self.calls.append(call)
                self.ended = True
                return "", [call]
            text, _ = self._feed(held)
        rest = self._buf
        if self._in_block:
            call = _call_in(rest, len(self.calls))
            if call is not None:
                self._ws = ""
                self.calls.append(call)
                rest = ""
            else:
                rest = OPEN + rest
        self._buf, self._in_block = "", False
        text += self._text(rest)
        if not self.calls:
            text += self._ws
        self._ws, self.ended = "", True
        return text, self.calls[made:]

    def _feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self._buf += delta
        text: list[str] = []
        new: list[ParsedCall] = []
        while not self.ended:
            if self._in_block:
                j = self._buf.find(CLOSE)
                if j < 0:
                    break
                body, self._buf, self._in_block = self._buf[:j], self._buf[j + len(CLOSE):], False
                call = _call_in(body, len(self.calls))
                if call is None:
                    text.append(self._text(OPEN + body + CLOSE))
                    continue
                self._ws = ""
                self.calls.append(call)
                new.append(call)
                if self.single:
                    self.ended, self._buf = True, ""
            else:
                i = self._buf.find(OPEN)
                if i < 0:
                    cut = len(self._buf) - _held(self._buf, OPEN)
                    text.append(self._text(self._buf[:cut]))
                    self._buf = self._buf[cut:]
                    break
                text.append(self._text(self._buf[:i]))
                self._buf, self._in_block = self._buf[i + len(OPEN):], True
        return "".join(text), new

    def _text(self, text: str) -> str:
        if self.calls and not self._shown:
            text = text.lstrip()  # the answer's text starts after the calls' whitespace
        text = self._ws + text
        head = text.rstrip()
        self._ws = text[len(head):]
        self._shown = self._shown or bool(head)
        return head
