"""The orchestrator process: one asyncio loop, a ROUTER frontend for producers, one RPC client
per service, one SessionActor task per session. Never imports torch.

Producer frames (DEALER): [PROTO, kind, session_id, request_id, body]. GENERATE_REQUEST starts a
session; TOKEN_CHUNK replies stream its tokens and GENERATE_DONE ends it (same request_id).
CANCEL stops it; HEARTBEAT is answered (readiness by handshake). Anything else, or anything
malformed, gets a typed ErrorReply and changes nothing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import zmq
import zmq.asyncio

from brokers.curve import release_zap
from schemas import (
    PROTO, Cancel, CodecError, ErrorCode, ErrorReply, GenerateDone, GenerateRequest, Heartbeat, Message, pack_frames,
    unpack_frames,
)
from specsplit.config import OrchestratorSettings
from specsplit.logs import get_logger
from specsplit.metrics import OrchestratorMetrics
from specsplit.orchestrator.actor import ActorPolicy, SessionActor
from specsplit.orchestrator.admission import Admission
from specsplit.orchestrator.costmodel import CostModel
from specsplit.orchestrator.ngrams import NgramCache
from specsplit.orchestrator.trace import TraceWriter
from specsplit.proposers.base import build_shared, resolve
from specsplit.transport.rpc import AsyncRpcClient
from specsplit.transport.sockets import make_socket


class Orchestrator:
    def __init__(self, settings: OrchestratorSettings, ctx: zmq.asyncio.Context | None = None):
        self.settings = settings
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.policy = ActorPolicy(
            tree=settings.tree(), rpc_timeout_s=settings.rpc_timeout_s,
            rpc_timeout_per_token_s=settings.rpc_timeout_per_token_s, max_attempts=settings.max_attempts,
            backoff_s=settings.backoff_s, backoff_max_s=settings.backoff_max_s,
            lookup_max_tokens=settings.lookup_max_tokens, lookup_min_ngram=settings.lookup_min_ngram,
            grow=settings.grow, grow_fraction=settings.grow_fraction, grow_width=settings.grow_width,
            grow_chains=settings.grow_chains, grow_reroot=settings.grow_reroot,
            specpv=settings.specpv_spec(), lookup_only=settings.speculator == "lookup",
            proposers=settings.proposer_names(), draft_grammar=settings.draft_grammar,
            overlap_prefill=settings.overlap_prefill, overlap_prefill_max_tokens=settings.overlap_prefill_max_tokens,
        )
        self.sessions: dict[str, asyncio.Task] = {}  # running
        self.owners: dict[str, bytes] = {}  # running session -> the producer connection that started it (bounded with sessions)
        self.admission = Admission(active=settings.orchestrator_active_sessions,
                                   max_sessions=settings.orchestrator_max_sessions,
                                   client_share=settings.orchestrator_client_share)
        # one cost model for all sessions: same models, same machine
        self.cost = CostModel() if settings.tree_budget == "cost" else None
        # the proposers' shared resources, one per process (the n-gram cache: what earlier answers
        # continued with); ValueError naming an unknown proposer before anything binds
        names = self.policy.proposer_names(ngrams=settings.lookup_cache_keys > 0 and settings.lookup_max_tokens > 0)
        self.policy = replace(self.policy, proposers=names)
        self.proposers = build_shared(resolve(names), self.policy, settings)
        self.ngrams: NgramCache | None = self.proposers.resources.get("ngrams")
        self.trace = (TraceWriter(settings.trace_file, max_bytes=settings.trace_max_mb << 20,
                                  header={"proposers": list(names), "tree": settings.tree().model_dump(),
                                          "tree_budget": settings.tree_budget,
                                          "lookup_max_tokens": settings.lookup_max_tokens, "grow": settings.grow})
                      if settings.trace_file else None)
        # served over HTTP by the process's main path (specsplit.cli), never from here
        self.metrics = OrchestratorMetrics(positions=settings.tree_max_depth)
        self.metrics.watch(lambda: len(self.sessions), lambda: self.admission.waiting)
        if self.ngrams is not None:
            self.metrics.cache_ngrams.set_function(self.ngrams.__len__)
        self.log = get_logger("specsplit.orchestrator")
        self.sock = None
        self.curve = None
        self.draft_rpc = self.target_rpc = None
        self.ready = asyncio.Event()
        self._stopping = False
        # prompt + max_new_tokens a request may ask for (the inverse of session_tokens_needed)
        extra = session_tokens_needed(GenerateRequest(session_id="-", prompt_token_ids=[0], max_new_tokens=1),
                                      self.policy.tree, self.policy.lookup_max_tokens)  # prompt 1 + 1 new - 2
        self.served_tokens = max(0, settings.max_session_tokens + 2 - extra)

    async def run(self, stop: asyncio.Event) -> None:
        s = self.settings
        self.frontend = s.bind_address()
        # CURVE (off unless keys are set): a server to producers, a client of the routers
        self.curve = s.curve_keys(server=True, client=True)
        secret = s.secret()  # SecretError: the orchestrator cannot authenticate to the routers
        self.sock = make_socket(self.ctx, zmq.ROUTER, bind=self.frontend, curve=self.curve)
        self.draft_rpc = AsyncRpcClient(s.draft_router, ctx=self.ctx, name="draft",
                                        default_timeout_s=s.rpc_timeout_s, max_pending=8 * s.orchestrator_max_sessions,
                                        heartbeat_s=s.heartbeat_s, liveness=s.liveness, curve=self.curve, secret=secret)
        self.target_rpc = AsyncRpcClient(s.target_router, ctx=self.ctx, name="target",
                                         default_timeout_s=s.rpc_timeout_s, max_pending=8 * s.orchestrator_max_sessions,
                                         heartbeat_s=s.heartbeat_s, liveness=s.liveness, curve=self.curve, secret=secret)
        await self.draft_rpc.start()
        await self.target_rpc.start()
        self.log.info("orchestrator_started", frontend=self.frontend, curve=self.curve is not None, grow=s.grow,
                      tree_budget=s.tree_budget,
                      lookup_max_tokens=s.lookup_max_tokens, lookup_cache_keys=s.lookup_cache_keys if self.ngrams else 0,
                      tree=s.tree().model_dump(),
                      specpv=self.policy.specpv.model_dump() if self.policy.specpv else None)
        self.ready.set()
        stopper = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                recv = asyncio.ensure_future(self.sock.recv_multipart())
                done, _ = await asyncio.wait({recv, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if recv not in done:
                    recv.cancel()
                    break
                self._on_frames(recv.result())
        finally:
            stopper.cancel()
            await self._shutdown()

    async def _shutdown(self) -> None:
        self._stopping = True
        for w in self.admission.clear_waiting():  # never started: the producer resumes it elsewhere now
            rid, _ = w.item
            self._send(w.client, GenerateDone(session_id=w.session_id, token_ids=[], finish_reason="cancelled"),
                       w.session_id, rid)
        tasks = list(self.sessions.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.draft_rpc.close()
        await self.target_rpc.close()
        self.sock.close(linger=0)
        if self.curve is not None:
            release_zap(self.ctx)
        if self.trace is not None:
            self.trace.close()
        self.log.info("orchestrator_stopped")

    # ---- frontend ---------------------------------------------------------------------
    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return  # nothing to answer to
        client, body = frames[0], frames[1:]
        try:
            env = unpack_frames(body)
        except CodecError as exc:
            sid, rid = _best_effort_ids(body)
            self.log.info("bad_frame", error=str(exc))
            self._send(client, exc.to_reply(sid), sid or "-", rid)
            return
        msg = env.msg
        if isinstance(msg, GenerateRequest):
            self._start(client, env.request_id, msg)
        elif isinstance(msg, Cancel):
            # a session belongs to the producer connection that started it: anyone else's Cancel
            # is dropped exactly like one for an unknown session (no reply, nothing disclosed)
            task = self.sessions.get(msg.session_id)
            if task and self.owners.get(msg.session_id) == client:
                task.cancel()
            elif task:
                self.log.info("cancel_refused", session_id=msg.session_id, reason="not the session's producer")
            elif (w := self.admission.withdraw(msg.session_id, client)) is not None:
                rid, _ = w.item
                self._send(w.client, GenerateDone(session_id=w.session_id, token_ids=[], finish_reason="cancelled"),
                           w.session_id, rid)
        elif isinstance(msg, Heartbeat):
            fleet = self.target_rpc.fleet_tokenizer if self.target_rpc is not None else Heartbeat()
            if self.target_rpc is not None and self.target_rpc.router_lost:
                fleet = Heartbeat()  # no live target router: nothing can be served now
            pong = Heartbeat(sent_at=msg.sent_at, tokenizer_hash=fleet.tokenizer_hash, vocab_size=fleet.vocab_size,
                             max_session_tokens=self.served_tokens)
            self._send(client, pong, env.session_id, env.request_id)
        else:
            err = ErrorReply.of(ErrorCode.BAD_REQUEST, f"the orchestrator does not serve {type(msg).__name__}",
                                session_id=env.session_id)
            self._send(client, err, env.session_id, env.request_id)

    def _start(self, client: bytes, rid: bytes, req: GenerateRequest) -> None:
        """Admit a session: run it now, queue it (fairly), or refuse it at once."""
        sid = req.session_id
        if sid in self.admission:
            err = ErrorReply.of(ErrorCode.BAD_REQUEST, f"session {sid!r} is already running", session_id=sid)
            return self._send(client, err, sid, rid)
        need = session_tokens_needed(req, req.tree or self.policy.tree, self.policy.lookup_max_tokens)
        if need > self.settings.max_session_tokens:
            why = (f"prompt ({len(req.prompt_token_ids)}) + max_new_tokens ({req.max_new_tokens}) + a tree would need "
                   f"{need} tokens per session, limit is {self.settings.max_session_tokens}")
            return self._send(client, ErrorReply.of(ErrorCode.BAD_REQUEST, why, session_id=sid), sid, rid)
        verdict = self.admission.offer(client, sid, (rid, req))
        if verdict == "run":
            self._launch(client, rid, req)
        elif verdict != "wait":
            self._send(client, ErrorReply.of(ErrorCode.OVERLOADED, verdict, session_id=sid), sid, rid)

    def _launch(self, client: bytes, rid: bytes, req: GenerateRequest, queued_s: float = 0.0) -> None:
        sid = req.session_id

        def emit(m: Message) -> None:
            self._send(client, m, sid, rid)

        self.metrics.queue_wait.observe(queued_s)
        actor = SessionActor(req, self.draft_rpc, self.target_rpc, self.policy, emit, self.cost,
                             metrics=self.metrics, queued_s=queued_s, shared=self.proposers, trace=self.trace)
        task = asyncio.ensure_future(actor.run())
        self.sessions[sid] = task
        self.owners[sid] = client
        task.add_done_callback(lambda t, sid=sid: self._finished(sid, t))

    def _finished(self, sid: str, task: asyncio.Task) -> None:
        self.sessions.pop(sid, None)
        self.owners.pop(sid, None)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("session_crashed", session_id=sid, error=repr(task.exception()))
        if self._stopping:
            return
        for w in self.admission.finish(sid):
            rid, req = w.item
            self._launch(w.client, rid, req, time.monotonic() - w.since)

    def _send(self, client: bytes, msg: Message, sid: str, rid: bytes) -> None:
        try:
            frames = pack_frames(msg, sid, rid or b"-")
            self.sock.send_multipart([client, *frames], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # producer gone (EHOSTUNREACH) or HWM reached (EAGAIN)
            self.log.info("producer_unreachable", session_id=sid, error=str(exc))
            if isinstance(msg, GenerateDone):
                return
            task = self.sessions.get(sid)
            if task and exc.errno == zmq.EHOSTUNREACH:
                task.cancel()


def session_tokens_needed(req: GenerateRequest, tree, lookup_max_tokens: int = 0) -> int:
    """Most tokens a worker holds for the session: the committed context before the last round
    (prompt + max_new_tokens - 2 at most) plus the largest request's tree (verify: max_nodes +
    the prompt-lookup nodes merged into it; draft: the root + branch x max_depth)."""
    extra = max(tree.max_nodes + lookup_max_tokens, 1 + tree.branch * tree.max_depth)
    return len(req.prompt_token_ids) + req.max_new_tokens - 2 + extra


def _best_effort_ids(body: list[bytes]) -> tuple[str | None, bytes]:
    """Session and request ids of a malformed message, where readable, to address the error."""
    sid, rid = None, b"-"
    if len(body) >= 4 and bytes(body[0]) == PROTO:
        try:
            sid = bytes(body[2]).decode("utf-8")[:128] or None
        except UnicodeDecodeError:
            sid = None
        if 1 <= len(body[3]) <= 32:
            rid = bytes(body[3])
    return sid, rid
