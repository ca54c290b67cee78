"""OpenAI's Responses API over the fleet: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, ``POST
/v1/responses/{id}/cancel``, as the OpenAI SDK's
``client.responses`` calls them (and the agents and coding tools built on it). No torch.

A request becomes a chat completion request (``ChatCompletionRequest``) and runs as one:
- ``input`` (a text, or items: messages with text parts, ``function_call`` and
  ``function_call_output``) after the stored conversation of ``previous_response_id``, with
  ``instructions`` first as a system turn (not carried over to the next response, as OpenAI's);
- function ``tools`` (strict unless ``strict: false``, as OpenAI's), and ``namespace`` tools'
  functions (shown to the model as ``<namespace>__<name>``; its calls come back as OpenAI's, a
  ``function_call`` with its ``namespace``), ``tool_choice``,
  ``parallel_tool_calls``; ``text.format`` (``json_schema``, ``json_object``) as
  ``response_format``; ``max_output_tokens``; ``include: ["message.output_text.logprobs"]``
  with ``top_logprobs``; and the chat endpoint's sampling extensions (``top_k``, ``min_p``,
  ``seed``, ``stop``, the penalties).
- The output is a ``message`` item with its ``output_text``, and a ``function_call`` item per
  call the model made; ``status`` is ``incomplete`` (``max_output_tokens``) when the budget ended
  it. A stream is the Responses API's typed events (``response.created`` ...
  ``response.completed``, ``response.incomplete`` or ``response.failed``), numbered.
- ``store`` (true by default) keeps the answer in this process's ``ResponseStore``
  (``specsplit.api.stored``; ``SPECSPLIT_API_STORED_RESPONSES``). The answer's object and events:
  ``specsplit.api.response_events``.

- ``background: true`` runs it on in the API process (``specsplit.api.background``): polled
  with ``GET``, its events streamed again (``?stream=true&starting_after=N``), cancelled with
  ``POST /v1/responses/{id}/cancel``.

What the fleet cannot do is a 400 naming the parameter: built-in tools (web search, files,
computers, MCP), images and files in the input, ``conversation``, ``prompt`` templates,
``truncation: "auto"``, ``reasoning.effort`` (the served models do not reason).
Reasoning items in the input are left out, as chat templates leave out past reasoning.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specsplit.api.generation import Done, Failed, Generation
from specsplit.api import planning
from specsplit.api.planning import chat_prompt, plan_jobs
from specsplit.api.plumbing import check_key, check_unicode, read_json, request_state
from specsplit.api.protocol import (
    MAX_MESSAGES, MAX_TOOLS, MAX_TOP_LOGPROBS, SEED_RANGE, ApiError, ChatCompletionRequest, parse,
)
from specsplit.api.response_events import LOGPROBS_INCLUDE, Builder, event_bytes, qualified
from specsplit.api.state import ApiState
from specsplit.api.streaming import EventStream, answer, each_event, launch

# what ``include`` may name: the logprobs are honoured; the others name outputs of built-in tools
# (refused) or of reasoning (none here), so there is never anything of theirs to include
INCLUDABLE = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content", "file_search_call.results",
                        "web_search_call.results", "web_search_call.action.sources", "code_interpreter_call.outputs",
                        "computer_call_output.output.image_url", "message.input_image.image_url"})
# a chat request's parameters, by the Responses API's name for them (the chat request's 400s)
PARAM_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
               "response_format": "text", "logprobs": "include"}
TEXT_NAMES = (("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
              ("max_completion_tokens", "max_output_tokens"))
MAX_METADATA = 16  # OpenAI's: key-value pairs
MAX_ID = 256


class ResponsesRequest(BaseModel):
    """A body of ``POST /v1/responses``: OpenAI's fields, a few of vLLM's sampling extensions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]] | None = Field(default=None, max_length=MAX_MESSAGES)
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID)
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = Field(default=None, max_length=len(INCLUDABLE))
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = Field(default=False, strict=True)
    stream_options: dict[str, Any] | None = None
    store: bool = Field(default=True, strict=True)
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA)
    # Codex CLI's own bookkeeping (window, turn ids), sent with every request: taken, not used
    client_metadata: dict[str, Any] | None = Field(default=None, max_length=64)
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    conversation: Any = None
    prompt: Any = None
    # vLLM's sampling extensions, as the chat endpoint takes them
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    def checked(self) -> ResponsesRequest:
        """A 400 naming what this server cannot honour."""
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise ApiError(400, f"{name} is not supported by this server", param=name,
                               code="unsupported_parameter")
        if self.background and not self.store:
            raise ApiError(400, "background responses must be stored: store: true", param="background")
        if self.truncation == "auto":
            raise ApiError(400, 'truncation "auto" is not supported: a conversation over the context is a 400',
                           param="truncation", code="unsupported_parameter")
        if (self.reasoning or {}).get("effort") not in (None, "none"):
            raise ApiError(400, "reasoning.effort is not supported with this model: it does not reason",
                           param="reasoning.effort", code="unsupported_parameter")
        if self.max_tool_calls is not None:
            raise ApiError(400, "max_tool_calls is not supported by this server", param="max_tool_calls",
                           code="unsupported_parameter")
        for name in self.include or ():
            if name not in INCLUDABLE:
                raise ApiError(400, f"include: {name[:80]!r} is not one of {sorted(INCLUDABLE)}", param="include")
        if self.input is None and self.previous_response_id is None:
            raise ApiError(400, "input is required", param="input")
        return self


