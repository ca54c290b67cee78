"""Producers over several orchestrators, resuming what a lost one left unfinished. No torch.

    async with OrchestratorPool(["tcp://127.0.0.1:5570", "tcp://127.0.0.1:5571"]) as pool:
        result = await pool.generate(prompt_ids, max_new_tokens=64)

One ``SpecSplitClient`` (with liveness) per orchestrator address. ``generate`` sends each request
to the live orchestrator with the fewest open streams. When that orchestrator dies, hangs, or
cancels the session (it was stopped), the request is **resumed** on a live one (the same or
another, once it answers again) from what was already received: the new prompt is the original
prompt + the tokens received, the budget is what remains of ``max_new_tokens``, the stop ids are
the same. Greedy output is unchanged by a resume (it is a function of the context alone); a
sampled one stays distributed as the target's sampling but is not the same draw.

A session that failed on the fleet's side (NO_WORKER after its attempts, INTERNAL) is resumed
the same way after a back-off; OVERLOADED (not admitted: nothing lost) is retried with jittered
back-off until the deadline without counting as a resume. BAD_REQUEST and other
non-retryable errors raise ``GenerationError`` at once. Resumes are bounded (``max_resumes`` per
request) and the whole generation by ``timeout_s``; a result's ``finish_reason`` is always
"stop" or "length" ("cancelled" is never returned as an answer).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Sequence
from typing import Callable

import zmq.asyncio

from schemas import ErrorCode, ErrorReply, GrammarSpec, Logprobs, SamplingSpec, TreeSpec
from brokers.curve import CurveKeys
from brokers.rendezvous import ROUTE_SEP
from specsplit.client import GenerationError, GenerationResult, OrchestratorLost, OrchestratorRefused, SpecSplitClient
from specsplit.logs import get_logger

RESUME_ON = {ErrorCode.NO_WORKER, ErrorCode.INTERNAL, ErrorCode.OVERLOADED}
FINISHED = ("stop", "length")


class NoOrchestrator(TimeoutError):
    """No orchestrator answered before the request's deadline."""


