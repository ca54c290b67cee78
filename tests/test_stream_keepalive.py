"""A stream whose first event is slow (a long prompt's prefill: minutes on a CPU) opens anyway
and is kept alive until it comes (``specsplit.api.streaming.answer``), through a real Starlette
app and httpx, with the waits shortened: keep-alives before the events, the events whole after
them, a failure in the stream; a quick first event, or a quick refusal, as before."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from specsplit.api import streaming
from specsplit.api.generation import Delta, Done, Failed
from specsplit.api.protocol import ApiError


class SlowGeneration:
    """Its first event after ``delay`` s, then the rest at once."""

    def __init__(self, delay: float, events: list) -> None:
        self.delay, self.events, self.cancelled = delay, list(events), False

    async def next(self):
        if self.delay:
            await asyncio.sleep(self.delay)
            self.delay = 0
        return self.events.pop(0) if self.events else None

    def cancel(self) -> None:
        self.cancelled = True


def app_for(gen: SlowGeneration, opening=list, ping=streaming.COMMENT) -> Starlette:
    async def streamed(first):
        async for ev in streaming.each_event(gen, first):
            yield streaming.sse({"error": ev.error.message} if isinstance(ev, Failed) else {"text": ev.text})

    async def endpoint(request):
        return await streaming.answer(request, gen, gen.cancel, True, streamed, lambda events: {}, opening, ping)

    return Starlette(routes=[Route("/s", endpoint, methods=["POST"])])


def post(app) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/s", timeout=30)

    return asyncio.run(go())


@pytest.fixture
def quick_waits(monkeypatch):
    monkeypatch.setattr(streaming, "KEEPALIVE_AFTER_S", 0.1)
    monkeypatch.setattr(streaming, "KEEPALIVE_EVERY_S", 0.1)


EVENTS = [Delta(0, "he"), Done(0, "llo", "stop", 0, 3, 2, {})]


def test_a_slow_first_event_is_kept_alive_then_streamed(quick_waits):
    gen = SlowGeneration(0.65, EVENTS)
    resp = post(app_for(gen, opening=lambda: [b"event: start\n\n"], ping=b"event: ping\n\n"))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    chunks = resp.text.split("\n\n")
    assert chunks[0] == "event: start"
    pings = [c for c in chunks if c == "event: ping"]
    assert 3 <= len(pings) <= 7, resp.text  # one every 0.1 s of the 0.65 s wait
    assert chunks[1:1 + len(pings)] == pings  # all before the events
    assert [c for c in chunks if c.startswith("data:")] == ['data: {"text":"he"}', 'data: {"text":"llo"}']
    assert gen.cancelled  # released at the end


def test_a_failure_after_the_stream_opened_is_in_the_stream(quick_waits):
    gen = SlowGeneration(0.35, [Failed(0, ApiError(503, "no worker"))])
    resp = post(app_for(gen))
    assert resp.status_code == 200 and resp.text.startswith(": keep-alive\n\n")
    assert resp.text.rstrip().endswith('data: {"error":"no worker"}')


def test_a_quick_first_event_or_refusal_is_as_before(quick_waits):
    resp = post(app_for(SlowGeneration(0, EVENTS)))
    assert resp.status_code == 200 and not resp.text.startswith(":")
    assert resp.text.count("data:") == 2
    refused = SlowGeneration(0, [Failed(0, ApiError(429, "busy"))])
    with pytest.raises(ApiError) as err:  # (the server's handler makes it a 429: no handler here)
        post(app_for(refused))
    assert err.value.status == 429 and refused.cancelled
