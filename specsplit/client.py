"""Client library for the orchestrator: push prompts (token ids), stream tokens back.

One DEALER per client, owned by one reader task; any number of concurrent ``generate`` calls,
matched by request id. No torch.

    async with SpecSplitClient("tcp://127.0.0.1:5570") as client:
        result = await client.generate([1, 2, 3], max_new_tokens=64)
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio

from schemas import (
    CodecError, ErrorReply, GenerateDone, GenerateRequest, Heartbeat, Message, SamplingSpec, TokenChunk, TreeSpec,
    pack_frames, unpack_frames,
)
from specsplit.logs import get_logger
from specsplit.transport.sockets import make_socket


class GenerationError(RuntimeError):
    def __init__(self, reply: ErrorReply):
        super().__init__(f"{reply.code.value}: {reply.message}")
        self.reply = reply


@dataclass
class GenerationResult:
    session_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    elapsed_s: float = 0.0
    first_token_s: float = 0.0
    predicted_tok_s: float = 0.0  # what the orchestrator's cost model expected (0: no model)
    chunks: list[int] = field(default_factory=list)  # tokens per streamed chunk

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
                 chunk_timeout_s: float = 300.0):
        self.addr, self.timeout_s, self.chunk_timeout_s = addr, timeout_s, chunk_timeout_s
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = None
        self._reader: asyncio.Task | None = None
        self._streams: dict[bytes, asyncio.Queue] = {}
        self._rids = itertools.count(random.getrandbits(40))
        self.log = get_logger("specsplit.client")

    async def __aenter__(self) -> SpecSplitClient:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def start(self) -> None:
        if self._sock is None:
            self._sock = make_socket(self._ctx, zmq.DEALER, connect=self.addr)
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _read_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                env = unpack_frames(frames)
            except CodecError as exc:
                self.log.warning("bad_reply_dropped", error=str(exc))
                continue
            q = self._streams.get(env.request_id)
            if q is not None:
                q.put_nowait(env.msg)

    async def _request(self, msg: Message, sid: str) -> tuple[bytes, asyncio.Queue]:
        self.start()
        rid = (next(self._rids) & (2**64 - 1)).to_bytes(8, "big")
        q: asyncio.Queue = asyncio.Queue(maxsize=0)
        self._streams[rid] = q
        await self._sock.send_multipart(pack_frames(msg, sid, rid))
        return rid, q

    async def ping(self, timeout_s: float = 2.0) -> bool:
        """Readiness by handshake: True when the orchestrator answers a heartbeat in time."""
        rid, q = await self._request(Heartbeat(sent_at=time.time()), "-")
        try:
            return isinstance(await asyncio.wait_for(q.get(), timeout_s), Heartbeat)
        except asyncio.TimeoutError:
            return False
        finally:
            self._streams.pop(rid, None)

    async def generate(
        self, prompt_token_ids: list[int], *, max_new_tokens: int = 128, sampling: SamplingSpec | None = None,
        tree: TreeSpec | None = None, stop_token_ids=(), session_id: str | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        sid = session_id or uuid.uuid4().hex
        req = GenerateRequest(session_id=sid, prompt_token_ids=list(prompt_token_ids), max_new_tokens=max_new_tokens,
                              sampling=sampling or SamplingSpec(), tree=tree, stop_token_ids=list(stop_token_ids))
        t0 = time.perf_counter()
        rid, q = await self._request(req, sid)
        res = GenerationResult(sid, list(prompt_token_ids), [], "error")
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    msg = await asyncio.wait_for(q.get(), self.chunk_timeout_s)
                    if isinstance(msg, TokenChunk):
                        if not res.token_ids:
                            res.first_token_s = time.perf_counter() - t0
                        res.token_ids.extend(msg.token_ids)
                        res.chunks.append(len(msg.token_ids))
                        if on_tokens:
                            on_tokens(msg.token_ids)
                    elif isinstance(msg, GenerateDone):
                        res.token_ids = list(msg.token_ids)
                        res.finish_reason, res.rounds = msg.finish_reason, msg.rounds
                        res.drafted_tokens, res.accepted_tokens = msg.drafted_tokens, msg.accepted_tokens
                        res.predicted_tok_s = msg.predicted_tok_s
                        break
                    elif isinstance(msg, ErrorReply):
                        raise GenerationError(msg)
        finally:
            self._streams.pop(rid, None)
        res.elapsed_s = time.perf_counter() - t0
        return res
