"""Client library for the orchestrator: push prompts (token ids), stream tokens back.

One DEALER per client, owned by one reader task; any number of concurrent ``generate`` calls,
matched by request id. No torch.

Orchestrator liveness (opt-in, ``heartbeat_s``): the client pings the orchestrator every
heartbeat and watches its connection. A dropped connection (the orchestrator died) or
``liveness`` unanswered beats fail every open stream at once with ``OrchestratorLost``, which
carries the tokens received so far, so a caller (``specsplit.pool.OrchestratorPool``) can
resume the request elsewhere. ``alive`` is True while the orchestrator answers.

    async with SpecSplitClient("tcp://127.0.0.1:5570") as client:
        result = await client.generate([1, 2, 3], max_new_tokens=64)

CURVE (``curve``, brokers.curve): the client watches its handshakes; an orchestrator that refuses
this process's key fails every open and later generation at once with ``OrchestratorRefused``
(logged ``curve_refused``) instead of letting it wait for its timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Callable

import zmq
import zmq.asyncio

from schemas import (
    Cancel, CodecError, ErrorReply, GenerateDone, GenerateRequest, GrammarSpec, Heartbeat, Message, SamplingSpec,
    Logprobs, SpecPVSpec, TokenChunk, TreeSpec, pack_frames, unpack_frames,
)
from brokers.curve import HANDSHAKE_FAILURES, CurveKeys, handshake_failure
from specsplit.logs import get_logger
from specsplit.transport.sockets import make_monitored_socket, make_socket


class GenerationError(RuntimeError):
    def __init__(self, reply: ErrorReply):
        super().__init__(f"{reply.code.value}: {reply.message}")
        self.reply = reply


class OrchestratorLost(RuntimeError):
    """The orchestrator died or went silent while a generation streamed; ``token_ids`` were
    received before that (resume from prompt + token_ids)."""

    def __init__(self, addr: str, reason: str, token_ids: list[int] | None = None):
        super().__init__(f"orchestrator {addr} lost ({reason})")
        self.addr, self.reason, self.token_ids = addr, reason, list(token_ids or [])


class OrchestratorRefused(RuntimeError):
    """The orchestrator refused this process's CURVE key: nothing can succeed until the key is
    admitted (not retryable)."""


@dataclass(frozen=True)
class _Refused:
    """Put on every open stream when the orchestrator refuses our CURVE key."""

    reason: str


@dataclass(frozen=True)
class _Lost:
    """Put on every open stream when the orchestrator is lost."""

    reason: str


@dataclass
class GenerationResult:
    session_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    rounds: int = 0
    resumes: int = 0  # times the request was resumed on a (possibly other) orchestrator
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    elapsed_s: float = 0.0
    first_token_s: float = 0.0
    predicted_tok_s: float = 0.0  # what the orchestrator's cost model expected (0: no model)
    # the orchestrator's view (GenerateDone): from the request's arrival to its first streamed token
    # (None: none streamed), and accepted tokens by position (index i: depth i + 1)
    orchestrator_first_token_ms: float | None = None
    accepted_per_pos: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens the target copied from its prefix cache (GenerateDone)
    chunks: list[int] = field(default_factory=list)  # tokens per streamed chunk
    logprobs: Logprobs | None = None  # asked for: of token_ids (GenerateDone)
    prompt_logprobs: Logprobs | None = None  # asked for: of the prompt's tokens after its first

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per target pass (accepted + bonus)."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


class SpecSplitClient:
    def __init__(self, addr: str, *, ctx: zmq.asyncio.Context | None = None, timeout_s: float = 600.0,
                 chunk_timeout_s: float = 300.0, heartbeat_s: float | None = None, liveness: int = 3,
                 curve: CurveKeys | None = None, per_prompt_token_s: float = 0.0):
        self.curve = curve
        self.refused: str | None = None  # why the orchestrator refused our CURVE key
        self._handshake_logged = 0.0
        self.addr, self.timeout_s, self.chunk_timeout_s = addr, timeout_s, chunk_timeout_s
        # a generation and the wait for its first chunk get this much more per prompt token (its prefill)
        self.per_prompt_token_s = per_prompt_token_s
        self.heartbeat_s, self.liveness = heartbeat_s, liveness
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = None
        self._reader: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []  # liveness: watchdog and connection monitor
        self._streams: dict[bytes, asyncio.Queue] = {}
        self._rids = itertools.count(random.getrandbits(40))
        self.alive = False  # answered within liveness x heartbeat (liveness mode only)
        self._closing = False
        self.losses = 0
        self._last_heard = 0.0
        # the orchestrator's last ping answer: the tokenizer its target workers serve ("" unknown)
        self.fleet: Heartbeat = Heartbeat()
        self.log = get_logger("specsplit.client", orchestrator=addr)

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    async def __aenter__(self) -> SpecSplitClient:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def start(self) -> None:
        if self._sock is None:
            mon = None
            if self.heartbeat_s or self.curve is not None:
                events = zmq.EVENT_DISCONNECTED | (HANDSHAKE_FAILURES | zmq.EVENT_HANDSHAKE_SUCCEEDED if self.curve else 0)
                self._sock, mon = make_monitored_socket(self._ctx, zmq.DEALER, events, connect=self.addr,
                                                        curve=self.curve)
            else:
                self._sock = make_socket(self._ctx, zmq.DEALER, connect=self.addr, curve=self.curve)
            loop = asyncio.get_running_loop()
            self._reader = loop.create_task(self._read_loop())
            self._last_heard = time.monotonic()
            if mon is not None:
                self._tasks.append(loop.create_task(self._monitor(mon)))
            if self.heartbeat_s:
                self._tasks.append(loop.create_task(self._watch()))

    async def close(self) -> None:
        self._closing = True  # the watchdog stops even if a cancellation is swallowed (wait_for race)
        tasks = [t for t in [*self._tasks, self._reader] if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=5.0)
            if stuck:
                self.log.warning("client_tasks_stuck", count=len(stuck))
        self._tasks, self._reader = [], None
        if self._sock is not None:
            if self.heartbeat_s or self.curve is not None:
                self._sock.disable_monitor()
            self._sock.close(linger=0)
            self._sock = None

    # ---- orchestrator liveness ---------------------------------------------------------
    async def _watch(self) -> None:
        """One ping a heartbeat; liveness beats without any frame fail every open stream (a
        stream opened while the orchestrator is away fails within a beat)."""
        hb = self.heartbeat_s
        while not self._closing:
            t0 = time.monotonic()
            if self.refused:  # no ping can pass; a later successful handshake clears it
                self._lose("refused")
                await asyncio.sleep(hb)
                continue
            rid, q = await self._request(Heartbeat(sent_at=time.time()), "-")
            try:
                async with asyncio.timeout(hb):  # (asyncio.wait_for can swallow a cancellation)
                    await q.get()
            except TimeoutError:
                pass
            finally:
                self._streams.pop(rid, None)
            if time.monotonic() - self._last_heard > hb * self.liveness:
                # frames waiting unread mean a busy loop, not a silent orchestrator
                waiting = await self._sock.poll(0) if self._sock is not None else 0
                if not waiting & zmq.POLLIN:
                    self._lose("silent")
            await asyncio.sleep(max(0.0, hb - (time.monotonic() - t0)))

    async def _monitor(self, mon) -> None:
        from zmq.utils.monitor import parse_monitor_message

        try:
            while True:
                msg = parse_monitor_message(await mon.recv_multipart())
                event = msg["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    if self.heartbeat_s:
                        self._lose("disconnected")
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.refused = None
                elif (why := handshake_failure(event, msg["value"], self.addr)) is not None:
                    self._on_handshake_failed(event, why)
        finally:
            mon.close(linger=0)

    def _on_handshake_failed(self, event: int, why: str) -> None:
        if event != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if time.monotonic() - self._handshake_logged >= 1.0:  # zmq retries every ~100 ms
                self._handshake_logged = time.monotonic()
                self.log.error("curve_handshake_failed", reason=why)
            return
        if not self.refused:
            self.log.error("curve_refused", reason=why)
        self.refused = why
        for q in self._streams.values():
            q.put_nowait(_Refused(why))

    def _lose(self, reason: str) -> None:
        """Fail every open generation now: its orchestrator is gone (or hung)."""
        if self.alive:
            self.losses += 1
            self.log.warning("orchestrator_lost", reason=reason, streams=len(self._streams))
        self.alive = False
        for q in self._streams.values():
            q.put_nowait(_Lost(reason))

    async def _read_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                env = unpack_frames(frames)
            except CodecError as exc:
                self.log.warning("bad_reply_dropped", error=str(exc))
                continue
            self._last_heard = time.monotonic()
            if self.heartbeat_s and not self.alive:
                self.alive = True
                self.log.info("orchestrator_alive")
            if isinstance(env.msg, Heartbeat):
                self.fleet = env.msg
            q = self._streams.get(env.request_id)
            if q is not None:
                q.put_nowait(env.msg)

    async def _request(self, msg: Message, sid: str) -> tuple[bytes, asyncio.Queue]:
        self.start()
        if self.refused:
            raise OrchestratorRefused(self.refused)
        rid = (next(self._rids) & (2**64 - 1)).to_bytes(8, "big")
        q: asyncio.Queue = asyncio.Queue(maxsize=0)
        self._streams[rid] = q
        try:
            await self._send(pack_frames(msg, sid, rid))
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return rid, q

    async def _send(self, frames: list[bytes]) -> None:
        """Send, bounded: a DEALER whose handshake failed has no pipe and would block forever, so
        the wait ends on a CURVE refusal (OrchestratorRefused) or after ``timeout_s``."""
        send = asyncio.ensure_future(self._sock.send_multipart(frames))
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({send}, timeout=0.1)
                if done:
                    return send.result()
                if self.refused:
                    raise OrchestratorRefused(self.refused)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not send to orchestrator {self.addr} in {self.timeout_s:.0f}s")
        finally:
            if not send.done():
                send.cancel()

    async def ping(self, timeout_s: float = 2.0) -> bool:
        """Readiness by handshake: True when the orchestrator answers a heartbeat in time."""
        rid, q = await self._request(Heartbeat(sent_at=time.time()), "-")
        try:
            async with asyncio.timeout(timeout_s):
                return isinstance(await q.get(), Heartbeat)
        except TimeoutError:
            return False
        finally:
            self._streams.pop(rid, None)

    def _cancel_session(self, sid: str) -> None:
        """Send Cancel(sid) without waiting (callable from a task being cancelled): dropped when
        the socket is closed or full, as a lost producer's session is then cancelled by the
        orchestrator's unreachable-producer rule or finishes on its own."""
        if self._sock is None or self._closing:
            return
        try:
            rid = (next(self._rids) & (2**64 - 1)).to_bytes(8, "big")
            sent = self._sock.send_multipart(pack_frames(Cancel(session_id=sid), sid, rid), flags=zmq.NOBLOCK)
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # a full queue drops it
        except zmq.ZMQError as exc:
            self.log.info("cancel_not_sent", session_id=sid, error=str(exc))

    async def generate(
        self, prompt_token_ids: list[int], *, max_new_tokens: int = 128, sampling: SamplingSpec | None = None,
        tree: TreeSpec | None = None, stop_token_ids=(), session_id: str | None = None,
        on_tokens: Callable[[list[int]], None] | None = None, specpv: SpecPVSpec | None = None,
        grammar: GrammarSpec | None = None, output_from: int | None = None, logprobs: int | None = None,
        on_logprobs: Callable[[Logprobs], None] | None = None, prompt_logprobs: int | None = None,
        on_prompt_logprobs: Callable[[Logprobs], None] | None = None, min_tokens: int = 0,
        prediction: Sequence[int] = (),
    ) -> GenerationResult:
        """``min_tokens``: no stop token among the first this many new tokens (vLLM's).
        ``prediction``: the answer's expected tokens (OpenAI's predicted outputs).
        ``grammar``: the output is constrained to it; ``output_from``: the prompt's tokens from
        there on are output already generated (a resumed generation; see GenerateRequest).
        ``logprobs``: the output's log-probabilities with this many alternatives (the result's
        ``logprobs``; each chunk's to ``on_logprobs``, called before ``on_tokens``).
        ``prompt_logprobs``: the prompt's (of its tokens after the first; the result's
        ``prompt_logprobs``, and ``on_prompt_logprobs`` before the first tokens)."""
        sid = session_id or uuid.uuid4().hex
        req = GenerateRequest(session_id=sid, prompt_token_ids=list(prompt_token_ids), max_new_tokens=max_new_tokens,
                              sampling=sampling or SamplingSpec(), tree=tree, stop_token_ids=list(stop_token_ids),
                              specpv=specpv, grammar=grammar, output_from=output_from, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, min_tokens=min_tokens,
                              prediction_token_ids=list(prediction))
        t0 = time.perf_counter()
        rid, q = await self._request(req, sid)
        res = GenerationResult(sid, list(prompt_token_ids), [], "error")
        parts: list[Logprobs] = []  # asked for: each chunk's
        prefill_s = self.per_prompt_token_s * len(req.prompt_token_ids)
        try:
            async with asyncio.timeout(self.timeout_s + prefill_s):
                while True:
                    async with asyncio.timeout(self.chunk_timeout_s + (0.0 if res.token_ids else prefill_s)):
                        msg = await q.get()
                    if isinstance(msg, TokenChunk):
                        if not res.token_ids:
                            res.first_token_s = time.perf_counter() - t0
                        res.token_ids.extend(msg.token_ids)
                        res.chunks.append(len(msg.token_ids))
                        if msg.prompt_logprobs is not None and res.prompt_logprobs is None:
                            res.prompt_logprobs = msg.prompt_logprobs
                            if on_prompt_logprobs:
                                on_prompt_logprobs(msg.prompt_logprobs)
                        if msg.logprobs is not None:
                            parts.append(msg.logprobs)
                            if on_logprobs:
                                on_logprobs(msg.logprobs)
                        if on_tokens:
                            on_tokens(msg.token_ids)
                    elif isinstance(msg, GenerateDone):
                        res.token_ids = list(msg.token_ids)
                        res.finish_reason, res.rounds = msg.finish_reason, msg.rounds
                        res.drafted_tokens, res.accepted_tokens = msg.drafted_tokens, msg.accepted_tokens
                        res.predicted_tok_s = msg.predicted_tok_s
                        res.orchestrator_first_token_ms = msg.first_token_ms
                        res.accepted_per_pos = list(msg.accepted_per_pos)
                        res.cached_tokens = msg.cached_tokens
                        if logprobs is not None:  # the chunks' (GenerateDone carries none: it could grow past a body)
                            res.logprobs = Logprobs.join(parts)
                        break
                    elif isinstance(msg, ErrorReply):
                        raise GenerationError(msg)
                    elif isinstance(msg, _Lost):
                        raise OrchestratorLost(self.addr, msg.reason, res.token_ids)
                    elif isinstance(msg, _Refused):
                        raise OrchestratorRefused(msg.reason)
        except (asyncio.CancelledError, TimeoutError):
            # the caller gave up (a client disconnected, a deadline passed): stop the session on
            # the orchestrator and its workers now instead of letting it run to its end
            self._cancel_session(sid)
            raise
        finally:
            self._streams.pop(rid, None)
        res.elapsed_s = time.perf_counter() - t0
        return res