# ---------------------------------------------------------------------------- the request as a chat's
def _part_text(part: Any, where: str) -> str:
    """The text of a content part (``input_text``, ``output_text``, ``refusal``); a 400 for others."""
    if not isinstance(part, dict):
        raise ApiError(400, f"{where}: a content part is an object", param="input")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    if kind in ("input_image", "input_file", "input_audio"):
        raise ApiError(400, f"{where}: {kind} is not supported: the served model reads text only", param="input",
                       code="unsupported_parameter")
    raise ApiError(400, f"{where}: a content part of type {str(kind)[:40]!r} with its text is expected", param="input")


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_part_text(p, f"{where}[{j}]") for j, p in enumerate(value))
    raise ApiError(400, f"{where}: content is a text or a list of parts", param="input")


def input_messages(value: str | list[dict[str, Any]] | None) -> list[dict]:
    """``input`` as chat turns: messages, calls (an assistant turn's ``tool_calls``, the calls in a
    row one turn) and their outputs (tool turns)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}: role must be user, assistant, system or developer", param="input")
            out.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name = item.get("name")
            if item.get("namespace") is not None:  # a namespace's function (the name the model called)
                if not isinstance(item["namespace"], str) or not isinstance(name, str):
                    raise ApiError(400, f"{where}: namespace and name are texts", param="input")
                name = qualified(item["namespace"], name)
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": name, "arguments": item.get("arguments")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*(last.get("tool_calls") or []), call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _content(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # past reasoning: chat templates leave it out (the served models make none)
        else:
            raise ApiError(400, f"{where}: items of type {str(kind)[:40]!r} are not supported by this server "
                                "(messages, function_call, function_call_output)", param="input",
                           code="unsupported_parameter")
    return out


ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_items(value: str | list[dict[str, Any]] | None) -> list[dict]:
    """A request's input as ``input_items`` lists it: items with ids and status, a message's text
    as its parts (``input_text``, or an assistant's ``output_text``)."""
    if value is None:
        return []
    out = []
    for item in [{"role": "user", "content": value}] if isinstance(value, str) else value:
        kind = item.get("type", "message")
        item = {"type": kind, **item, "id": item.get("id") or f"{ITEM_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}"}
        if kind == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("status", "completed")
        out.append(item)
    return out


def _tool(tool: dict[str, Any], where: str) -> dict:
    if tool.get("type") != "function":
        raise ApiError(400, f"{where}: {str(tool.get('type'))[:40]!r} tools are not supported by this server "
                            "(function tools, and namespaces of them, only)", param="tools",
                       code="unsupported_parameter")
    function = {**{k: v for k, v in tool.items() if k != "type"}, "strict": tool.get("strict") is not False}
    return {"type": "function", "function": function}


NAMESPACE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _tools(tools: list[dict[str, Any]]) -> list[dict]:
    """The request's tools as the chat request's functions: a ``namespace`` tool's functions
    each under its qualified name, the namespace's description before the function's own."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "namespace":
            out.append(_tool(tool, f"tools[{i}]"))
            continue
        where = f"tools[{i}]"
        unknown = set(tool) - {"type", "name", "description", "tools"}
        if unknown:
            raise ApiError(400, f"{where}: unknown field {min(unknown)!r}", param="tools")
        name, about, inner = tool.get("name"), tool.get("description", ""), tool.get("tools")
        if not isinstance(name, str) or not NAMESPACE.fullmatch(name) or not isinstance(about, str) \
                or not isinstance(inner, list) or not inner:
            raise ApiError(400, f"{where}: a namespace is its name (letters, digits, _ and -, up to 64), "
                                "description and a list of tools", param="tools")
        for j, fn in enumerate(inner):
            chat = _tool(fn if isinstance(fn, dict) else {}, f"{where}.tools[{j}]")["function"]
            if not isinstance(chat.get("name"), str):
                raise ApiError(400, f"{where}.tools[{j}]: a function needs its name", param="tools")
            chat["name"] = qualified(name, chat["name"])
            chat["description"] = "\n\n".join(d for d in (about.strip(), chat.get("description") or "") if d) or None
            out.append({"type": "function", "function": chat})
    return out


def _tool_choice(choice: str | dict[str, Any] | None):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ApiError(400, "tool_choice: none, auto, required or {type: function, name} (function tools only)",
                   param="tool_choice", code="unsupported_parameter")


def _response_format(text: dict[str, Any] | None) -> dict | None:
    if not text:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise ApiError(400, f"text: unknown field {min(unknown)!r}", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise ApiError(400, "text.verbosity is not supported with this model (only medium)", param="text.verbosity",
                       code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "text.format: type text, json_object or json_schema", param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def chat_request(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request the response runs as, and its conversation without the instructions
    (what a later response continues)."""
    turns = [*history, *input_messages(req.input)]
    if not turns:
        raise ApiError(400, "input: the conversation has no message", param="input")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    logprobs = LOGPROBS_INCLUDE in (req.include or ())
    body = {"model": req.model, "messages": system + turns, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "tools": _tools(req.tools) if req.tools else None,
            "tool_choice": _tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req.text), "user": req.user,
            "prompt_cache_key": req.prompt_cache_key, "logprobs": True if logprobs else None,
            "top_logprobs": req.top_logprobs if logprobs else None, "top_k": req.top_k, "min_p": req.min_p,
            "seed": req.seed, "stop": req.stop, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "repetition_penalty": req.repetition_penalty}
    chat = planning.as_chat(body, PARAM_NAMES, TEXT_NAMES)
    return chat, turns


