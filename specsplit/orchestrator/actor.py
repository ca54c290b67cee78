"""One actor (coroutine) per session: draft -> verify rounds over two RPC clients, with recovery.

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
from typing import Callable

import structlog

from schemas import (
    MAX_TREE_DEPTH, CacheSync, DraftReply, DraftRequest, EndSession, ErrorCode, ErrorReply, FlatTree, GenerateDone,
    GenerateRequest, GrowRequest, Message, SamplingSpec, SpecPVSpec, TokenChunk, TreeSpec, VerifyReply, VerifyRequest,
)
from specsplit.logs import get_logger
from specsplit.orchestrator.costmodel import SMALL_SYNC, CostModel, expanded_nodes
from specsplit.orchestrator.ngrams import NgramCache
from specsplit.orchestrator.state import Plan, RoundStats, SessionCursor, plan_round, remaining_tree, root_only
from specsplit.transport.rpc import RpcError, RpcRouterLost, RpcTimeout

RESET_ON = {ErrorCode.NO_WORKER, ErrorCode.INTERNAL}
FREE_RESENDS = 64  # CACHE_MISS / router-lost resends per request that do not count as attempts


def _swallow(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a lost grow reply is harmless


class SessionFailed(Exception):
    """A session cannot continue (non-retryable error, or retries exhausted)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INTERNAL):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ActorPolicy:
    tree: TreeSpec
    rpc_timeout_s: float = 60.0
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
    specpv: SpecPVSpec | None = None  # the fleet's default for requests without their own (None: off)
    # no draft worker: every round is plain (its root, plus prompt-lookup nodes when greedy)
    lookup_only: bool = False


@dataclass
class _Timing:
    draft_ms: float = 0.0
    grow_ms: float = 0.0  # the growth budget this round asked the draft worker for
    verify_ms: float = 0.0
    wall_ms: float = 0.0
    reused: int = 0
    drafted: FlatTree | None = None


