"""One actor (coroutine) per session: its rounds (``rounds``: plan -> propose -> verify -> commit
and emit -> learn) over two RPC clients, with recovery.

Recovery is one rule: a worker without the session answers CACHE_MISS and the actor resends with
the full committed context (``CacheSync(0, committed[:-1])``). Timeouts, NO_WORKER, INTERNAL and
OVERLOADED are retried with exponential back-off (a timed-out or dead worker's state is unknown,
so the context is resent in full). A lost router (``RpcRouterLost``: its connection dropped, or it
was silent and answers again) is resent at once with the full context. Neither CACHE_MISS nor a
lost router uses up a session's attempts. Every wait has a timeout. No torch here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import structlog

from schemas import (
    MAX_TREE_DEPTH, EndSession, ErrorCode, ErrorReply, FlatTree, GenerateDone, GenerateRequest, Message,
    Logprobs, SamplingSpec, SpecPVSpec, TokenChunk, TreeSpec, VerifyReply, VerifyRequest,
)
from specsplit.logs import get_logger
from specsplit.orchestrator import rounds
from specsplit.orchestrator.costmodel import CostModel
from specsplit.orchestrator.ngrams import NgramCache
from specsplit.orchestrator.state import RoundStats, SessionCursor
from specsplit.proposers import Shared
from specsplit.proposers.base import instantiate, resolve
from specsplit.transport.rpc import RpcError, RpcRouterLost, RpcTimeout

RESET_ON = {ErrorCode.NO_WORKER, ErrorCode.INTERNAL}
FREE_RESENDS = 64  # CACHE_MISS / router-lost resends per request that do not count as attempts


class SessionFailed(Exception):
    """A session cannot continue (non-retryable error, or retries exhausted)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INTERNAL):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ActorPolicy:
    tree: TreeSpec
    rpc_timeout_s: float = 60.0
    rpc_timeout_per_token_s: float = 0.05  # more per token a request brings the cache (a prefill)
    max_attempts: int = 8
    backoff_s: float = 0.05
    backoff_max_s: float = 2.0
    # greedy sessions: hang up to this many prompt-lookup tokens (continuations of an earlier
    # occurrence of the context's last >= lookup_min_ngram tokens) under each tree's root; 0: off
    lookup_max_tokens: int = 0
    lookup_min_ngram: int = 3
    grow: bool = False  # greedy sessions: the draft grows its tree while the target verifies
    grow_fraction: float = 0.9  # of the previous round's verify time
    grow_width: int = 4
    grow_chains: bool = True  # growth is told the chain proposers' nodes (specsplit.orchestrator.hints)
    grow_reroot: bool = True  # re-root the grown tree here (GrowReply.tree): no draft round trip then
    specpv: SpecPVSpec | None = None  # the fleet's default for requests without their own (None: off)
    # no draft worker: every round is plain (its root, plus prompt-lookup nodes when greedy)
    lookup_only: bool = False
    # the proposers by name, in order (specsplit.proposers); None: from the fields above
    proposers: tuple[str, ...] | None = None
    draft_grammar: bool = False  # grammar sessions: the draft is sent the grammar, to mask its proposals
    overlap_prefill: bool = False  # round 0 verifies its root while the draft forwards the prompt (rounds.plan)
    overlap_prefill_max_tokens: int = 0  # ... when the target forwards at most this many tokens (0: any)

    def timeout_for(self, req) -> float:
        """Seconds a worker request may take: ``rpc_timeout_s``, and ``rpc_timeout_per_token_s``
        more per token its sync appends to the session's cache (a long prompt's prefill takes
        minutes on a CPU; docs/results.md)."""
        sync = getattr(req, "sync", None)
        return self.rpc_timeout_s + self.rpc_timeout_per_token_s * (len(sync.append_token_ids) if sync else 0)

    def proposer_names(self, ngrams: bool = False) -> tuple[str, ...]:
        """The proposers the fleet runs: the draft model unless ``lookup_only``, then the tokens a
        grammar forces, a request's predicted output, prompt lookup and (``ngrams``: an n-gram
        cache is kept) the cache when lookup tokens are on."""
        if self.proposers is not None:
            return self.proposers
        names = [] if self.lookup_only else ["draft"]
        if self.lookup_max_tokens > 0:  # "grammar" and "prediction" propose only in sessions with one
            names += ["grammar", "prediction", "lookup", *(["ngrams"] if ngrams else [])]
        return tuple(names)


@dataclass
class _Sent:
    """A round's candidates and the work that waits for its verify request to leave."""

    cands: object
    run: Callable[[], object]
    ran: bool = False
    dropped: bool = False  # the session ended first: no growth is asked for

    def result(self):
        return self.run()


