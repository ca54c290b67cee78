"""HTTP fuzzer, part 4: send one case and judge what came back.

``run_raw`` writes a case's steps to a fresh socket (asyncio streams) while a reader parses the
answer with h11; ``run_httpx`` sends it with httpx (a fresh connection each: no pooled connection
the server may close under us). Either gives an ``Outcome``: a status, headers and body, or the
server's close, or our own hang-up, or nothing within the case's bound.

``judge`` is the oracle: an answered case has a status in ``DOCUMENTED`` and in the case's own
``expect``; an error is OpenAI's body (``{"error": {"message", "type", "param", "code"}}``, JSON),
or Anthropic's under ``/v1/messages`` (``{"type": "error", "error": {"type", "message"}}``); a
200 to a well-formed request has the answer's shape (choices, or an event stream ending in
``[DONE]``; a response or a message, or their typed events to the last); a connection closed
unanswered only where the case may be; nothing past its bound.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import h11
import httpx

from specsplit.api.messages import PREFIX as MESSAGES_PREFIX
from specsplit.fuzz.http_cases import DOCUMENTED, STREAM_CUT, HttpCase

MAX_KEPT_BODY = 1 << 20  # bytes of an answer kept for judging


@dataclass
class Outcome:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    complete: bool = False  # the whole answer arrived
    closed: bool = False  # the server closed (or reset) the connection
    hung_up: bool = False  # we hung up, as the case says: nothing to judge here
    timed_out: bool = False
    elapsed_s: float = 0.0
    headers_sent_s: float | None = None  # when our request's headers were all written
    error: str = ""


# ---------------------------------------------------------------------------------- raw sockets
class RawAnswer:
    """An HTTP answer parsed with h11 as it arrives (a client whose request h11 never saw)."""

    def __init__(self, t0: float) -> None:
        self.t0, self.out, self.done = t0, Outcome(), asyncio.Event()
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 20)
        self.conn.send(h11.Request(method="GET", target="/", headers=[("Host", "fuzz")]))
        self.conn.send(h11.EndOfMessage())
        self.got = 0
        self.sent = b""  # the start of what we wrote (where the headers end)

    async def read(self, reader: asyncio.StreamReader) -> None:
        try:
            while not self.done.is_set():
                data = await reader.read(65536)
                self.got += len(data)
                self.conn.receive_data(data)
                self._events()
                if not data:
                    self.out.closed = True
                    break
        except (ConnectionError, OSError) as exc:
            self.out.closed, self.out.error = True, repr(exc)
        except h11.RemoteProtocolError as exc:
            self.out.closed = True
            if self.got and not (self.out.status is not None and self.out.complete):
                self.out.error = f"unreadable answer ({exc}) after {self.got} bytes"
        finally:
            self.finish()

    def _events(self) -> None:
        while True:
            ev = self.conn.next_event()
            if ev is h11.NEED_DATA or ev is h11.PAUSED:
                return
            if isinstance(ev, h11.Response):
                self.out.status = ev.status_code
                self.out.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in ev.headers}
            elif isinstance(ev, h11.Data) and len(self.out.body) < MAX_KEPT_BODY:
                self.out.body += bytes(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                self.out.complete = True
                self.finish()
                return
            elif isinstance(ev, h11.ConnectionClosed):
                self.out.closed = True
                return

    async def write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        self.sent += data[:4096] if len(self.sent) < 65536 else b""
        writer.write(data)
        await writer.drain()
        if self.out.headers_sent_s is None and b"\r\n\r\n" in self.sent:
            self.out.headers_sent_s = time.monotonic() - self.t0

    def finish(self) -> None:
        if not self.done.is_set():
            self.out.elapsed_s = time.monotonic() - self.t0
            self.done.set()


async def pause(answer: RawAnswer, seconds: float) -> None:
    """Sleep, cut short by the answer (or the server's close)."""
    try:
        await asyncio.wait_for(answer.done.wait(), seconds)
    except TimeoutError:
        pass


async def do_step(step: tuple, writer: asyncio.StreamWriter, answer: RawAnswer) -> None:
    op = step[0]
    if op == "send":
        await answer.write(writer, step[1])
    elif op == "trickle":
        for b in step[1]:
            if answer.done.is_set():
                return
            await answer.write(writer, bytes([b]))
            await pause(answer, step[2])
    elif op == "sleep":
        await pause(answer, step[1])
    elif op == "eof":
        writer.write_eof()
    else:
        raise ValueError(f"unknown step {op!r}")


async def run_raw(host: str, port: int, case: HttpCase) -> Outcome:
    t0 = time.monotonic()
    answer = RawAnswer(t0)
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    task = asyncio.ensure_future(answer.read(reader))
    try:
        for step in case.steps:
            if answer.done.is_set():
                break
            if step[0] == "hangup":
                answer.out.hung_up = True
                return answer.out
            try:
                await do_step(step, writer, answer)
            except (ConnectionError, OSError):  # the server closed: what did it answer?
                await pause(answer, 1.0)
                break
        remaining = case.bound_s - (time.monotonic() - t0)
        await pause(answer, max(0.0, remaining))
        if not answer.done.is_set():
            answer.out.timed_out = True
        return answer.out
    finally:
        writer.transport.abort()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# ---------------------------------------------------------------------------------- httpx
async def run_httpx(client: httpx.AsyncClient, base: str, case: HttpCase) -> Outcome:
    out, t0 = Outcome(), time.monotonic()

    async def trace(event: str, info: dict) -> None:
        if event == "http11.send_request_headers.complete":
            out.headers_sent_s = time.monotonic() - t0

    try:
        async with asyncio.timeout(case.bound_s):
            async with client.stream(case.method, base + case.path, headers=list(case.headers),
                                     content=case.body or None, timeout=case.bound_s,
                                     extensions={"trace": trace}) as resp:
                out.status = resp.status_code
                out.headers = {k.lower(): v for k, v in resp.headers.items()}
                if case.transport == STREAM_CUT and resp.status_code == 200:
                    out.body, out.complete = await read_events(resp, case.events)
                    out.hung_up = not out.complete
                else:
                    out.body = await resp.aread()
                    out.complete = True
    except (TimeoutError, httpx.TimeoutException):
        out.timed_out = True
    except httpx.TransportError as exc:
        out.closed, out.error = True, repr(exc)
    out.elapsed_s = time.monotonic() - t0
    return out


async def read_events(resp: httpx.Response, count: int) -> tuple[bytes, bool]:
    """The first ``count`` events of a stream (and whether the stream ended within them)."""
    lines: list[str] = []
    async for line in resp.aiter_lines():
        lines.append(line)
        if line == "data: [DONE]":
            return ("\n".join(lines) + "\n").encode(), True
        if sum(x.startswith("data:") for x in lines) >= count:
            break
    return ("\n".join(lines) + "\n").encode(), False


# ---------------------------------------------------------------------------------- the oracle
def judge(case: HttpCase, out: Outcome, header_timeout_s: float) -> list[tuple[str, str]]:
    """(problem, detail) pairs; none when the outcome is one the case allows. A connection closed
    unanswered is the server's fault only where our headers were all sent within its header
    timeout (else our own client was too slow, e.g. on a loaded box, and the close is the rule)."""
    if out.timed_out or out.elapsed_s > case.bound_s:
        return [("hang", f"no answer and no close within {case.bound_s:.0f} s")]
    if out.error and out.status is None and not out.closed:
        return [("unreadable answer", out.error)]
    if out.status is None:
        late = out.headers_sent_s is None or out.headers_sent_s >= header_timeout_s
        if out.hung_up or case.may_close or late:
            return []
        return [("closed unanswered", f"after {out.elapsed_s:.2f} s, our headers sent at {out.headers_sent_s:.2f} s: "
                                      f"{out.error or 'the server closed the connection'}")]
    problems = []
    status = out.status
    if status not in DOCUMENTED:
        problems.append((f"status {status}", f"not a documented status; body {out.body[:300]!r}"))
    elif status not in case.expect:
        problems.append((f"status {status}", f"expected {sorted(case.expect)}; body {out.body[:300]!r}"))
    if out.error:
        problems.append(("unreadable answer", out.error))
    elif not out.complete and not out.hung_up:
        problems.append(("answer cut short", f"{len(out.body)} bytes then {'close' if out.closed else 'nothing'}"))
    if status >= 400 and case.method != "HEAD":
        problems += error_body_problems(out, anthropic=case.path.startswith(MESSAGES_PREFIX))
    elif status == 200 and case.shape:
        problems += answer_problems(case, out)
    return problems


RESPONSE_ENDS = ("completed", "incomplete")


def error_body_problems(out: Outcome, anthropic: bool = False) -> list[tuple[str, str]]:
    ctype = out.headers.get("content-type", "")
    where = f"status {out.status}, content-type {ctype!r}, body {out.body[:200]!r}"
    try:
        obj = json.loads(out.body)
    except ValueError:
        return [("error body not JSON", where)]
    err = obj.get("error") if isinstance(obj, dict) else None
    if anthropic:
        if not isinstance(err, dict) or set(obj) != {"type", "error"} or obj["type"] != "error" \
                or set(err) != {"type", "message"} or not isinstance(err["type"], str) \
                or not isinstance(err["message"], str) or not err["message"]:
            return [("error body not Anthropic's shape", where)]
        return [] if ctype.startswith("application/json") else [("error body not application/json", where)]
    if not isinstance(err, dict) or set(obj) != {"error"} or set(err) != {"message", "type", "param", "code"}:
        return [("error body not OpenAI's shape", where)]
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
            and isinstance(err["param"], (str, type(None))) and isinstance(err["code"], (str, type(None)))):
        return [("error body fields of wrong types", where)]
    if not ctype.startswith("application/json"):
        return [("error body not application/json", where)]
    return []