def renamed(exc: ApiError) -> ApiError:
    """A chat request's 400 with the Responses API's name of its parameter."""
    return planning.renamed(exc, PARAM_NAMES, TEXT_NAMES)


# ---------------------------------------------------------------------------- endpoints
async def create(request: Request) -> Response:
    """``POST /v1/responses``."""
    state = request_state(request)
    check_key(request, state)
    req = parse_request(await read_json(request, state))
    state.check_model(req.model)
    tok = state.require_ready()
    history: list[dict] = []
    if req.previous_response_id is not None:
        running = state.background.get(req.previous_response_id)
        if running is not None and not running.done:
            raise ApiError(400, f"the previous response {req.previous_response_id!r} is still in progress",
                           param="previous_response_id")
        found = state.responses.get(req.previous_response_id)
        if found is None:
            raise ApiError(400, f"previous response with id {req.previous_response_id!r} not found",
                           param="previous_response_id", code="previous_response_not_found")
        history = list(found.messages)
    chat, turns = chat_request(req, history)
    try:
        ids, tool_plan = chat_prompt(tok, chat)
        jobs = plan_jobs(chat, [ids], state, None, "max_output_tokens", tool_plan)
    except ApiError as exc:
        raise renamed(exc) from None
    builder = Builder(req, state.model_name, tok.token_piece)
    gen, release = launch(state, jobs, sorted(tok.stop_token_ids), unlisted=tok.stop_token_ids)

    def keep() -> None:
        if req.store and builder.status in ("completed", "incomplete") or req.background:
            state.responses.put(builder.id, builder.response(), [*turns, builder.assistant_turn()],
                                listed_items(req.input))

    if req.background:  # it goes on whatever the client does; the store lists its input meanwhile
        state.responses.put(builder.id, builder.response(), turns, listed_items(req.input))
        run = state.background.start(builder, gen, release, keep)
        if req.stream:
            return EventStream(followed(run, -1), lambda: None)
        return JSONResponse(builder.response())

    def whole(events) -> dict:
        for ev in events:
            builder.feed(ev)
        keep()
        return builder.response()

    return await answer(request, gen, release, req.stream, lambda first: streamed(gen, first, builder, release, keep),
                        whole)


