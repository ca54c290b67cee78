"""Anthropic's Messages API over the fleet: ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens``, as the ``anthropic`` SDK's ``client.messages`` calls them (and the
agents and coding tools built on it, pointed at the server by ``ANTHROPIC_BASE_URL``), as
llama-server and vLLM serve them too. No torch.

A request becomes a chat completion request (``ChatCompletionRequest``) and runs as one, so its
answers, tools, JSON output, prefix-cache routing and checks are the chat endpoint's:
- ``system`` (a text or text blocks) is a system turn, and so is a system message after the
  first (Claude Code's mid-conversation system messages); a message's ``text`` blocks its text,
  an assistant's ``tool_use`` blocks its ``tool_calls``, a user's ``tool_result`` blocks tool
  turns (in their order); past ``thinking`` blocks are left out, as chat templates leave them.
- A last assistant message is a prefill: the assistant's turn begins with its text and the
  answer is the rest (``planning.chat_prompt``).
- ``tools`` (client tools: ``input_schema``, strict only with ``strict: true``, as Anthropic's),
  ``tool_choice`` (auto, any, tool, none; ``disable_parallel_tool_use``), ``stop_sequences``
  (``stop_reason`` "stop_sequence" names the one met), ``output_config.format`` (a JSON schema
  the answer is held to), ``max_tokens`` (past the context: up to the context, then
  "model_context_window_exceeded"), ``temperature`` (0-1), ``top_p``, ``top_k``,
  ``metadata.user_id``. ``cache_control`` marks are accepted: the target's prefix cache needs none,
  and the tokens it held are ``usage.cache_read_input_tokens`` (``input_tokens`` the rest).
- The answer is a message of ``text`` and ``tool_use`` blocks; a stream is Anthropic's events
  (``message_start``, ``ping``, ``content_block_*``, ``message_delta``, ``message_stop``; an
  ``error`` event for a failure after the first). The message and its events:
  ``specsplit.api.message_events``.
- Errors are Anthropic's body, ``{"type": "error", "error": {"type", "message"}}`` (``error_body``).

What agents send with every request is taken (Claude Code sends all of it): ``thinking``
(enabled, adaptive or disabled: the served models do not think, so an answer has no thinking
blocks, as an adaptive one may), ``output_config.effort``, ``context_management`` (no edit is
applied: the conversation is served whole, or refused as too long), ``diagnostics``, tools'
``defer_loading`` (the tool is shown like the others: there is no tool search here) and
``input_examples``, ``tool_reference`` blocks in a tool result (the tool is already shown).
A prompt that leaves no room is Anthropic's "prompt is too long: N tokens > M maximum", which
agents answer by compacting the conversation.

What the fleet cannot do is a 400 naming the parameter: server tools (web search, code
execution, bash...), images, documents and other non-text blocks, MCP servers, containers,
``speed: "fast"``, ``max_tokens: 0`` (cache pre-warming).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specsplit.api.generation import Done, Failed, Generation
from specsplit.api.message_events import MessageBuilder
from specsplit.api import planning
from specsplit.api.planning import chat_prompt, plan_jobs
from specsplit.api.plumbing import check_key, check_unicode, read_json, request_state
from specsplit.api.protocol import MAX_MESSAGES, MAX_STOP_STRINGS, MAX_TOOLS, ApiError, ChatCompletionRequest, parse
from specsplit.api.streaming import answer, each_event, event_bytes, launch

PREFIX = "/v1/messages"  # the routes whose errors are Anthropic's body (server.build_app)
# a chat request's parameters, by the Messages API's name for them (the chat request's 400s)
PARAM_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config",
               "user": "metadata", "parallel_tool_calls": "tool_choice"}
TEXT_NAMES = (("response_format.json_schema.", "output_config.format."), ("response_format", "output_config.format"),
              ("max_completion_tokens", "max_tokens"))
# Anthropic's error types by status (others: invalid_request_error below 500, api_error from it)
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
TEXT_BLOCK_FIELDS = frozenset({"type", "text", "cache_control", "citations"})


def anthropic_client(request: Request) -> bool:
    """Whether Anthropic's body answers the request: one of the Messages API's routes, or any
    route asked by Anthropic's clients (they send ``anthropic-version``)."""
    return request.url.path.startswith(PREFIX) or "anthropic-version" in request.headers


def model_info(name: str, created: int, limit: int) -> dict:
    """The served model as Anthropic's ``GET /v1/models`` lists it (``client.models``)."""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    return {"type": "model", "id": name, "display_name": name, "created_at": when, "lifecycle": "active",
            "max_input_tokens": limit or None, "max_tokens": limit or None}