def answer_problems(case: HttpCase, out: Outcome) -> list[tuple[str, str]]:
    ctype = out.headers.get("content-type", "")
    if case.shape == "text":
        return [] if out.body else [("empty answer", ctype)]
    if ctype.startswith("text/event-stream"):
        return stream_problems(case, out)
    if case.stream and case.choices:
        return [("not a stream", f"content-type {ctype!r} to a stream request")]
    try:
        obj = json.loads(out.body)
    except ValueError:
        return [("answer not JSON", repr(out.body[:200]))]
    if case.shape == "json":
        return [] if isinstance(obj, dict) else [("answer not a JSON object", repr(out.body[:200]))]
    if case.shape == "response":
        return response_problems(obj, out)
    if case.shape == "message":
        return message_problems(obj, out)
    kind = "chat.completion" if case.shape == "chat" else "text_completion"
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or obj.get("object") != kind:
        return [("answer of the wrong shape", repr(out.body[:300]))]
    if case.choices and sorted(c.get("index", -1) for c in choices if isinstance(c, dict)) != list(range(case.choices)):
        return [("wrong choices", f"expected {case.choices}: {out.body[:300]!r}")]
    for c in choices:
        if not isinstance(c, dict):
            return [("answer of the wrong shape", repr(c)[:300])]
        text = (c.get("message") or {}).get("content") if case.shape == "chat" else c.get("text")
        if not isinstance(text, str) or c.get("finish_reason") not in ("stop", "length"):
            return [("answer of the wrong shape", repr(c)[:300])]
    return []


