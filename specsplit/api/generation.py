"""The choices of one HTTP request, each an orchestrator session on the pool, as one stream of
events: ``Delta(index, text, calls)`` as tokens arrive, then ``Done(index, ...)`` or
``Failed(index, error)`` per choice. Text goes through ``textstream.ChoiceText`` (incremental
decoding, stop strings), then, for a request with tools, ``tools.CallParser`` (the model's tool
calls). A stop string ends its session at once (the pool's client sends Cancel), and so do the
first call under ``parallel_tool_calls: false`` and ``cancel()`` (the HTTP client went away).
No torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from schemas import ErrorCode, GrammarSpec, Logprobs, SamplingSpec
from specsplit.api.logprobs import LogprobTrail, TokenLogprob, prompt_entries
from specsplit.api.metrics import ApiMetrics
from specsplit.api.protocol import ApiError
from specsplit.api.textstream import ChoiceText, LineLimits
from specsplit.api.tools import CallParser, ParsedCall, ToolPlan
from specsplit.client import GenerationError, GenerationResult, OrchestratorRefused
from specsplit.pool import NoOrchestrator
from specsplit.proposers.prediction import followed


@dataclass(frozen=True)
class Job:
    """One choice to generate: ``index`` in the response's choices."""

    index: int
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingSpec
    stops: tuple[str, ...] = ()
    prompt_index: int = 0  # which of the request's prompts (usage counts each prompt once)
    group: str | None = None  # its sessions' routing group (``brokers.rendezvous.route_key``), or None
    tools: ToolPlan | None = None  # the request's tools: calls are parsed out of the text
    grammar: GrammarSpec | None = None  # the output held to it (response_format)
    logprobs: int | None = None  # the tokens' log-probabilities asked for, with this many alternatives
    echo: str | None = None  # the prompt's text, returned before the choice's (max_tokens 0: alone)
    prompt_logprobs: int | None = None  # echo with logprobs: the prompt's tokens' too
    ends_listed: bool = False  # end tokens are listed with the logprobs (a completion's, as vLLM's)
    min_tokens: int = 0  # no end token, and no stop string ending in their text, before this many tokens
    prediction: tuple[int, ...] = ()  # the answer's expected tokens (a chat's ``prediction``)
    include_stop: bool = False  # the text ends after the stop string (vLLM's include_stop_str_in_output)
    lines: LineLimits | None = None  # llama-server's n_indent and t_max_predict_ms