def error_body(status: int, message: str) -> dict:
    """An error in Anthropic's body, typed by its status."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def api_error_body(exc: ApiError) -> dict:
    """An ``ApiError`` in Anthropic's body; its parameter named in the message (Anthropic's body
    has no ``param``)."""
    message = exc.message
    if exc.param and not message.startswith(exc.param):
        message = f"{exc.param}: {message}"
    return error_body(exc.status, message)


class MessagesRequest(BaseModel):
    """A body of ``POST /v1/messages`` (and of ``count_tokens``, which takes no ``max_tokens``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, max_length=256)
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=0)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    stream: bool = Field(default=False, strict=True)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = Field(default=None, max_length=64)
    user_profile_id: str | None = Field(default=None, max_length=256)
    workspace_id: str | None = Field(default=None, max_length=256)
    container: Any = None
    mcp_servers: list[Any] | None = None
    context_management: Any = None
    diagnostics: Any = None

    def checked(self) -> MessagesRequest:
        """A 400 naming what this server cannot honour."""
        if self.container is not None:
            raise _unsupported("container", "container is not supported by this server")
        if self.mcp_servers:
            raise _unsupported("mcp_servers", "MCP servers are not supported by this server")
        if self.speed == "fast":
            raise _unsupported("speed", 'speed "fast" is not supported: the fleet serves one speed, its fastest')
        _check_thinking(self.thinking)
        unknown = set(self.output_config or ()) - {"format", "effort"}
        if unknown:
            raise ApiError(400, f"unknown field {min(unknown)!r}", param="output_config")
        effort = (self.output_config or {}).get("effort")
        if effort is not None and not (isinstance(effort, str) and 0 < len(effort) <= 32):
            raise ApiError(400, "output_config.effort: a level (low, medium, high, max)", param="output_config.effort")
        edits = self.context_management
        if edits is not None and not (isinstance(edits, dict) and isinstance(edits.get("edits", []), list)):
            raise ApiError(400, "context_management: {edits: [...]}", param="context_management")
        if not isinstance((self.metadata or {}).get("user_id", ""), (str, type(None))) or set(self.metadata or ()) - {
                "user_id"}:
            raise ApiError(400, "metadata: only user_id, a text", param="metadata")
        return self


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_parameter")


def _check_thinking(thinking: dict[str, Any] | None) -> None:
    """``thinking`` as Anthropic takes it (a bare ``budget_tokens`` too, as some clients send):
    enabled, adaptive or disabled, a budget of tokens at least 0. The served models do not think:
    whichever it is, the answer has no thinking blocks."""
    if thinking is None:
        return
    kind = thinking.get("type", "enabled" if "budget_tokens" in thinking else None)
    budget = thinking.get("budget_tokens", 0)
    if kind not in ("enabled", "adaptive", "disabled") or set(thinking) - {"type", "budget_tokens", "display"} \
            or type(budget) is not int or budget < 0 or not isinstance(thinking.get("display", ""), str):
        raise ApiError(400, "thinking: {type: enabled|adaptive|disabled, budget_tokens}", param="thinking")


# ---------------------------------------------------------------------------- the request as a chat's
def _text_of(block: Any, where: str) -> str:
    """A text block's text; a 400 naming what else it is."""
    if not isinstance(block, dict):
        raise ApiError(400, f"{where}: a content block is an object", param="messages")
    kind = block.get("type")
    if kind == "text" and isinstance(block.get("text"), str) and set(block) <= TEXT_BLOCK_FIELDS:
        return block["text"]
    if kind in ("image", "document", "search_result", "container_upload"):
        raise _unsupported("messages", f"{where}: {kind} blocks are not supported: the served model reads text only")
    raise ApiError(400, f"{where}: a block of type {str(kind)[:40]!r} is not one this server takes here",
                   param="messages")


def _texts(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_of(b, f"{where}[{j}]") for j, b in enumerate(content))
    raise ApiError(400, f"{where}: content is a text or a list of blocks", param="messages")