async def streamed(gen: Generation, first, builder: Builder, release, keep):
    """The Responses API's events; leaving early (the client went away) cancels the session."""
    try:
        for ev in builder.start():
            yield event_bytes(ev)
        async for got in each_event(gen, first):
            if isinstance(got, Failed):
                for ev in builder.fail(got.error):
                    yield event_bytes(ev)
                return
            for ev in builder.feed(got):
                yield event_bytes(ev)
            if isinstance(got, Done):
                keep()
    finally:
        release()


def parse_request(body: Any) -> ResponsesRequest:
    """A validated request, or a 400 naming the first offending parameter (the chat endpoint's
    rules: ``protocol.parse``)."""
    if isinstance(body, dict):
        check_unicode(body)  # (a response echoes its request's texts: instructions, user, metadata)
    return parse(ResponsesRequest, body).checked()  # type: ignore[arg-type]


async def followed(run, after: int):
    """A background response's events after ``after``, then as they come; the client leaving
    leaves the response running."""
    async for ev in run.follow(after):
        yield event_bytes(ev)


def _stored(request: Request, state: ApiState):
    rid = request.path_params["response_id"]
    found = state.responses.get(rid)
    if found is None:
        raise ApiError(404, f"response with id {rid[:MAX_ID]!r} not found", code="not_found")
    return rid, found


async def retrieve(request: Request) -> Response:
    """``GET /v1/responses/{id}``: a stored response, as it was answered; a background one as it
    stands (``?stream=true``: its events again, after ``starting_after``, then as they come)."""
    state = request_state(request)
    check_key(request, state)
    rid = request.path_params["response_id"]
    run = state.background.get(rid)
    q = request.query_params
    if q.get("stream", "false") not in ("true", "false"):
        raise ApiError(400, "stream must be true or false", param="stream")
    if q.get("stream") == "true":
        if run is None:
            _stored(request, state)  # (a 404 for an unknown id)
            raise ApiError(400, "only a background response's events can be streamed again", param="stream")
        after = q.get("starting_after", "-1")
        if not after.lstrip("-").isdigit() or len(after) > 12:
            raise ApiError(400, "starting_after must be an event's sequence_number", param="starting_after")
        return EventStream(followed(run, int(after)), lambda: None)
    if run is not None:
        return JSONResponse(run.builder.response())
    _, found = _stored(request, state)
    return JSONResponse(found.response)


async def cancel(request: Request) -> Response:
    """``POST /v1/responses/{id}/cancel``: a background response stopped where it is (``cancelled``;
    a finished one as it ended)."""
    state = request_state(request)
    check_key(request, state)
    rid = request.path_params["response_id"]
    run = await state.background.cancel(rid)
    if run is None:
        _stored(request, state)  # (a 404 for an unknown id)
        raise ApiError(400, "only background responses can be cancelled", param="response_id")
    return JSONResponse(run.builder.response())


MAX_LIST = 100  # OpenAI's limit on one page of input items


async def input_items(request: Request) -> Response:
    """``GET /v1/responses/{id}/input_items`` (``order`` desc by default, ``limit`` 1-100 (20),
    ``after`` an item id): the stored response's own input items, in OpenAI's list shape."""
    state = request_state(request)
    check_key(request, state)
    _, found = _stored(request, state)
    q = request.query_params
    order, after = q.get("order", "desc"), q.get("after")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be asc or desc", param="order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST:
        raise ApiError(400, f"limit must be an integer from 1 to {MAX_LIST}", param="limit")
    items = list(found.items) if order == "asc" else list(reversed(found.items))
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise ApiError(400, f"after: no input item {after[:MAX_ID]!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


async def delete(request: Request) -> Response:
    """``DELETE /v1/responses/{id}``."""
    state = request_state(request)
    check_key(request, state)
    rid = request.path_params["response_id"]
    if await state.background.forget(rid) is None:  # a background response: cancelled first
        _stored(request, state)
    state.responses.delete(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})
