"""What every endpoint does with a request before its own work: the app's state, the API key,
the body read as JSON within its limits, a prompt's text as ids. No torch."""

from __future__ import annotations

import asyncio
import hmac
import json

from starlette.requests import Request

from specsplit.api.protocol import ApiError
from specsplit.api.state import ApiState


def request_state(request: Request) -> ApiState:
    return request.app.state.api


async def read_json(request: Request, state: ApiState):
    """The body as JSON: 413 past the size limit (by Content-Length before reading, or while
    reading a chunked body), 408 past the body timeout, 400 when it is not JSON."""
    limit = state.settings.api_max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(state.settings.api_body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"request body not received within {state.settings.api_body_timeout_s:.0f}s",
                       code="request_timeout") from None
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ApiError(400, f"the request body is not valid JSON: {why}", code="invalid_json") from None


def encode_text(tok, text: str, special: bool = True) -> list[int]:
    """A prompt string's ids (``special``: with the tokenizer's special tokens added around it);
    400 for text that is not valid Unicode (a lone surrogate escaped in JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the prompt is not valid Unicode (a lone surrogate)", param="prompt") from None
    return tok.encode(text) if special else tok.encode_text(text)


def check_unicode(body: dict) -> None:
    """A 400 naming the field when a string anywhere in the body (a key too) is not valid
    Unicode (a lone surrogate escaped in JSON): no tokenizer takes one, and no answer that
    echoes it could be written as UTF-8."""
    for name, value in body.items():
        todo = [name, value]
        while todo:
            v = todo.pop()
            if isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    field = name if isinstance(name, str) and name.isprintable() and name.isascii() else None
                    raise ApiError(400, f"{field or 'a field'}: a text that is not valid Unicode (a lone "
                                        "surrogate)", param=field) from None
            elif isinstance(v, dict):
                todo += [*v.keys(), *v.values()]
            elif isinstance(v, list):
                todo += v


def check_key(request: Request, state: ApiState) -> None:
    """The request's API key: ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key:
    KEY`` (Anthropic's, and llama-server's other way); a 401 without a served one."""
    if not state.keys:
        return
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    sent = [bearer.strip()] if scheme.lower() == "bearer" else []
    sent += [request.headers["x-api-key"].strip()] if "x-api-key" in request.headers else []
    if not any(hmac.compare_digest(key.encode(), k.encode()) for key in sent for k in state.keys):
        raise ApiError(401, "missing or invalid API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                       type="authentication_error", code="invalid_api_key")