class SessionActor:
    """Runs one GenerateRequest to completion; ``emit`` streams TokenChunk/GenerateDone."""

    def __init__(self, req: GenerateRequest, draft_rpc, target_rpc, policy: ActorPolicy,
                 emit: Callable[[Message], None], cost: CostModel | None = None, *, metrics=None,
                 queued_s: float = 0.0, ngrams: NgramCache | None = None, shared: Shared | None = None,
                 trace=None):
        self.req, self.draft_rpc, self.target_rpc = req, draft_rpc, target_rpc
        self.policy, self.emit = policy, emit
        self.sid = req.session_id
        self.tree = req.tree or policy.tree
        self.sampling: SamplingSpec = req.sampling
        # a grammar, penalties (both on the output: the target is told where it begins) and logprobs
        # are verified against the full cache: their sessions run without SpecPV
        self.on_output = req.grammar is not None or req.sampling.penalized
        scored = req.prompt_logprobs is not None
        full = (self.on_output or scored or req.logprobs is not None or req.sampling.processed
                or req.min_tokens > 0)
        self.specpv: SpecPVSpec | None = None if full else req.specpv or policy.specpv
        self.exact = self.specpv is not None and self.specpv.exact
        # a resumed session: its output (which the grammar holds, or the penalties count) began
        # before this prompt's end (and the prompt's log-probabilities end there)
        self.cur = SessionCursor(list(req.prompt_token_ids),
                                 prompt_len=req.output_from if (self.on_output or scored) and req.output_from else -1)
        # the prompt's log-probabilities (asked for): the target's reply to the request that
        # forwards the prompt from an empty cache; they go out with the first chunk
        self._prompt_due = scored and req.prompt_len >= 2
        self._prompt_rows: Logprobs | None = Logprobs(token=[], top_ids=[], top=[]) if scored and \
            not self._prompt_due else None
        self.stats = RoundStats()
        self.out: list[int] = []
        self.cost = cost  # the orchestrator's cost model (tree budget per round), or None: fixed trees
        # the proposers of this session (specsplit.proposers), sharing the orchestrator's resources
        # (``shared``: its n-gram cache...; else one from ``ngrams``)
        if shared is None:
            shared = Shared(policy=policy, resources={"ngrams": ngrams} if ngrams is not None else {})
        self.proposers = instantiate(resolve(policy.proposer_names("ngrams" in shared.resources)), self, shared)
        self.trace = trace  # the orchestrator's round-trace writer, or None
        self.predicted_tokens = self.predicted_ms = 0.0  # what the cost model expected of its choices
        self._attempts = 0
        self._drafting = False  # counted in the cost model's ``speculating`` (``_set_drafting``)
        # specsplit.metrics.OrchestratorMetrics (the orchestrator's, shared by its sessions) or None
        self.metrics = metrics
        self.queued_s = queued_s  # time the session waited for admission before this actor ran
        self.first_token_ms: float | None = None  # from the request's arrival (queueing included)
        self.cached_tokens: int | None = None  # of the prompt, from the target's prefix cache (its first reply)
        self._t0 = time.perf_counter()
        self.log = get_logger("specsplit.orchestrator")
        self._sent: _Sent | None = None  # the round whose verify is under way (``_once_sent``)
        self._later: Callable[[], None] | None = None  # the last round's trace and log lines, not yet written
        self._scheduled: Callable[[], None] | None = None  # ... handed to the loop (``_run_scheduled``)

    async def run(self) -> GenerateDone:
        t0 = self._t0 = time.perf_counter()
        finish, failure = "error", None
        structlog.contextvars.bind_contextvars(session_id=self.sid)
        if self.cost is not None:
            self.cost.active_sessions += 1  # the load plain decoding is priced at (CostModel.plain_pays)
        try:
            finish = await self._rounds()
        except asyncio.CancelledError:
            finish = "cancelled"
            raise
        except SessionFailed as exc:
            failure = exc
            self.log.warning("session_failed", error=str(exc), code=exc.code.value)
        finally:
            self._set_drafting(False)
            if self.cost is not None:
                self.cost.active_sessions -= 1
            done = GenerateDone(
                session_id=self.sid, token_ids=self.out, finish_reason=finish, rounds=self.stats.rounds,
                drafted_tokens=self.stats.drafted, accepted_tokens=self.stats.accepted,
                elapsed_ms=(time.perf_counter() - t0) * 1e3,
                predicted_tok_s=(1e3 * self.predicted_tokens / self.predicted_ms) if self.predicted_ms else 0.0,
                first_token_ms=self.first_token_ms,
                accepted_per_pos=self.stats.accepted_per_depth[:MAX_TREE_DEPTH],  # a tree is never deeper
                cached_tokens=min(self.cached_tokens or 0, len(self.req.prompt_token_ids)),
            )
            if self.metrics is not None:
                self.metrics.session_done(done)
            for p in self.proposers:
                p.finish(self.req.prompt_token_ids, self.out)
            if failure is not None:  # the producer gets the typed error instead of a done
                self.emit(ErrorReply.of(failure.code, str(failure), session_id=self.sid, retryable=False))
            else:
                self.emit(done)
            for p in self.proposers:
                p.close()
            if self.trace is not None:
                self.trace.session(self, done)
            await asyncio.shield(self._end_sessions())
            structlog.contextvars.unbind_contextvars("session_id", "round")
        return done

    async def _rounds(self) -> str:
        """plan -> propose -> verify -> commit and emit -> learn, until the generation ends
        (``specsplit.orchestrator.rounds``). What the round's wait need not hold runs once its
        verify request is sent (``_once_sent``): the proposers told what goes to the target (the
        draft's growth request), the previous round's trace line and log line."""
        try:
            return await self._round_loop()
        finally:
            self._flush()

    async def _round_loop(self) -> str:
        stop = set(self.req.stop_token_ids)
        prompt_len = len(self.req.prompt_token_ids)
        rnd = 0
        while True:
            structlog.contextvars.bind_contextvars(round=rnd)
            t_round = time.perf_counter()
            horizon, sampling = self._round_sampling(prompt_len)
            rp = rounds.plan(rnd, self.cur, self.out, prompt_len=prompt_len, max_new_tokens=horizon,
                             stop=stop, tree=self.tree, sampling=sampling, exact=self.exact,
                             proposers=self.proposers, cost=self.cost, overlap=self.policy.overlap_prefill,
                             overlap_max_tokens=self.policy.overlap_prefill_max_tokens)
            # a draft beside the verify (the first round's overlap) counts too: under load one
            # session at a time drafts until speculation is measured (CostModel.plain_pays)
            self._set_drafting(any(p.model_cost for p in (*rp.proposers, *rp.ahead)))
            t_propose = time.perf_counter()
            cands = await rounds.propose(rp, self.cur.committed, sampling,
                                         chain_tokens=self.policy.lookup_max_tokens, cost=self.cost)
            t_verify = time.perf_counter()
            timing = rounds.Timing(propose_ms=(t_verify - t_propose) * 1e3)
            sent = self._once_sent(rp, cands)
            reply = await self._verify(rnd, cands.tree, rp.confirm, sampling)
            timing.verify_ms, timing.verify_rpc_ms = reply.verify_ms, (time.perf_counter() - t_verify) * 1e3
            cands = sent.result()
            if cands.drafted is not None:
                timing.draft_ms, timing.grow_ms = cands.drafted.draft_ms, cands.drafted.grow_ms
                self.stats.reused_rounds += cands.drafted.reused > 0
                if cands.drafted.reused > 0 and self.metrics is not None:
                    self.metrics.observe_reroot(cands.drafted.rerooted_here)
            clean = rounds.is_clean(rnd, self._attempts, rp.sync_tokens, reply)
            got = rounds.commit(self.cur, self.out, self.stats, cands.tree, reply, prompt_len=prompt_len,
                                max_new_tokens=self.req.max_new_tokens, stop=stop, exact=self.exact)
            if got.stream is not None:
                self._first_token(len(got.stream))
                rows, self._prompt_rows = self._prompt_rows, None
                self.emit(TokenChunk(session_id=self.sid, round=rnd, token_ids=got.stream,
                                     accepted=len(reply.accepted_token_ids), logprobs=self._logprobs(reply, got),
                                     prompt_logprobs=rows))
            timing.wall_ms = (time.perf_counter() - t_round) * 1e3
            if self.metrics is not None:
                self.metrics.observe_round(got.count, self.cur.rolled_back, timing.wall_ms / 1e3)
                if cached := cands.cached:
                    self.metrics.observe_cache(len(cached), len(cached.keys() & set(reply.accepted_nodes)))
            tokens, ms = rounds.learn(self.cost, self.proposers, rp, cands, reply, got.new, timing, clean=clean)
            self.predicted_tokens += tokens
            self.predicted_ms += ms
            self._set_drafting(False)
            self._later = partial(self._record_round, rp, cands, reply, timing, clean, rnd)
            if got.done:
                return "stop" if self.out[-1] in stop else "length"
            rnd += 1

    def _round_sampling(self, prompt_len: int) -> tuple[int, SamplingSpec]:
        """The round's token horizon and sampling: while the answer is shorter than its
        ``min_tokens``, the round makes none past them and its stop tokens are masked (the
        target never chooses them, the draft never proposes them); then the request's own."""
        produced = self.cur.produced(prompt_len)
        if produced >= self.req.min_tokens or not self.req.stop_token_ids:
            return self.req.max_new_tokens, self.sampling
        masked = sorted(set(self.sampling.masked_token_ids or ()) | set(self.req.stop_token_ids))
        return self.req.min_tokens, self.sampling.model_copy(update={"masked_token_ids": masked})

    def _logprobs(self, reply: VerifyReply, got: rounds.Committed) -> Logprobs | None:
        """The log-probabilities of the tokens this round streams (asked for): without SpecPV
        those tokens begin the ones it committed, whose log-probabilities the target reported."""
        if self.req.logprobs is None:
            return None
        if reply.logprobs is None or len(reply.logprobs) != len(got.new) or got.stream != got.new[:len(got.stream)]:
            raise SessionFailed("the target reported no log-probabilities for the committed tokens "
                                "(a target that predates them?)")
        return reply.logprobs[:len(got.stream)]

    def _once_sent(self, rp: rounds.RoundPlan, cands: rounds.Candidates) -> _Sent:
        """Runs ``rounds.verifying`` right after the verify request leaves (a loop callback: the
        actor's send happens before it next yields), then, after the growth request it makes has
        left too, the last round's record; ``result()``: the candidates with the growth asked for
        (run then if not yet)."""
        later, self._later = self._later, None
        loop = asyncio.get_running_loop()

        def run() -> rounds.Candidates:
            if not sent.ran:
                sent.ran = True
                if not sent.dropped:
                    sent.cands = rounds.verifying(rp, cands, self.sampling, self.cost)
                if later is not None:  # behind the growth request's first step (FIFO)
                    self._scheduled = later
                    loop.call_soon(self._run_scheduled)
            return sent.cands

        sent = self._sent = _Sent(cands, run)
        loop.call_soon(run)
        return sent

    def _run_scheduled(self) -> None:
        later, self._scheduled = self._scheduled, None
        if later is not None:
            later()

    def _flush(self) -> None:
        """The session is over (or failed): what waited for a send runs now, growth excepted."""
        self._run_scheduled()
        if self._sent is not None:
            self._sent.dropped = True
            self._sent.run()
            self._sent = None
        self._run_scheduled()
        if self._later is not None:
            later, self._later = self._later, None
            later()

    def _record_round(self, rp: rounds.RoundPlan, cands: rounds.Candidates, reply: VerifyReply,
                      timing: rounds.Timing, clean: bool, rnd: int) -> None:
        if self.trace is not None:
            self.trace.round(self, rp, cands, reply, timing, clean)
        self._log_round(rp, cands, reply, timing, rnd)

    def _log_round(self, rp: rounds.RoundPlan, cands: rounds.Candidates, reply: VerifyReply,
                   timing: rounds.Timing, rnd: int) -> None:
        drafted = cands.drafted
        self.log.info("round_done", round=rnd, accepted=len(reply.accepted_token_ids), drafted=cands.tree.num_nodes - 1,
                      tree_nodes=cands.tree.num_nodes, plain=rp.plain, batch_size=reply.batch_size,
                      batch_tokens=reply.batch_tokens,
                      draft_ms=round(timing.draft_ms, 2), verify_ms=round(timing.verify_ms, 2),
                      transport_ms=round(max(0.0, timing.wall_ms - timing.draft_ms - timing.verify_ms), 2),
                      draft_reused=drafted.reused if drafted else 0, min_path_prob=rp.spec.min_path_prob,
                      # what the cost model expected of this round (predicted_tok_s, per round)
                      **({"expected_tokens": round(cands.choice.expected_tokens, 2),
                          "expected_ms": round(cands.choice.expected_ms, 1)} if cands.choice else {}),
                      **({"partial": reply.partial, "rolled_back": self.cur.rolled_back,
                          "provisional": self.cur.provisional} if self.specpv else {}))

    def _first_token(self, new_tokens: int) -> None:
        """Count streamed tokens; the first ones fix the time to first token."""
        if new_tokens <= 0:
            return
        if self.first_token_ms is None:
            self.first_token_ms = self.queued_s * 1e3 + (time.perf_counter() - self._t0) * 1e3
            if self.metrics is not None:
                self.metrics.first_token(self.first_token_ms / 1e3)
        if self.metrics is not None:
            self.metrics.generated.inc(new_tokens)

    def _set_drafting(self, on: bool) -> None:
        """Count this session among the cost model's ``speculating`` ones while a drafted round
        is under way (its draft call to its verdict)."""
        if self.cost is not None and on != self._drafting:
            self.cost.speculating += 1 if on else -1
        self._drafting = on

    # ---- one request each, with recovery --------------------------------------------------
    async def _verify(self, rnd: int, tree: FlatTree, confirm: bool = False,
                      sampling: SamplingSpec | None = None) -> VerifyReply:
        def build():
            sync = self.cur.target_sync(self.on_output)
            return VerifyRequest(session_id=self.sid, round=rnd, sync=sync, tree=tree, sampling=sampling or self.sampling,
                                 specpv=self.specpv, confirm=confirm, confirmed_len=self.cur.confirmed if self.exact else None,
                                 grammar=self.req.grammar, logprobs=self.req.logprobs,
                                 prompt_logprobs=self.req.prompt_logprobs if self._prompt_due and not sync.base_len
                                 else None)

        reply = await self.call(self.target_rpc, build, self._reset_target)
        if self.cached_tokens is None and isinstance(reply, VerifyReply):
            self.cached_tokens = reply.cached_tokens
        if self._prompt_due and isinstance(reply, VerifyReply):  # (the prompt went from an empty cache)
            rows = reply.prompt_logprobs
            if rows is None or len(rows) != self.req.prompt_len - 1:
                raise SessionFailed("the target reported no log-probabilities for the prompt "
                                    "(a target that predates them, or one that cannot)")
            self._prompt_rows, self._prompt_due = rows, False
        return reply

    def _reset_target(self) -> None:
        self.cur.target_len = 0

    async def call(self, rpc, build: Callable[[], Message], reset: Callable[[], None]) -> Message:
        """One request with recovery. CACHE_MISS and a lost router are resent at once and do not
        use up attempts (up to FREE_RESENDS each: a session survives any number of ordinary
        crashes, but never loops forever); timeouts and retryable errors back off and count."""
        p = self.policy
        delay, last = p.backoff_s, "no attempt"
        attempts = misses = losses = 0
        service = "draft" if rpc is self.draft_rpc else "target"
        while True:
            self._attempts = attempts + misses + losses + 1  # 1: the first send (a clean cost sample)
            t_call = time.perf_counter()
            try:
                req = build()
                reply = await rpc.call(req, session_id=self.sid, timeout_s=p.timeout_for(req))
            except RpcTimeout:
                last = "timeout"
                reset()
                self._rpc_failed(service, "timeout")
            except RpcRouterLost as exc:  # its worker may still hold the session: CACHE_MISS otherwise
                last, losses = f"router lost: {exc}", losses + 1
                reset()
                self._rpc_failed(service, "router_lost")
                if losses <= FREE_RESENDS:
                    self.log.info("request_resent", reason="router_lost", resends=losses)
                    continue
            except RpcError as exc:
                raise SessionFailed(f"transport closed: {exc}", ErrorCode.INTERNAL) from exc
            else:
                if self.metrics is not None:
                    self.metrics.observe_rpc(service, time.perf_counter() - t_call)
                if not isinstance(reply, ErrorReply):
                    return reply
                self._rpc_failed(service, reply.code.value)
                last = f"{reply.code.value}: {reply.message}"
                if reply.code == ErrorCode.CACHE_MISS:
                    reset()
                    misses += 1
                    if misses <= FREE_RESENDS:
                        self.log.info("request_resent", reason="cache_miss", resends=misses)
                        continue  # resend at once with the full context (PROTOCOL.md)
                elif not reply.retryable:
                    raise SessionFailed(last, reply.code)
                elif reply.code in RESET_ON:
                    reset()
            attempts += 1
            if attempts >= p.max_attempts:
                raise SessionFailed(f"gave up after {p.max_attempts} attempts: {last}", ErrorCode.NO_WORKER)
            self.log.info("request_retry", attempt=attempts, reason=last, delay_s=round(delay, 3))
            await asyncio.sleep(delay)
            delay = min(delay * 2, p.backoff_max_s)

    def _rpc_failed(self, service: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rpc_failed(service, reason)

    async def _end_sessions(self) -> None:
        msg = EndSession(session_id=self.sid)
        uses_draft = any(p.kind == "tree" for p in self.proposers)
        rpcs = (self.draft_rpc, self.target_rpc) if uses_draft else (self.target_rpc,)
        calls = [rpc.call(msg, session_id=self.sid, timeout_s=2.0) for rpc in rpcs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, Exception) and not isinstance(r, (RpcError, asyncio.CancelledError)):
                self.log.warning("end_session_failed", error=repr(r))