def _user_turns(content: Any, where: str) -> list[dict]:
    """A user message as chat turns: its text, and a tool turn per ``tool_result`` (in order)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: content is a text or a list of blocks", param="messages")
    out: list[dict] = []
    for j, block in enumerate(content):
        here = f"{where}[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"] \
                    or set(block) - {"type", "tool_use_id", "content", "is_error", "cache_control"}:
                raise ApiError(400, f"{here}: tool_result is its tool_use_id, content and is_error", param="messages")
            result = block.get("content", "")
            if isinstance(result, list):  # a tool search's tool_reference: the tool is shown already
                result = [b for b in result if not (isinstance(b, dict) and b.get("type") == "tool_reference")]
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _texts(result, f"{here}.content")})
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += _text_of(block, here)
        else:
            out.append({"role": "user", "content": _text_of(block, here)})
    return out


def _assistant_turn(content: Any, where: str) -> dict:
    """An assistant message as a chat turn: its text, its ``tool_use`` blocks as calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: content is a text or a list of blocks", param="messages")
    text, calls = "", []
    for j, block in enumerate(content):
        here = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("thinking", "redacted_thinking"):
            continue  # past thinking: chat templates leave it out (the served models make none)
        if kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise ApiError(400, f"{here}: tool_use needs an id, a name and an input object", param="messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"],
                                                                                      ensure_ascii=False)}})
        else:
            text += _text_of(block, here)
    turn: dict = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def conversation(req: MessagesRequest) -> tuple[list[dict], str]:
    """The request's chat turns (its system first), and the prefill: a last assistant message's
    text, which the answer continues."""
    turns: list[dict] = []
    if req.system:
        turns.append({"role": "system", "content": _texts(req.system, "system")})
    for i, message in enumerate(req.messages):
        where, role = f"messages[{i}]", message.get("role")
        if set(message) - {"role", "content"} or "content" not in message:
            raise ApiError(400, f"{where}: a message is its role and content", param="messages")
        if role == "user":
            turns += _user_turns(message["content"], f"{where}.content")
        elif role == "assistant":
            turns.append(_assistant_turn(message["content"], f"{where}.content"))
        elif role == "system" and i:  # a system turn mid-conversation (Claude Code sends them)
            turns.append({"role": "system", "content": _texts(message["content"], f"{where}.content")})
        else:
            raise ApiError(400, f"{where}.role: user or assistant, or system after the first message (the "
                                "opening system prompt is a parameter of its own)", param="messages")
    prefill = ""
    if turns and turns[-1]["role"] == "assistant":
        last = turns.pop()
        if last.get("tool_calls"):
            raise ApiError(400, "the last message is the assistant's calls: send their tool_result blocks",
                           param="messages")
        prefill = last["content"] or ""
    return turns, prefill