def response_problems(obj, out: Outcome) -> list[tuple[str, str]]:
    """A Responses API answer: a finished response whose items are messages with their text (or
    calls); a background one queued, with none yet."""
    if isinstance(obj, dict) and obj.get("background") is True and obj.get("status") == "queued" \
            and obj.get("output") == []:
        return []
    if not isinstance(obj, dict) or obj.get("object") != "response" or obj.get("status") not in RESPONSE_ENDS \
            or not isinstance(obj.get("output"), list) or not obj["output"]:
        return [("answer of the wrong shape", repr(out.body[:300]))]
    for item in obj["output"]:
        texts = [p.get("text") for p in item.get("content") or () if isinstance(p, dict)] \
            if isinstance(item, dict) and item.get("type") == "message" else None
        if not (texts and all(isinstance(t, str) for t in texts)) and not (
                isinstance(item, dict) and item.get("type") == "function_call"):
            return [("answer of the wrong shape", repr(item)[:300])]
    return []


STOP_REASONS = ("end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded")


def message_problems(obj, out: Outcome) -> list[tuple[str, str]]:
    """A Messages API answer: a message of text and tool_use blocks with its stop reason and usage."""
    if not isinstance(obj, dict) or obj.get("type") != "message" or obj.get("stop_reason") not in STOP_REASONS \
            or not isinstance(obj.get("content"), list) or not obj["content"] \
            or not isinstance((obj.get("usage") or {}).get("output_tokens"), int):
        return [("answer of the wrong shape", repr(out.body[:300]))]
    for block in obj["content"]:
        if not (isinstance(block, dict) and (block.get("type") == "text" and isinstance(block.get("text"), str)
                                             or block.get("type") == "tool_use" and isinstance(block.get("input"),
                                                                                                dict))):
            return [("answer of the wrong shape", repr(block)[:300])]
    return []