class OrchestratorPool:
    def __init__(self, addrs: list[str], *, ctx: zmq.asyncio.Context | None = None, timeout_s: float = 600.0,
                 chunk_timeout_s: float = 300.0, heartbeat_s: float = 1.0, liveness: int = 3,
                 max_resumes: int = 16, backoff_s: float = 0.2, backoff_max_s: float = 2.0,
                 curve: CurveKeys | None = None, retry_overloaded: bool = True, wait_live_s: float | None = None,
                 per_prompt_token_s: float = 0.0):
        if not addrs:
            raise ValueError("an orchestrator pool needs at least one address")
        self.timeout_s, self.max_resumes = timeout_s, max_resumes
        self.per_prompt_token_s = per_prompt_token_s  # more time per prompt token (its prefill)
        # False: OVERLOADED from every live orchestrator in turn raises (an HTTP API answers 429)
        self.retry_overloaded = retry_overloaded
        self.wait_live_s = wait_live_s  # longest wait for a live orchestrator (None: the deadline)
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.clients = [SpecSplitClient(a, ctx=ctx, timeout_s=timeout_s, chunk_timeout_s=chunk_timeout_s,
                                        heartbeat_s=heartbeat_s, liveness=liveness, curve=curve,
                                        per_prompt_token_s=per_prompt_token_s) for a in addrs]
        self.resumes = 0  # over all requests
        self.log = get_logger("specsplit.pool")

    async def __aenter__(self) -> OrchestratorPool:
        for c in self.clients:
            c.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    @property
    def live(self) -> list[SpecSplitClient]:
        return [c for c in self.clients if c.alive]

    async def ping(self, timeout_s: float = 2.0) -> bool:
        """True when some orchestrator answers within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.live:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def _pick(self, deadline: float, avoid: SpecSplitClient | None = None) -> SpecSplitClient:
        """The live orchestrator with the fewest open streams, another than ``avoid`` (the one
        that just lost or cancelled the request) when there is one; waits (bounded) for one."""
        waited_since = None
        while True:
            live = [c for c in self.live if c is not avoid] or self.live
            if live:
                return min(live, key=lambda c: c.open_streams)
            if all(c.refused for c in self.clients):  # waiting cannot help
                raise OrchestratorRefused("; ".join(c.refused for c in self.clients))
            waited_since = waited_since or time.monotonic()
            if time.monotonic() >= deadline or (self.wait_live_s is not None and waited_since is not None
                                                and time.monotonic() - waited_since >= self.wait_live_s):
                raise NoOrchestrator(f"no orchestrator of {[c.addr for c in self.clients]} answered")
            await asyncio.sleep(0.05)

    async def generate(
        self, prompt_token_ids: list[int], *, max_new_tokens: int = 128, sampling: SamplingSpec | None = None,
        tree: TreeSpec | None = None, stop_token_ids=(), on_tokens: Callable[[list[int]], None] | None = None,
        session_group: str | None = None, grammar: GrammarSpec | None = None, logprobs: int | None = None,
        on_logprobs: Callable[[Logprobs], None] | None = None, prompt_logprobs: int | None = None,
        on_prompt_logprobs: Callable[[Logprobs], None] | None = None, min_tokens: int = 0,
        prediction: Sequence[int] = (),
    ) -> GenerationResult:
        """``SpecSplitClient.generate`` on a live orchestrator, resumed on another where one is
        lost: ``on_tokens`` / ``on_logprobs`` see every token once, and the result holds them all;
        the prompt's log-probabilities (asked for) come once, from the first attempt that sends
        them (they come before its first tokens: a resume after tokens has them). A resume's
        ``max_new_tokens`` and ``min_tokens`` are what remains of them."""
        prompt, stop = list(prompt_token_ids), list(stop_token_ids)
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s + self.per_prompt_token_s * len(prompt)
        received: list[int] = []
        total = GenerationResult(uuid.uuid4().hex, prompt, received, "error")
        resumes, delay, client, overloaded, answered = 0, self.backoff_s, None, 0, False

        attempt: list[int] = []  # the tokens the current attempt streamed
        # where the output began matters to a grammar, penalties and a prediction: a resume says it (output_from)
        on_output = grammar is not None or (sampling is not None and sampling.penalized) or bool(prediction)

        def seen(tokens: list[int]) -> None:  # the caller's time to first token, across resumes
            attempt.extend(tokens)
            if tokens and not total.first_token_s:
                total.first_token_s = time.perf_counter() - t0
            if on_tokens is not None:
                on_tokens(tokens)

        parts: list[Logprobs] = []  # asked for: of the tokens streamed, across resumes

        def seen_logprobs(part: Logprobs) -> None:
            parts.append(part)
            if on_logprobs is not None:
                on_logprobs(part)

        def seen_prompt(rows: Logprobs) -> None:
            total.prompt_logprobs = rows
            if on_prompt_logprobs is not None:
                on_prompt_logprobs(rows)

        while True:
            client = await self._pick(deadline, avoid=client)
            wait_s, counts = 0.0, True  # lost / cancelled: resume elsewhere at once
            attempt.clear()
            try:
                async with asyncio.timeout(max(0.001, deadline - time.monotonic())):
                    # a session per attempt; in ``session_group`` its id routes it by the group
                    # (brokers.rendezvous.route_key): to the workers holding the group's prefixes
                    sid = f"{session_group}{ROUTE_SEP}{uuid.uuid4().hex}" if session_group else None
                    res = await client.generate(prompt + received, max_new_tokens=max_new_tokens - len(received),
                                                sampling=sampling, tree=tree, stop_token_ids=stop, on_tokens=seen,
                                                session_id=sid, grammar=grammar, logprobs=logprobs,
                                                on_logprobs=seen_logprobs,
                                                output_from=len(prompt) if on_output and received else None,
                                                prompt_logprobs=prompt_logprobs if total.prompt_logprobs is None
                                                else None, on_prompt_logprobs=seen_prompt,
                                                min_tokens=max(0, min_tokens - len(received)),
                                                prediction=prediction)
            except OrchestratorLost as exc:
                received.extend(exc.token_ids)
                why = f"lost: {exc.reason}"
            except GenerationError as exc:
                if exc.reply.code not in RESUME_ON:
                    raise
                received.extend(attempt)  # streamed to the caller already: the resume goes on after them
                overloaded = overloaded + 1 if exc.reply.code == ErrorCode.OVERLOADED else 0
                if overloaded >= max(1, len(self.live)) and not self.retry_overloaded:
                    raise
                why = exc.reply.code.value
                # OVERLOADED: nothing was lost, only the deadline bounds the wait; the others count
                wait_s, counts = delay * random.uniform(0.5, 1.5), exc.reply.code != ErrorCode.OVERLOADED
                delay = min(delay * 2, self.backoff_max_s)
            else:
                received.extend(res.token_ids)
                for k in ("rounds", "drafted_tokens", "accepted_tokens"):
                    setattr(total, k, getattr(total, k) + getattr(res, k))
                total.accepted_per_pos = _add_lists(total.accepted_per_pos, res.accepted_per_pos)
                if total.orchestrator_first_token_ms is None:  # the first attempt that streamed a token
                    total.orchestrator_first_token_ms = res.orchestrator_first_token_ms
                if not answered:  # the first attempt that finished: its prompt's tokens (a resume's: part of them)
                    total.cached_tokens, answered = min(res.cached_tokens, len(prompt)), True
                if res.finish_reason in FINISHED:
                    total.finish_reason, total.session_id = res.finish_reason, res.session_id
                    total.predicted_tok_s = res.predicted_tok_s  # the last attempt's orchestrator
                    break
                why = f"finish_reason={res.finish_reason}"
            done = self._finished_already(received, max_new_tokens, stop)
            if done:
                total.finish_reason = done
                break
            if counts:
                resumes += 1
                self.resumes += 1
                if resumes > self.max_resumes:
                    why = f"gave up after {self.max_resumes} resumes: {why}"
                    raise GenerationError(ErrorReply.of(ErrorCode.INTERNAL, why, retryable=False))
                self.log.info("generation_resumed", orchestrator=client.addr, reason=why, received=len(received),
                              resumes=resumes)
            if wait_s:
                await asyncio.sleep(min(wait_s, max(0.0, deadline - time.monotonic())))
        total.token_ids, total.resumes = received, resumes
        if logprobs is not None:
            total.logprobs = Logprobs.join(parts)
        total.elapsed_s = time.perf_counter() - t0
        return total

    @staticmethod
    def _finished_already(received: list[int], max_new_tokens: int, stop: list[int]) -> str | None:
        if received and received[-1] in stop:
            return "stop"
        if len(received) >= max_new_tokens:
            return "length"
        return None


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count lists of any lengths."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