@dataclass(frozen=True)
class Delta:
    index: int
    text: str
    calls: tuple[ParsedCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens whose text this delta completes


@dataclass(frozen=True)
class Done:
    index: int
    text: str  # the last of the text (held back until the end)
    finish_reason: str  # stop | length | tool_calls (the answer made calls and was not cut short)
    prompt_index: int
    prompt_tokens: int
    completion_tokens: int
    speculative: dict
    cached_tokens: int = 0  # of the prompt, from the target's prefix cache
    calls: tuple[ParsedCall, ...] = ()  # found in the last of the text
    logprobs: tuple[TokenLogprob, ...] = ()  # of the last of the tokens
    # a predicted output's tokens the answer took up and those it did not (OpenAI's usage details)
    prediction: tuple[int, int] | None = None
    stop_word: str | None = None  # the stop string that ended the answer
    limited: bool = False  # the job's line limits ended it


@dataclass(frozen=True)
class Failed:
    index: int
    error: ApiError


Event = Delta | Done | Failed


@dataclass
class _Choice:
    job: Job
    text: ChoiceText
    tokens: int = 0
    first_at: float | None = None
    last_at: float | None = None
    cut: bool = False  # ended here: a stop string, or the caller cancelled
    task: asyncio.Task | None = None
    streamed: list[int] = field(default_factory=list)
    parser: CallParser | None = None
    trail: LogprobTrail | None = None  # logprobs asked for
    prompt_rows: Logprobs | None = None  # the prompt's log-probabilities (asked for), as the fleet sent them
    echoed: bool = False  # the prompt's text went out (echo)

    @property
    def stopped(self) -> bool:
        """The answer is complete before its session ended: a stop string, or its one call."""
        return self.text.stopped or (self.parser is not None and self.parser.ended)

    def push(self, ids: list[int]) -> tuple[str, tuple[ParsedCall, ...]]:
        if self.trail is not None:
            text, spans = self.text.push_each(ids)
            self.trail.tokens(ids, spans)
        else:
            text = self.text.push(ids)
        if self.parser is None:
            return text, ()
        text, calls = self.parser.feed(text)
        return text, tuple(calls)

    def finish(self) -> tuple[str, tuple[ParsedCall, ...]]:
        tail = self.text.finish()
        if self.parser is None:
            return tail, ()
        text, calls = self.parser.feed(tail)
        rest, more = self.parser.finish()
        return text + rest, tuple(calls + more)


class Generation:
    def __init__(self, pool, decode, jobs: list[Job], stop_token_ids: list[int], metrics: ApiMetrics,
                 arrived: float | None = None, unlisted: list[int] | None = None) -> None:
        """``unlisted``: end tokens a chat's logprobs leave out (default: ``stop_token_ids``)."""
        self.pool, self.metrics, self.stop_token_ids = pool, metrics, list(stop_token_ids)
        self.decode = decode
        self.arrived = arrived if arrived is not None else time.perf_counter()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.choices = [_Choice(job, ChoiceText(decode, job.prompt_ids, job.stops, job.min_tokens, job.include_stop,
                                                job.lines),
                                parser=job.tools.parser() if job.tools else None,
                                trail=LogprobTrail(() if job.ends_listed else
                                                   self.stop_token_ids if unlisted is None else unlisted)
                                if job.logprobs is not None else None)
                        for job in jobs]
        self.open = len(self.choices)

    def start(self) -> Generation:
        for c in self.choices:
            self.metrics.waiting.inc()
            c.task = asyncio.ensure_future(self._run(c))
        return self

    async def next(self) -> Event | None:
        """The next event; None once every choice has ended."""
        if self.open == 0 and self.events.empty():
            return None
        ev = await self.events.get()
        if isinstance(ev, (Done, Failed)):
            self.open -= 1
        return ev

    def cancel(self) -> None:
        """Stop every choice still running now (synchronous: callable while being cancelled)."""
        for c in self.choices:
            if c.task is not None and not c.task.done():
                c.cut = True
                c.task.cancel()

    async def _run(self, c: _Choice) -> None:
        job, m = c.job, self.metrics
        reason = "abort"
        try:
            # (max_tokens 0, the prompt alone: the fleet makes one token, which is not returned)
            res = await self.pool.generate(job.prompt_ids, max_new_tokens=max(1, job.max_tokens), sampling=job.sampling,
                                           stop_token_ids=self.stop_token_ids, on_tokens=lambda t: self._on_tokens(c, t),
                                           session_group=job.group, grammar=job.grammar, logprobs=job.logprobs,
                                           on_logprobs=c.trail.add if c.trail is not None else None,
                                           prompt_logprobs=job.prompt_logprobs,
                                           on_prompt_logprobs=lambda rows: setattr(c, "prompt_rows", rows),
                                           min_tokens=job.min_tokens, prediction=job.prediction)
            reason = self._finish(c, res)
        except asyncio.CancelledError:
            if c.stopped:  # our own cut at a stop string or a call: a normal end
                reason = self._finish(c, None)
            elif not c.cut:
                raise
        except Exception as exc:  # noqa: BLE001  (every failure becomes the choice's typed error)
            self.events.put_nowait(Failed(job.index, to_api_error(exc)))
        finally:
            if c.first_at is None:
                m.waiting.dec()
            else:
                m.running.dec()
            m.success.labels(finished_reason=reason).inc()
            m.e2e.observe(time.perf_counter() - self.arrived)

    def _on_tokens(self, c: _Choice, tokens: list[int]) -> None:
        now, m = time.perf_counter(), self.metrics
        if c.first_at is None:
            c.first_at = now
            m.ttft.observe(now - self.arrived)
            m.waiting.dec()
            m.running.inc()
            rest = len(tokens) - 1
        else:
            rest = len(tokens)
        if rest > 0 and c.last_at is not None:
            per = (now - c.last_at) / rest
            for _ in range(rest):
                m.itl.observe(per)
        c.last_at = now
        self._echo(c)
        if c.job.max_tokens == 0:
            return
        c.tokens += len(tokens)
        c.streamed.extend(tokens)
        m.generation_tokens.inc(len(tokens))
        delta, calls = c.push(tokens)
        released = self._released(c)
        if delta or calls or released:
            self.events.put_nowait(Delta(c.job.index, delta, calls, released))
        if c.stopped and c.task is not None and not c.cut:
            c.cut = True
            c.task.cancel()  # ends the session on the orchestrator and the workers (Cancel)

    def _echo(self, c: _Choice) -> None:
        """The prompt's text before the choice's first (echo), with its tokens' log-probabilities
        (asked for: the fleet sends them before the first tokens)."""
        if c.job.echo is None or c.echoed:
            return
        c.echoed = True
        entries: tuple[TokenLogprob, ...] = ()
        if c.job.prompt_logprobs is not None:
            if c.prompt_rows is None:
                raise RuntimeError("the fleet sent no log-probabilities for the prompt")
            _, spans = ChoiceText(self.decode, (), ()).push_each(c.job.prompt_ids)
            entries = prompt_entries(c.job.prompt_ids, c.prompt_rows, spans)
        self.events.put_nowait(Delta(c.job.index, c.job.echo, (), entries))

    @staticmethod
    def _released(c: _Choice, end: bool = False) -> tuple[TokenLogprob, ...]:
        if c.trail is None:
            return ()
        out = c.trail.finish(c.text.length) if end or c.text.stopped else c.trail.release(c.text.emitted)
        if c.job.echo:  # the answer's text begins after the prompt's
            return tuple(dataclasses.replace(e, offset=e.offset + len(c.job.echo)) for e in out)
        return tuple(out)

    def _finish(self, c: _Choice, res: GenerationResult | None) -> str:
        if res is not None and len(res.token_ids) > len(c.streamed):  # tokens that came only with the end
            if c.trail is not None and res.logprobs is not None:
                c.trail.add(res.logprobs[len(c.streamed):])
            self._on_tokens(c, res.token_ids[len(c.streamed):])
        self._echo(c)
        stopped = c.stopped
        tail, calls = c.finish()
        released = self._released(c, end=True)
        reason = "stop" if stopped or res is None else res.finish_reason
        if c.job.max_tokens == 0:
            reason = "length"
        if reason == "stop" and c.parser is not None and c.parser.calls:
            reason = "tool_calls"
        spec = speculative_figures(res, c.first_at - self.arrived if c.first_at is not None else None)
        self.metrics.prompt_tokens.inc(len(c.job.prompt_ids))
        prediction = None
        if c.job.prediction:
            took = followed(c.job.prediction, c.streamed)
            prediction = (took, len(c.job.prediction) - took)
        matcher = c.text.matcher
        self.events.put_nowait(Done(c.job.index, tail, reason, c.job.prompt_index, len(c.job.prompt_ids), c.tokens, spec,
                                    res.cached_tokens if res is not None else 0, calls, released, prediction,
                                    matcher.word, matcher.limited))
        return reason


def speculative_figures(res: GenerationResult | None, ttft_s: float | None) -> dict:
    """The extension field of a choice: how speculation went for its session."""
    if res is None:  # cut at a stop string before the session's summary arrived
        return {"rounds": None, "drafted_tokens": None, "accepted_tokens": None, "mean_accepted_length": None,
                "time_to_first_token_s": ttft_s, "resumes": 0}
    return {"rounds": res.rounds, "drafted_tokens": res.drafted_tokens, "accepted_tokens": res.accepted_tokens,
            "mean_accepted_length": round(res.mean_accepted, 4), "time_to_first_token_s": ttft_s,
            "resumes": res.resumes}


def to_api_error(exc: BaseException) -> ApiError:
    """A generation's failure as the HTTP error a client expects."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, GenerationError):
        code, msg = exc.reply.code, exc.reply.message
        if code == ErrorCode.OVERLOADED:
            return ApiError(429, f"the fleet is at capacity, retry later: {msg}", type="rate_limit_error",
                            code="rate_limit_exceeded", headers={"Retry-After": "1"})
        if code == ErrorCode.BAD_REQUEST:
            ctx = "limit is" in msg
            return ApiError(400, msg, param="max_tokens" if ctx else None,
                            code="context_length_exceeded" if ctx else None)
        return ApiError(503, f"the fleet could not serve the request: {code.value}: {msg}", type="server_error",
                        code="service_unavailable")
    if isinstance(exc, (NoOrchestrator, OrchestratorRefused)):
        return ApiError(503, f"no orchestrator answered: {exc}", type="server_error", code="service_unavailable")
    if isinstance(exc, TimeoutError):
        return ApiError(504, "the generation timed out", type="server_error", code="timeout")
    return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")