class SessionActor:
    """Runs one GenerateRequest to completion; ``emit`` streams TokenChunk/GenerateDone."""

    def __init__(self, req: GenerateRequest, draft_rpc, target_rpc, policy: ActorPolicy,
                 emit: Callable[[Message], None], cost: CostModel | None = None, *, metrics=None,
                 queued_s: float = 0.0, ngrams: NgramCache | None = None):
        self.req, self.draft_rpc, self.target_rpc = req, draft_rpc, target_rpc
        self.policy, self.emit = policy, emit
        self.sid = req.session_id
        self.tree = req.tree or policy.tree
        self.sampling: SamplingSpec = req.sampling
        self.specpv: SpecPVSpec | None = req.specpv or policy.specpv
        self.exact = self.specpv is not None and self.specpv.exact
        self.cur = SessionCursor(list(req.prompt_token_ids))
        self.stats = RoundStats()
        self.out: list[int] = []
        self._last_verify_ms = 0.0
        self._grow_task: asyncio.Future | None = None  # the fire-and-forget GrowRequest in flight
        self.cost = cost  # the orchestrator's cost model (tree budget per round), or None: fixed trees
        self.ngrams = ngrams  # the orchestrator's cross-session n-gram cache (lookup candidates), or None
        self.predicted_tokens = self.predicted_ms = 0.0  # what the cost model expected of its choices
        self._attempts = 0
        self._drafting = False  # counted in the cost model's ``speculating`` (``_set_drafting``)
        # specsplit.metrics.OrchestratorMetrics (the orchestrator's, shared by its sessions) or None
        self.metrics = metrics
        self.queued_s = queued_s  # time the session waited for admission before this actor ran
        self.first_token_ms: float | None = None  # from the request's arrival (queueing included)
        self._t0 = time.perf_counter()
        self.log = get_logger("specsplit.orchestrator")

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
            )
            if self.metrics is not None:
                self.metrics.session_done(done)
            if self.ngrams is not None and self.out:  # what later sessions' lookup may propose
                self.ngrams.add(list(self.req.prompt_token_ids[-self.ngrams.max_ngram:]) + self.out)
            if failure is not None:  # the producer gets the typed error instead of a done
                self.emit(ErrorReply.of(failure.code, str(failure), session_id=self.sid, retryable=False))
            else:
                self.emit(done)
            self._cancel_grow()
            await asyncio.shield(self._end_sessions())
            structlog.contextvars.unbind_contextvars("session_id", "round")
        return done

    async def _rounds(self) -> str:
        stop = set(self.req.stop_token_ids)
        rnd = 0
        while True:
            structlog.contextvars.bind_contextvars(round=rnd)
            timing = _Timing()
            t_round = time.perf_counter()
            prompt_len = len(self.req.prompt_token_ids)
            confirm = self.exact and self.cur.must_confirm(self.out, prompt_len, self.req.max_new_tokens, stop)
            spec = remaining_tree(self.tree, self.req.max_new_tokens - self.cur.produced(prompt_len))
            if self.cost is not None and self.sampling.greedy:
                spec = self.cost.draft_spec(spec)  # how deep drafting pays this round
            sync_tokens = len(self.cur.target_sync().append_token_ids)
            plain = self.policy.lookup_only or (self.cost is not None and self.sampling.greedy
                                                 and self.cost.plain_pays())
            if confirm or (plain and not self.sampling.greedy):  # a root-only tree: confirming provisional
                # tokens that would end the generation, or a sampled session decoding plainly (lookup only)
                plan = Plan(root_only(self.cur.committed[-1]), frozenset())
            elif plain:  # no draft call (lookup only, or the load makes plain decoding deliver more:
                # from round 0 on, so a new session under load skips the draft's prompt prefill),
                # the root and whatever prompt-lookup nodes pay for their share of the forward
                plan = plan_round(root_only(self.cur.committed[-1]), self.cur.committed, spec, self.sampling,
                                  cost=self.cost, lookup_max_tokens=self.policy.lookup_max_tokens,
                                  lookup_min_ngram=self.policy.lookup_min_ngram, sync_tokens=sync_tokens,
                                  plain=True, ngrams=self.ngrams)
            else:
                self._set_drafting(True)
                drafted = await self._draft(rnd, spec, timing)
                plan = plan_round(drafted, self.cur.committed, spec, self.sampling, cost=self.cost,
                                  lookup_max_tokens=self.policy.lookup_max_tokens,
                                  lookup_min_ngram=self.policy.lookup_min_ngram, sync_tokens=sync_tokens,
                                  ngrams=self.ngrams)
                self._grow(rnd, timing)
            tree = plan.tree
            reply = await self._verify(rnd, tree, timing, confirm)
            # not a resend, not a prefill, not a partial round (the cost model learns full verify times)
            clean = self._attempts == 1 and sync_tokens <= SMALL_SYNC and not reply.partial
            self._last_verify_ms = reply.verify_ms
            n_before = len(self.out)
            new = self.cur.apply_verify(reply)
            count = self.stats.add(tree, reply, self.cur.rolled_back)
            done = self.cur.take_confirmed(self.out, prompt_len, self.req.max_new_tokens, stop)
            if len(self.out) > n_before or not self.exact:
                self._first_token(len(self.out) - n_before)
                self.emit(TokenChunk(session_id=self.sid, round=rnd, token_ids=self.out[n_before:],
                                     accepted=len(reply.accepted_token_ids)))
            timing.wall_ms = (time.perf_counter() - t_round) * 1e3
            if self.metrics is not None:
                self.metrics.observe_round(count, self.cur.rolled_back, timing.wall_ms / 1e3)
                if plan.cached:
                    self.metrics.observe_cache(len(plan.cached), len(plan.cached.keys() & set(reply.accepted_nodes)))
            self._learn(plan, reply, sync_tokens, timing, clean and rnd > 0, len(new), plain)
            self._set_drafting(False)
            self.log.info("round_done", accepted=len(reply.accepted_token_ids), drafted=tree.num_nodes - 1,
                          tree_nodes=tree.num_nodes, plain=plain, batch_size=reply.batch_size,
                          batch_tokens=reply.batch_tokens,
                          draft_ms=round(timing.draft_ms, 2), verify_ms=round(timing.verify_ms, 2),
                          transport_ms=round(max(0.0, timing.wall_ms - timing.draft_ms - timing.verify_ms), 2),
                          draft_reused=timing.reused, min_path_prob=spec.min_path_prob,
                          # what the cost model expected of this round (predicted_tok_s, per round)
                          **({"expected_tokens": round(plan.choice.expected_tokens, 2),
                              "expected_ms": round(plan.choice.expected_ms, 1)} if plan.choice else {}),
                          **({"partial": reply.partial, "rolled_back": self.cur.rolled_back,
                              "provisional": self.cur.provisional} if self.specpv else {}))
            if done:
                return "stop" if self.out[-1] in stop else "length"
            rnd += 1

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

    def _learn(self, plan, reply: VerifyReply, sync_tokens: int, timing: _Timing, clean: bool, new_tokens: int,
               plain: bool = False) -> None:
        """Feed the cost model (shared by the orchestrator's sessions) and keep its prediction.
        A round the model does not model (the prompt's prefill, a resend) enters the prediction
        with its measured time and tokens, so ``predicted_tok_s`` is end to end like the measured
        rate it is compared with. A plain round teaches the forward's cost, prompt lookup's
        acceptance and what plain rounds deliver, never the speculative rate (``observe_plain``)."""
        if self.cost is None:
            return
        if plan.choice is None:  # a confirmation (root-only): its forward still prices tokens
            if clean:
                self.cost.observe_forward(sync_tokens + plan.tree.num_nodes, reply.verify_ms,
                                          reply.batch_tokens, reply.batch_size)
            return
        if clean and timing.drafted is not None:
            self.cost.observe_speculation(new_tokens, timing.draft_ms + timing.grow_ms, draft_ms=timing.draft_ms,
                                          nodes=plan.tree.num_nodes)
        if clean:
            self.predicted_tokens += plan.choice.expected_tokens
            self.predicted_ms += plan.choice.expected_ms
        else:
            self.predicted_tokens += new_tokens
            self.predicted_ms += timing.wall_ms
        self.cost.observe_round(plan.tree, reply.accepted_nodes, set(plan.lookup), plan.cached)
        if clean:
            self.cost.observe_forward(sync_tokens + plan.tree.num_nodes, reply.verify_ms,
                                      reply.batch_tokens, reply.batch_size)
            if plain:  # root and lookup nodes, no draft call
                self.cost.observe_plain(new_tokens, timing.wall_ms - reply.verify_ms)
                return
            self.cost.observe_overhead(max(0.0, timing.wall_ms - reply.verify_ms))
            self.cost.observe_rate(new_tokens, timing.wall_ms)
            if timing.reused == 0 and timing.drafted is not None:
                self.cost.observe_draft(expanded_nodes(timing.drafted), timing.draft_ms)

    # ---- one request each, with recovery --------------------------------------------------
    async def _draft(self, rnd: int, spec: TreeSpec, timing: _Timing) -> FlatTree:
        def build():
            return DraftRequest(session_id=self.sid, round=rnd, sync=self.cur.draft_sync(),
                                root=self.cur.committed[-1], tree=spec, sampling=self.sampling)

        reply: DraftReply = await self._call(self.draft_rpc, build, self._reset_draft)
        self.cur.after_draft()
        timing.draft_ms += reply.draft_ms
        timing.reused = reply.reused_nodes
        timing.drafted = reply.tree
        self.stats.reused_rounds += reply.reused_nodes > 0
        return reply.tree

    def _grow(self, rnd: int, timing: _Timing) -> None:
        """Let the draft worker grow this round's tree while the target verifies it (fire and
        forget: the next DraftRequest queues behind it on the same worker; failures only cost
        the head start). Needs a previous verify time to size the budget."""
        p = self.policy
        if not (p.grow and self.sampling.greedy and self._last_verify_ms > 0):
            return
        budget = min(60_000.0, p.grow_fraction * self._last_verify_ms)
        timing.grow_ms = budget
        req = GrowRequest(session_id=self.sid, round=rnd, budget_ms=budget, width=p.grow_width)
        self._cancel_grow()  # the previous round's grow has answered or is moot
        task = asyncio.ensure_future(self.draft_rpc.call(req, session_id=self.sid, timeout_s=p.rpc_timeout_s))
        task.add_done_callback(_swallow)
        self._grow_task = task  # a reference, so it is neither collected nor left behind

    def _cancel_grow(self) -> None:
        if self._grow_task is not None and not self._grow_task.done():
            self._grow_task.cancel()
        self._grow_task = None

    async def _verify(self, rnd: int, tree: FlatTree, timing: _Timing, confirm: bool = False) -> VerifyReply:
        def build():
            return VerifyRequest(session_id=self.sid, round=rnd, sync=self.cur.target_sync(), tree=tree,
                                 sampling=self.sampling, specpv=self.specpv, confirm=confirm,
                                 confirmed_len=self.cur.confirmed if self.exact else None)

        reply: VerifyReply = await self._call(self.target_rpc, build, self._reset_target)
        timing.verify_ms += reply.verify_ms
        return reply

    def _reset_draft(self) -> None:
        self.cur.draft_len = 0

    def _reset_target(self) -> None:
        self.cur.target_len = 0

    async def _call(self, rpc, build: Callable[[], Message], reset: Callable[[], None]) -> Message:
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
                reply = await rpc.call(build(), session_id=self.sid, timeout_s=p.rpc_timeout_s)
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
        rpcs = (self.target_rpc,) if self.policy.lookup_only else (self.draft_rpc, self.target_rpc)
        calls = [rpc.call(msg, session_id=self.sid, timeout_s=2.0) for rpc in rpcs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, Exception) and not isinstance(r, (RpcError, asyncio.CancelledError)):
                self.log.warning("end_session_failed", error=repr(r))
