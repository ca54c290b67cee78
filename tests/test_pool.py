"""OrchestratorPool against fake orchestrators (real sockets, no fleet): a request whose
orchestrator dies or cancels is resumed elsewhere from what was received, with the remaining
budget and the same stop ids; OVERLOADED is retried; BAD_REQUEST is not."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from schemas import (
    ErrorCode, ErrorReply, GenerateDone, GenerateRequest, Heartbeat, TokenChunk, pack_frames, unpack_frames,
)
from specsplit.client import GenerationError
from specsplit.pool import OrchestratorPool
from specsplit.transport.sockets import endpoint, make_socket

pytestmark = pytest.mark.timeout(30)


class FakeOrchestrator:
    """Answers pings; ``behave(req, send)`` serves each GenerateRequest (``send(msg)`` replies)."""

    def __init__(self, ctx, behave, addr: str = "tcp://127.0.0.1:*") -> None:
        self.sock = make_socket(ctx, zmq.ROUTER, bind=addr)
        self.addr, self.behave, self.requests = endpoint(self.sock), behave, []
        self.mute = False  # hung: reads, never answers
        self.received = asyncio.Event()  # set by _run once the producer has streamed tokens
        self.task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            client, env = frames[0], unpack_frames(frames[1:])
            if self.mute:
                continue

            async def send(msg, client=client, env=env):
                await self.sock.send_multipart([client, *pack_frames(msg, env.session_id, env.request_id)])

            if isinstance(env.msg, Heartbeat):
                await send(Heartbeat())
            elif isinstance(env.msg, GenerateRequest):
                self.requests.append(env.msg)
                await self.behave(self, env.msg, send)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close(linger=0)


def continuation(req: GenerateRequest) -> list[int]:
    """A deterministic 'model': the next token is (sum of the context) % 97 + 1."""
    ctx, out = list(req.prompt_token_ids), []
    for _ in range(req.max_new_tokens):
        t = sum(ctx) % 97 + 1
        out.append(t)
        ctx.append(t)
        if t in req.stop_token_ids:
            break
    return out


async def serve_all(orch, req, send):
    toks = continuation(req)
    await send(TokenChunk(session_id=req.session_id, round=0, token_ids=toks))
    await send(GenerateDone(session_id=req.session_id, token_ids=toks, finish_reason="length"))


async def _run(behave_a, n=20, behave_b=serve_all, seen: list | None = None, gen: dict | None = None, **pool_kw):
    """``pool.generate`` over orchestrators a and b (``seen`` gets the tokens streamed, ``gen``:
    more arguments of generate)."""
    ctx = zmq.asyncio.Context()
    a = FakeOrchestrator(ctx, behave_a)
    b = FakeOrchestrator(ctx, behave_b)
    try:
        # liveness: 1 s of silence (a busy box may stall the loop for a while; the hung orchestrator
        # is noticed a little later, as it should be)
        async with OrchestratorPool([a.addr, b.addr], ctx=ctx, heartbeat_s=0.1, liveness=10, timeout_s=20,
                                    **pool_kw) as pool:
            assert await pool.ping(5.0)
            while len(pool.live) < 2:
                await asyncio.sleep(0.05)
            # both idle: the first attempt goes to a (the first of equals)
            def on_tokens(tokens):
                a.received.set()
                if seen is not None:
                    seen.extend(tokens)

            res = await pool.generate([1, 2, 3], max_new_tokens=n, stop_token_ids=[1000], on_tokens=on_tokens,
                                      **(gen or {}))
            return res, a, b
    finally:
        await a.close()
        await b.close()
        ctx.term()


def test_orchestrator_dies_mid_stream_request_resumes_elsewhere_from_received_tokens():
    async def die_after_5(orch, req, send):
        toks = continuation(req)[:5]
        await send(TokenChunk(session_id=req.session_id, round=0, token_ids=toks))
        await orch.received.wait()  # the tokens arrived (a close at once would drop them unsent)
        orch.sock.close(linger=0)  # the process died

    res, a, b = asyncio.run(_run(die_after_5))
    full = continuation(GenerateRequest(session_id="x", prompt_token_ids=[1, 2, 3], max_new_tokens=20))
    assert res.token_ids == full and res.finish_reason == "length" and res.resumes == 1
    resumed = b.requests[-1]
    assert resumed.prompt_token_ids == [1, 2, 3, *full[:5]] and resumed.max_new_tokens == 15
    assert resumed.stop_token_ids == [1000] and resumed.session_id != a.requests[0].session_id


def test_a_session_failed_after_streaming_resumes_after_what_it_streamed():
    """An orchestrator that streams tokens, then fails the session (NO_WORKER: its workers gave
    up): the resume goes on after the streamed tokens, which the caller saw once (before, it
    started over, and the caller saw them twice)."""
    seen: list[int] = []

    async def fail_after_4(orch, req, send):
        toks = continuation(req)[:4]
        await send(TokenChunk(session_id=req.session_id, round=0, token_ids=toks))
        await send(ErrorReply.of(ErrorCode.NO_WORKER, "gave up", session_id=req.session_id))

    res, _, b = asyncio.run(_run(fail_after_4, seen=seen))
    full = continuation(GenerateRequest(session_id="x", prompt_token_ids=[1, 2, 3], max_new_tokens=20))
    assert res.token_ids == full == seen and res.resumes == 1
    assert b.requests[-1].prompt_token_ids == [1, 2, 3, *full[:4]] and b.requests[-1].max_new_tokens == 16



def test_a_resume_keeps_what_remains_of_min_tokens():
    """min_tokens 12, the first orchestrator failing after 4 tokens: the resume asks for the 8
    that remain (and 0 once the minimum was streamed)."""

    async def fail_after(orch, req, send, k):
        toks = continuation(req)[:k]
        await send(TokenChunk(session_id=req.session_id, round=0, token_ids=toks))
        await send(ErrorReply.of(ErrorCode.NO_WORKER, "gave up", session_id=req.session_id))

    for k, rest in ((4, 8), (15, 0)):
        res, a, b = asyncio.run(_run(lambda o, r, s, k=k: fail_after(o, r, s, k), gen={"min_tokens": 12}))
        assert res.resumes == 1 and len(res.token_ids) == 20
        assert a.requests[0].min_tokens == 12 and b.requests[-1].min_tokens == rest


def test_logprobs_follow_their_tokens_across_a_resume():
    """Each chunk's log-probabilities reach ``on_logprobs`` and the result, aligned with the
    tokens, through a resume after an orchestrator died mid-stream."""
    from schemas import Logprobs

    def lp(toks):
        return Logprobs(token=[-t / 100 for t in toks], top_ids=[[t] for t in toks], top=[[-t / 100] for t in toks])

    async def with_logprobs(orch, req, send, upto=None):
        toks = continuation(req)[:upto]
        await send(TokenChunk(session_id=req.session_id, round=0, token_ids=toks, logprobs=lp(toks)))
        if upto is None:
            await send(GenerateDone(session_id=req.session_id, token_ids=toks, finish_reason="length"))
        else:
            await orch.received.wait()
            orch.sock.close(linger=0)

    parts: list = []
    res, a, _ = asyncio.run(_run(lambda o, r, s: with_logprobs(o, r, s, upto=6), behave_b=with_logprobs,
                                 gen={"logprobs": 1, "on_logprobs": parts.append}))
    assert res.resumes == 1 and len(res.token_ids) == 20 and a.requests[0].logprobs == 1
    assert res.logprobs == lp(res.token_ids) == Logprobs.join(parts)


def test_the_prompts_logprobs_are_asked_again_only_until_they_came():
    """An orchestrator lost before its first chunk: the resume asks for the prompt's
    log-probabilities again. One lost after it (they came with it): the resume does not, and the
    caller got them once."""
    from schemas import Logprobs

    rows = Logprobs(token=[-0.5, -0.25], top_ids=[[2], [3]], top=[[-0.5], [-0.25]])

    async def serve_rows(orch, req, send, upto=None):
        toks = continuation(req)[:upto]
        first = rows if req.prompt_logprobs is not None else None
        await send(TokenChunk(session_id=req.session_id, round=0, token_ids=toks, prompt_logprobs=first))
        if upto is None:
            await send(GenerateDone(session_id=req.session_id, token_ids=toks, finish_reason="length"))
        else:
            await orch.received.wait()
            orch.sock.close(linger=0)

    async def die_at_once(orch, req, send):
        orch.sock.close(linger=0)

    for behave, asked_again in ((die_at_once, True), (lambda o, r, s: serve_rows(o, r, s, upto=5), False)):
        seen: list = []
        res, a, b = asyncio.run(_run(behave, behave_b=serve_rows,
                                     gen={"prompt_logprobs": 1, "on_prompt_logprobs": seen.append}))
        assert res.resumes == 1 and len(res.token_ids) == 20
        assert a.requests[0].prompt_logprobs == 1
        assert (b.requests[-1].prompt_logprobs == 1) is asked_again
        assert res.prompt_logprobs == rows and seen == [rows]


def test_cancelled_is_resumed_not_returned():
    async def cancel_after_3(orch, req, send):
        toks = continuation(req)[:3]
        await send(TokenChunk(session_id=req.session_id, round=0, token_ids=toks))
        await send(GenerateDone(session_id=req.session_id, token_ids=toks, finish_reason="cancelled"))

    res, a, b = asyncio.run(_run(cancel_after_3))
    assert res.finish_reason == "length" and len(res.token_ids) == 20 and res.resumes == 1


def test_overloaded_is_retried_bad_request_is_not():
    calls = {"n": 0}

    async def overloaded_twice(orch, req, send):
        calls["n"] += 1
        if calls["n"] <= 2:
            await send(ErrorReply.of(ErrorCode.OVERLOADED, "full", session_id=req.session_id))
        else:
            await serve_all(orch, req, send)

    res, a, b = asyncio.run(_run(overloaded_twice, max_resumes=0, backoff_s=0.01))
    assert res.finish_reason == "length" and res.resumes == 0  # OVERLOADED costs no resume

    async def bad(orch, req, send):
        await send(ErrorReply.of(ErrorCode.BAD_REQUEST, "too long", session_id=req.session_id))

    with pytest.raises(GenerationError) as info:
        asyncio.run(_run(bad))
    assert info.value.reply.code == ErrorCode.BAD_REQUEST


def test_hung_orchestrator_is_noticed_by_heartbeat_and_the_request_resumes():
    async def hang_after_4(orch, req, send):
        await send(TokenChunk(session_id=req.session_id, round=0, token_ids=continuation(req)[:4]))
        orch.mute = True  # alive socket, no answers: only the heartbeat can tell

    res, a, b = asyncio.run(_run(hang_after_4))
    assert res.finish_reason == "length" and len(res.token_ids) == 20 and res.resumes == 1
    assert b.requests[-1].max_new_tokens == 16


@pytest.mark.parametrize("per_token", [0.25, 0.0])
def test_the_first_chunk_waits_longer_for_a_longer_prompt(per_token):
    """A prompt's prefill comes before its first chunk: the wait for it grows by
    ``per_prompt_token_s`` a prompt token (SPECSPLIT_PRODUCE_TIMEOUT_PER_PROMPT_TOKEN_S). Without
    it, a prefill longer than the chunk timeout is given up on."""
    async def slow_prefill(orch, req, send):
        await asyncio.sleep(0.6)  # the 3-token prompt's "prefill": past the 0.3 s chunk timeout
        toks = continuation(req)
        for i in range(0, len(toks), 5):
            await send(TokenChunk(session_id=req.session_id, round=i, token_ids=toks[i:i + 5]))
        await send(GenerateDone(session_id=req.session_id, token_ids=toks, finish_reason="length"))

    full = continuation(GenerateRequest(session_id="x", prompt_token_ids=[1, 2, 3], max_new_tokens=20))
    if per_token:
        res, a, b = asyncio.run(_run(slow_prefill, behave_b=slow_prefill, chunk_timeout_s=0.3,
                                     per_prompt_token_s=per_token))
        assert res.token_ids == full and res.resumes == 0 and len(a.requests) + len(b.requests) == 1
        return
    with pytest.raises(TimeoutError):
        asyncio.run(_run(slow_prefill, behave_b=slow_prefill, chunk_timeout_s=0.3))
