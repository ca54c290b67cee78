"""One actor (coroutine) per session: draft -> verify rounds over two RPC clients, with recovery.

Recovery is one rule: a worker without the session answers CACHE_MISS and the actor resends with
the full committed context (``CacheSync(0, committed[:-1])``). Timeouts, NO_WORKER, INTERNAL and
OVERLOADED are retried with exponential back-off (a timed-out or dead worker's state is unknown,
so the context is resent in full). Every wait has a timeout. No torch here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import structlog

from schemas import (
    CacheSync, DraftReply, DraftRequest, EndSession, ErrorCode, ErrorReply, FlatTree, GenerateDone, GenerateRequest, GrowRequest, Message,
    SamplingSpec, TokenChunk, TreeSpec, VerifyReply, VerifyRequest,
)
from specsplit.logs import get_logger
from specsplit.orchestrator.state import RoundStats, SessionCursor, accept_new, best_path, remaining_tree
from specsplit.engine.tree import subtree
from specsplit.transport.rpc import RpcError, RpcTimeout

RESET_ON = {ErrorCode.NO_WORKER, ErrorCode.INTERNAL}


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
    request_timeout_s: float = 60.0
    max_attempts: int = 8
    backoff_s: float = 0.05
    backoff_max_s: float = 2.0
    overlap: bool = False
    # overlap drafts ahead only while it pays: the recent hit rate (an EMA) must reach this, else
    # only every overlap_probe_every-th round tries (a missed ahead draft holds the draft worker)
    overlap_min_hit_rate: float = 0.25
    overlap_probe_every: int = 8
    grow: bool = False  # greedy sessions: the draft grows its tree while the target verifies
    grow_fraction: float = 0.9  # of the previous round's verify time
    grow_width: int = 4


@dataclass
class HitRate:
    """An EMA of overlap hits, shared by the sessions of one orchestrator (same models, same
    kind of traffic), so a new session starts from what earlier ones learned. Optimistic at 1.0."""

    rate: float = 1.0
    weight: float = 0.2

    def update(self, hit: bool) -> None:
        self.rate += self.weight * (float(hit) - self.rate)


@dataclass
class _Timing:
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    wall_ms: float = 0.0
    reused: int = 0


class SessionActor:
    """Runs one GenerateRequest to completion; ``emit`` streams TokenChunk/GenerateDone."""

    def __init__(self, req: GenerateRequest, draft_rpc, target_rpc, policy: ActorPolicy,
                 emit: Callable[[Message], None], ahead_hits: HitRate | None = None):
        self.req, self.draft_rpc, self.target_rpc = req, draft_rpc, target_rpc
        self.policy, self.emit = policy, emit
        self.sid = req.session_id
        self.tree = req.tree or policy.tree
        self.sampling: SamplingSpec = req.sampling
        self.cur = SessionCursor(list(req.prompt_token_ids))
        self.stats = RoundStats()
        self.out: list[int] = []
        self._last_verify_ms = 0.0
        self.ahead_hits = ahead_hits if ahead_hits is not None else HitRate()
        self.log = get_logger("specsplit.orchestrator")

    async def run(self) -> GenerateDone:
        t0 = time.perf_counter()
        finish, failure = "error", None
        structlog.contextvars.bind_contextvars(session_id=self.sid)
        try:
            finish = await self._rounds()
        except asyncio.CancelledError:
            finish = "cancelled"
            raise
        except SessionFailed as exc:
            failure = exc
            self.log.warning("session_failed", error=str(exc), code=exc.code.value)
        finally:
            done = GenerateDone(
                session_id=self.sid, token_ids=self.out, finish_reason=finish, rounds=self.stats.rounds,
                drafted_tokens=self.stats.drafted, accepted_tokens=self.stats.accepted,
                elapsed_ms=(time.perf_counter() - t0) * 1e3,
            )
            if failure is not None:  # the producer gets the typed error instead of a done
                self.emit(ErrorReply.of(failure.code, str(failure), session_id=self.sid, retryable=False))
            else:
                self.emit(done)
            await asyncio.shield(self._end_sessions())
            structlog.contextvars.unbind_contextvars("session_id", "round")
        return done

    async def _rounds(self) -> str:
        stop = set(self.req.stop_token_ids)
        rnd, tree = 0, None
        while True:
            structlog.contextvars.bind_contextvars(round=rnd)
            timing = _Timing()
            t_round = time.perf_counter()
            spec = remaining_tree(self.tree, self.req.max_new_tokens - len(self.out))
            if tree is None:
                tree = await self._draft(rnd, spec, timing)
            ahead = self._draft_ahead(rnd, tree, spec) if self._ahead_pays(rnd) else None
            if ahead is None:
                self._grow(rnd)
            reply = await self._verify(rnd, tree, timing)
            self._last_verify_ms = reply.verify_ms
            tree_next = await self._take_ahead(ahead, tree, reply)
            if ahead is not None:
                self.ahead_hits.update(tree_next is not None)
            n_before = len(self.out)
            new = self.cur.apply_verify(reply)
            self.stats.add(tree, reply)
            done = accept_new(self.out, new, self.req.max_new_tokens, stop)
            self.emit(TokenChunk(session_id=self.sid, round=rnd, token_ids=self.out[n_before:],
                                 accepted=len(reply.accepted_token_ids)))
            timing.wall_ms = (time.perf_counter() - t_round) * 1e3
            self.log.info("round_done", accepted=len(reply.accepted_token_ids), drafted=tree.num_nodes - 1,
                          draft_ms=round(timing.draft_ms, 2), verify_ms=round(timing.verify_ms, 2),
                          transport_ms=round(max(0.0, timing.wall_ms - timing.draft_ms - timing.verify_ms), 2),
                          overlap_hit=tree_next is not None, draft_reused=timing.reused)
            if done:
                return "stop" if self.out[-1] in stop else "length"
            rnd += 1
            tree = tree_next

    # ---- one request each, with recovery --------------------------------------------------
    async def _draft(self, rnd: int, spec: TreeSpec, timing: _Timing) -> FlatTree:
        def build():
            return DraftRequest(session_id=self.sid, round=rnd, sync=self.cur.draft_sync(),
                                root=self.cur.committed[-1], tree=spec, sampling=self.sampling)

        reply: DraftReply = await self._call(self.draft_rpc, build, self._reset_draft)
        self.cur.after_draft()
        timing.draft_ms += reply.draft_ms
        timing.reused = reply.reused_nodes
        self.stats.reused_rounds += reply.reused_nodes > 0
        return reply.tree

    def _grow(self, rnd: int) -> None:
        """Let the draft worker grow this round's tree while the target verifies it (fire and
        forget: the next DraftRequest queues behind it on the same worker; failures only cost
        the head start). Needs a previous verify time to size the budget."""
        p = self.policy
        if not (p.grow and self.sampling.greedy and self._last_verify_ms > 0):
            return
        budget = min(60_000.0, p.grow_fraction * self._last_verify_ms)
        req = GrowRequest(session_id=self.sid, round=rnd, budget_ms=budget, width=p.grow_width)
        task = asyncio.ensure_future(self.draft_rpc.call(req, session_id=self.sid, timeout_s=p.request_timeout_s))
        task.add_done_callback(_swallow)

    async def _verify(self, rnd: int, tree: FlatTree, timing: _Timing) -> VerifyReply:
        def build():
            return VerifyRequest(session_id=self.sid, round=rnd, sync=self.cur.target_sync(), tree=tree,
                                 sampling=self.sampling)

        reply: VerifyReply = await self._call(self.target_rpc, build, self._reset_target)
        timing.verify_ms += reply.verify_ms
        return reply

    def _reset_draft(self) -> None:
        self.cur.draft_len = 0

    def _reset_target(self) -> None:
        self.cur.target_len = 0

    async def _call(self, rpc, build: Callable[[], Message], reset: Callable[[], None]) -> Message:
        p = self.policy
        delay, last = p.backoff_s, "no attempt"
        for attempt in range(p.max_attempts):
            try:
                reply = await rpc.call(build(), session_id=self.sid, timeout_s=p.request_timeout_s)
            except RpcTimeout:
                last = "timeout"
                reset()
            except RpcError as exc:
                raise SessionFailed(f"transport closed: {exc}", ErrorCode.INTERNAL) from exc
            else:
                if not isinstance(reply, ErrorReply):
                    return reply
                last = f"{reply.code.value}: {reply.message}"
                if reply.code == ErrorCode.CACHE_MISS:
                    reset()
                    continue  # resend at once with the full context
                if not reply.retryable:
                    raise SessionFailed(last, reply.code)
                if reply.code in RESET_ON:
                    reset()
            self.log.info("request_retry", attempt=attempt + 1, reason=last, delay_s=round(delay, 3))
            await asyncio.sleep(delay)
            delay = min(delay * 2, p.backoff_max_s)
        raise SessionFailed(f"gave up after {p.max_attempts} attempts: {last}", ErrorCode.NO_WORKER)

    # ---- overlap: draft round r+1 while round r is verified ---------------------------------
    def _ahead_pays(self, rnd: int) -> bool:
        p = self.policy
        if not p.overlap:
            return False
        return self.ahead_hits.rate >= p.overlap_min_hit_rate or rnd % max(1, p.overlap_probe_every) == 0

    def _draft_ahead(self, rnd: int, tree: FlatTree, spec: TreeSpec):
        """Assume the best path of ``tree`` is accepted in full and draft from its last node, one
        level deeper, so the subtree under the real bonus token is next round's tree."""
        path = best_path(tree)
        if len(path) < 2 or spec.max_depth < 1:
            return None
        guess = [tree.token_ids[i] for i in path[1:]]
        committed = self.cur.committed
        base = len(committed)
        held = min(self.cur.draft_len, base)
        req = DraftRequest(session_id=self.sid, round=rnd + 1,
                           sync=CacheSync(base_len=held, append_token_ids=committed[held:] + guess[:-1]), root=guess[-1],
                           tree=spec.model_copy(update={"max_nodes": min(256, spec.max_nodes * 2),
                                                        "max_depth": min(64, spec.max_depth + 1)}), sampling=self.sampling)
        task = asyncio.ensure_future(self.draft_rpc.call(req, session_id=self.sid, timeout_s=self.policy.request_timeout_s))
        return path, guess, base, task

    async def _take_ahead(self, ahead, tree: FlatTree, reply: VerifyReply) -> FlatTree | None:
        if ahead is None:
            return None
        path, guess, base, task = ahead
        accepted = reply.accepted_token_ids
        common = 0
        while common < min(len(accepted), len(guess)) and accepted[common] == guess[common]:
            common += 1
        try:
            spec_reply = await task
        except (RpcError, asyncio.TimeoutError):
            self._reset_draft()
            return None
        if not isinstance(spec_reply, DraftReply):
            self._reset_draft()
            return None
        # the draft now holds committed(before) + guess: valid up to the common prefix
        self.cur.draft_len = base + common
        if common != len(guess):
            return None
        spec_tree = spec_reply.tree
        for c in range(1, spec_tree.num_nodes):
            if spec_tree.parents[c] == 0 and spec_tree.token_ids[c] == reply.bonus_token_id:
                self.cur.draft_len = base + len(guess)  # = len(new committed) - 1
                return subtree(spec_tree, c)
        return None

    async def _end_sessions(self) -> None:
        msg = EndSession(session_id=self.sid)
        calls = [rpc.call(msg, session_id=self.sid, timeout_s=2.0) for rpc in (self.draft_rpc, self.target_rpc)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, Exception) and not isinstance(r, (RpcError, asyncio.CancelledError)):
                self.log.warning("end_session_failed", error=repr(r))
