"""Running one HTTP request's generation, whatever shape its answer takes (OpenAI's, in
``specsplit.api.server``; llama-server's, in ``specsplit.api.llama_server``): admission (429,
503), the event stream with its release however the response ends, the first event awaited
before a stream's headers (so a refusal is a status), and the events of a whole answer with
the client's disconnect watched. A long prompt's prefill takes minutes on a CPU: a stream whose
first event has not come within ``KEEPALIVE_AFTER_S`` opens anyway and sends a keep-alive every
``KEEPALIVE_EVERY_S`` (an SSE comment, or the API's own ping event) until it comes, so that
proxies and clients that drop a silent connection (nginx after 60 s, Claude Code's byte
watchdog) keep waiting; a failure then comes in the stream, as a later one would. No torch.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specsplit.api.generation import Event, Failed, Generation, Job
from specsplit.api.protocol import ApiError
from specsplit.api.state import ApiState


def launch(state: ApiState, jobs: list[Job], stop_token_ids: list[int],
           unlisted: list[int] | None = None) -> tuple[Generation, Callable[[], None]]:
    """The jobs started on the pool, and the call that cancels what is left of them and frees
    their places (idempotent); a 429 beyond ``api_max_concurrent_requests``, a 503 without a
    live orchestrator, before anything starts."""
    if state.inflight + len(jobs) > state.settings.api_max_concurrent_requests:
        raise ApiError(429, f"more than {state.settings.api_max_concurrent_requests} requests in flight",
                       type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if not state.pool.live:
        raise ApiError(503, "no orchestrator answers", type="server_error", code="service_unavailable")
    gen = Generation(state.pool, state.tokenizer.decode, jobs, stop_token_ids, state.metrics, unlisted=unlisted)
    state.inflight += len(jobs)
    gen.start()
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            gen.cancel()
            state.inflight -= len(jobs)

    return gen, release


class EventStream(StreamingResponse):
    """An SSE response that releases its generation however it ends: a client gone before the
    first chunk never starts the body's generator, whose own ``finally`` would then never run."""

    def __init__(self, body, release) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


# characters JSON leaves raw that str.splitlines() ends a line at (httpx's iter_lines, many SSE
# readers): in an event's data they are written as JSON escapes, so an event stays one line
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj) -> bytes:
    """One server-sent event: ``data: <JSON>`` on one line whatever the text holds."""
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)
    return b"data: " + data.encode() + b"\n\n"


def event_bytes(ev: dict) -> bytes:
    """A typed event (the Responses and Messages APIs'): its ``event:`` line names its ``type``."""
    return b"event: " + ev["type"].encode() + b"\n" + sse(ev)


async def watch_disconnect(request: Request) -> None:
    """Returns when the client disconnects (after the body was read)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


KEEPALIVE_AFTER_S = 5.0  # a stream's headers wait this long for its first event, then go out anyway
KEEPALIVE_EVERY_S = 10.0  # ... and a keep-alive follows this often until the first event comes
COMMENT = b": keep-alive\n\n"  # an SSE comment: every SSE reader skips it


async def first_event(request: Request, gen: Generation, raise_failed: bool = True) -> Event | None:
    """Wait for the first event before the stream's headers, so a refusal (429, 503) is a status
    (``raise_failed``; else a failure is returned as the event it is)."""
    watcher = asyncio.ensure_future(watch_disconnect(request))
    nxt = asyncio.ensure_future(gen.next())
    try:
        done, _ = await asyncio.wait({watcher, nxt}, return_when=asyncio.FIRST_COMPLETED)
        if nxt not in done:
            raise ClientDisconnect()
        ev = nxt.result()
        if isinstance(ev, Failed) and raise_failed:
            raise ev.error
        return ev
    finally:
        watcher.cancel()
        nxt.cancel()


async def kept_alive(waiter: asyncio.Future, streamed: Callable[[Event | None], AsyncIterator[bytes]],
                     opening: Callable[[], list[bytes]], ping: bytes) -> AsyncIterator[bytes]:
    """A stream opened before its first event: ``opening()``, a ``ping`` every
    KEEPALIVE_EVERY_S while ``waiter`` (the first event) is out, then ``streamed(first)``."""
    try:
        for chunk in opening():
            yield chunk
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=KEEPALIVE_EVERY_S)
            if done:
                break
            yield ping
        try:
            first = waiter.result()
        except ClientDisconnect:
            return
        async for chunk in streamed(first):
            yield chunk
    finally:
        waiter.cancel()


async def each_event(gen: Generation, first: Event | None) -> AsyncIterator[Event]:
    """The generation's events from ``first`` on, the first failure the last of them."""
    ev = first
    while ev is not None:
        yield ev
        if isinstance(ev, Failed):
            return
        ev = await gen.next()


async def all_events(request: Request, gen: Generation) -> list[Event]:
    """Every event of the generation, in order: ClientDisconnect when the client goes first,
    the first choice's failure as its ApiError."""
    watcher = asyncio.ensure_future(watch_disconnect(request))
    out: list[Event] = []
    try:
        while True:
            nxt = asyncio.ensure_future(gen.next())
            finished, _ = await asyncio.wait({watcher, nxt}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in finished:
                nxt.cancel()
                raise ClientDisconnect()
            ev = nxt.result()
            if ev is None:
                return out
            if isinstance(ev, Failed):
                raise ev.error
            out.append(ev)
    finally:
        watcher.cancel()


async def answer(request: Request, gen: Generation, release: Callable[[], None], stream: bool,
                 streamed: Callable[[Event | None], AsyncIterator[bytes]], whole: Callable[[list[Event]], object],
                 opening: Callable[[], list[bytes]] = list, ping: bytes = COMMENT) -> Response:
    """The response to a launched generation: with ``stream``, the events ``streamed(first)``
    makes once the first has come (a refusal before it is a status; after KEEPALIVE_AFTER_S the
    stream opens with ``opening()`` and ``ping`` keeps it alive, ``kept_alive``); else
    ``whole(events)`` as JSON. The generation is released however the response ends."""
    if stream:
        waiter = asyncio.ensure_future(first_event(request, gen, raise_failed=False))
        try:
            done, _ = await asyncio.wait({waiter}, timeout=KEEPALIVE_AFTER_S)
            if not done:
                def release_all() -> None:
                    waiter.cancel()
                    release()
                return EventStream(kept_alive(waiter, streamed, opening, ping), release_all)
            first = waiter.result()
            if isinstance(first, Failed):
                raise first.error
        except BaseException:
            waiter.cancel()
            release()
            raise
        return EventStream(streamed(first), release)
    try:
        events = await all_events(request, gen)
    finally:
        release()
    return JSONResponse(whole(events))