def typed_events(out: Outcome, numbered: bool) -> tuple[list[str], list[tuple[str, str]]]:
    """The types of a stream of typed events (``event: TYPE`` then its ``data``; ``numbered``:
    ``sequence_number`` from 0), or the first problem."""
    blocks = [b.splitlines() for b in out.body.decode("utf-8", "replace").split("\n\n") if b.strip()]
    if out.hung_up and blocks:
        blocks = blocks[:-1]  # the last may be cut
    kinds = []
    for n, b in enumerate(blocks):
        if len(b) != 2 or not b[0].startswith("event: ") or not b[1].startswith("data: "):
            return kinds, [("event of the wrong shape", repr(b)[:300])]
        try:
            obj = json.loads(b[1][6:])
        except ValueError:
            return kinds, [("event not JSON", b[1][:200])]
        if not isinstance(obj, dict) or obj.get("type") != b[0][7:] or (numbered and obj.get("sequence_number") != n):
            return kinds, [("event of the wrong shape", b[1][:300])]
        kinds.append(obj["type"])
    return kinds, []


def message_stream_problems(out: Outcome) -> list[tuple[str, str]]:
    """The Messages API's events: message_start first, message_stop (or an error) last, unless the
    client hung up."""
    kinds, problems = typed_events(out, numbered=False)
    if problems:
        return problems
    if kinds and kinds[0] != "message_start":
        return [("stream without its start", repr(out.body[:300]))]
    if not out.hung_up and (not kinds or kinds[-1] not in ("message_stop", "error")):
        return [("stream without its end", repr(out.body[-300:]))]
    return []


def response_stream_problems(out: Outcome) -> list[tuple[str, str]]:
    """The Responses API's events, numbered from 0, the last one the response's end (unless the
    client hung up); no ``[DONE]``."""
    kinds, problems = typed_events(out, numbered=True)
    if problems:
        return problems
    if not out.hung_up and (not kinds or kinds[-1] not in {f"response.{e}" for e in RESPONSE_ENDS}):
        return [("stream without its end", repr(out.body[-300:]))]
    return []


def stream_problems(case: HttpCase, out: Outcome) -> list[tuple[str, str]]:
    if case.shape == "response":
        return response_stream_problems(out)
    if case.shape == "message":
        return message_stream_problems(out)
    datas = [ln[5:].strip() for ln in out.body.decode("utf-8", "replace").splitlines() if ln.startswith("data:")]
    finished: set[int] = set()
    for d in datas:
        if d == "[DONE]":
            continue
        try:
            obj = json.loads(d)
        except ValueError:
            return [("event not JSON", d[:200])]
        if not isinstance(obj, dict) or "error" in obj or not isinstance(obj.get("choices"), list):
            return [("event of the wrong shape", d[:300])]
        finished |= {c.get("index") for c in obj["choices"] if isinstance(c, dict) and c.get("finish_reason")}
    if out.hung_up:
        return []
    if not datas or datas[-1] != "[DONE]":
        return [("stream without [DONE]", repr(out.body[-300:]))]
    if case.choices and finished != set(range(case.choices)):
        return [("stream missing a finish", f"finished {sorted(finished)} of {case.choices}")]
    return []