def _tool(tool: dict[str, Any], i: int) -> dict:
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise _unsupported("tools", f"tools[{i}]: {str(kind)[:40]!r} tools are not supported by this server "
                                    "(client tools with an input_schema only)")
    if tool.get("allowed_callers") not in (None, ["direct"]):
        raise _unsupported("tools", f"tools[{i}].allowed_callers is not supported by this server (direct calls only)")
    if not isinstance(tool.get("defer_loading", False), bool) or not isinstance(tool.get("input_examples", []), list):
        raise ApiError(400, f"tools[{i}]: defer_loading is a boolean, input_examples a list", param="tools")
    unknown = set(tool) - {"type", "name", "description", "input_schema", "strict", "cache_control",
                           "eager_input_streaming", "defer_loading", "input_examples", "allowed_callers"}
    if unknown:
        raise ApiError(400, f"tools[{i}]: unknown field {min(unknown)!r}", param="tools")
    if not isinstance(tool.get("input_schema"), dict):
        raise ApiError(400, f"tools[{i}]: input_schema (a JSON schema object) is required", param="tools")
    function = {"name": tool.get("name"), "description": tool.get("description"), "parameters": tool["input_schema"],
                "strict": True if tool.get("strict") is True else None}  # (as the chat endpoint shows a tool)
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """The chat request's ``tool_choice`` and ``parallel_tool_calls``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    single = choice.get("disable_parallel_tool_use")
    if set(choice) - {"type", "name", "disable_parallel_tool_use"} or single not in (None, True, False) \
            or not isinstance(kind, str) or (kind == "tool") != ("name" in choice):
        raise ApiError(400, "tool_choice: {type: auto|any|none} or {type: tool, name}, with "
                            "disable_parallel_tool_use", param="tool_choice")
    chosen = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        chosen = {"type": "function", "function": {"name": choice["name"]}}
    if chosen is None:
        raise ApiError(400, f"tool_choice: unknown type {str(kind)[:40]!r}", param="tool_choice")
    return chosen, None if single is None else not single


def _response_format(config: dict[str, Any] | None) -> dict | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict) \
            or set(fmt) != {"type", "schema"}:
        raise ApiError(400, "output_config.format: {type: json_schema, schema}", param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def chat_request(req: MessagesRequest, need_budget: bool = True) -> tuple[ChatCompletionRequest, str]:
    """The chat request the message runs as, and its prefill."""
    if need_budget and req.max_tokens is None:
        raise ApiError(400, "max_tokens: Field required", param="max_tokens")
    if need_budget and req.max_tokens == 0:
        raise _unsupported("max_tokens", "max_tokens must be at least 1 here (0, pre-warming the cache, is not "
                                         "served)")
    turns, prefill = conversation(req)
    if not turns:
        raise ApiError(400, "messages: the conversation has no message before the prefill", param="messages")
    fmt = _response_format(req.output_config)
    if prefill and fmt is not None:
        raise ApiError(400, "an assistant prefill and output_config.format do not go together: the format holds "
                            "the whole answer", param="output_config.format")
    choice, parallel = _tool_choice(req.tool_choice)
    body = {"model": req.model, "messages": turns, "max_completion_tokens": req.max_tokens or None,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k or None,
            "stop": req.stop_sequences or None,
            "tools": [_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
            "tool_choice": choice, "parallel_tool_calls": parallel, "response_format": fmt,
            "user": (req.metadata or {}).get("user_id")}
    chat = planning.as_chat(body, PARAM_NAMES, TEXT_NAMES)
    return chat, prefill


def renamed(exc: ApiError) -> ApiError:
    """A chat request's 400 with the Messages API's name of its parameter."""
    return planning.renamed(exc, PARAM_NAMES, TEXT_NAMES)


def parse_request(body: Any) -> MessagesRequest:
    """A validated request, or a 400 naming the first offending parameter."""
    if isinstance(body, dict):
        check_unicode(body)
    return parse(MessagesRequest, body).checked()  # type: ignore[arg-type]


def _prompt(state, req: MessagesRequest, need_budget: bool):
    state.check_model(req.model)
    tok = state.require_ready()
    chat, prefill = chat_request(req, need_budget)
    try:
        ids, tool_plan = chat_prompt(tok, chat, prefill)
    except ApiError as exc:
        raise renamed(exc) from None
    return tok, chat, ids, tool_plan


# ---------------------------------------------------------------------------- endpoints
async def create(request: Request) -> Response:
    """``POST /v1/messages``."""
    state = request_state(request)
    check_key(request, state)
    req = parse_request(await read_json(request, state))
    tok, chat, ids, tool_plan = _prompt(state, req, True)
    # agents send budgets past the context (32K, 64K): the answer may run until the context is
    # full, then ends with stop_reason model_context_window_exceeded (as Anthropic's own API can)
    limit = state.max_model_len()
    room = limit - len(ids)
    if limit and room < 1:  # Anthropic's words, which agents answer by compacting the conversation
        raise ApiError(400, f"prompt is too long: {len(ids)} tokens > {limit - 1} maximum")
    cut = 1 <= room < chat.budget
    if cut:
        chat = chat.model_copy(update={"max_completion_tokens": room})
    try:
        jobs = plan_jobs(chat, [ids], state, None, "max_tokens", tool_plan)
    except ApiError as exc:
        raise renamed(exc) from None
    builder = MessageBuilder(state.model_name, len(ids), window=cut)
    gen, release = launch(state, jobs, sorted(tok.stop_token_ids), unlisted=tok.stop_token_ids)

    def whole(events) -> dict:
        for ev in events:
            builder.feed(ev)
        return builder.message()

    return await answer(request, gen, release, req.stream, lambda first: streamed(gen, first, builder, release),
                        whole, opening=lambda: [event_bytes(ev) for ev in builder.start()],
                        ping=event_bytes({"type": "ping"}))


async def streamed(gen: Generation, first, builder: MessageBuilder, release):
    """Anthropic's events; leaving early (the client went away) cancels the session."""
    try:
        for ev in builder.start():
            yield event_bytes(ev)
        async for got in each_event(gen, first):
            if isinstance(got, Failed):
                yield event_bytes(api_error_body(got.error))
                return
            for ev in builder.feed(got):
                yield event_bytes(ev)
            if isinstance(got, Done):
                return
    finally:
        release()


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, as a message would count them
    (its tools shown, a forced call's opening, the prefill)."""
    state = request_state(request)
    check_key(request, state)
    req = parse_request(await read_json(request, state))
    _, _, ids, _ = _prompt(state, req, False)
    return JSONResponse({"input_tokens": len(ids)})
