"""The worker side of a router: a DEALER that registers, heartbeats and serves requests.

Two threads, each owning its sockets:
- the socket thread (the caller of ``run``) owns the DEALER to the router and one end of an
  inproc PAIR; it heartbeats, watches the router's liveness (Paranoid Pirate: reconnect with
  exponential back-off and a fresh WORKER_HELLO when the router is silent for
  liveness x heartbeat_s), and answers OVERLOADED at once when the engine queue is full;
- the engine thread runs the synchronous ``handler`` (it may block for seconds: a model forward),
  one request at a time from a bounded queue, and hands reply frames back over the PAIR.

Fast path: while the engine thread is idle (nothing queued or in hand), a request that
``may_inline`` accepts and whose kind last took under ``inline_max_s`` to handle is handled on
the socket thread itself and answered at once: no queue, no PAIR, no two thread wake-ups (each
costs tens to hundreds of microseconds on a busy box). Long requests (model forwards of a big
model, prefills, growth) keep going to the engine thread, so heartbeats never stall for long.
The first request of each kind always goes to the engine thread (it measures the kind).

Batching (``batch_handler``: a target's ``verify_batch``, a draft's ``draft_batch``): when the
engine thread takes a request, it also takes the batchable requests already waiting behind it
(``take_batch``: up to ``max_batch_tokens`` new tokens) and hands them to ``batch_handler``
together (``worker_batching.EngineBatching``), which answers each one (errors per request). The fast path then stays closed while more requests are readable
on the socket, so a burst is queued and batched instead of served inline one by one. With
``batch_hold`` > 0 a forward also waits, up to that fraction of the worker's recent forward time,
for the sessions whose next request is due (``Gather``), so sessions in lockstep share forwards
instead of splitting into groups that alternate; the fast path stays closed while any is due.

Frames on the DEALER (the router adds/strips the worker identity):
    in   [client_id, PROTO, kind, session_id, request_id, body]   a request; reply to client_id
    in   [b"", PROTO, AUTH_CHALLENGE|HEARTBEAT|ERROR, "-", request_id, body]   from the router
    out  [client_id, PROTO, kind, session_id, request_id, body]   a reply
    out  [b"", PROTO, WORKER_HELLO|AUTH_RESPONSE|HEARTBEAT, "-", request_id, body]
The hello carries a fresh nonce; the router answers AUTH_CHALLENGE with its nonce and its proof
of the fleet secret, which the worker checks before it answers AUTH_RESPONSE (brokers.auth). A
HEARTBEAT whose request_id echoes the hello's then means "admitted" (``ready`` is set); requests
are served only while admitted. A retryable ERROR means "send WORKER_HELLO again"; a
non-retryable one means "refused" (``run`` returns 2).

Session isolation: ``client_id`` is the router's random token for the client that sent the
request. The handler sees ``session_id`` scoped as ``<token hex>/<session_id>`` (and the reply
gets the client's own id back), so a session belongs to the client that created it: another
client's request for the same session id addresses another session.
With CURVE (``curve``), a router whose ZAP handler refuses the worker's key is "refused" too
(logged ``curve_refused``); other failed handshakes are logged and retried like a silent router.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import uuid
from collections.abc import Callable

import structlog
import zmq

from brokers.curve import HANDSHAKE_FAILURES, CurveKeys
from brokers.signals import sleep_unless
from schemas.codec import CodecError, MsgKind, check_envelope, pack_frames, unpack_frames
from schemas.messages import (
    DraftRequest, EndSession, ErrorCode, ErrorReply, Heartbeat, Message, VerifyRequest,
    WorkerHello,
)
from specsplit.compute import ComputeThread, Task
from specsplit.logs import get_logger
from specsplit.transport.batching import Gather, take_batch, verify_tokens
from specsplit.transport.sockets import DEFAULT_HWM, make_monitored_socket, make_socket, recv_frames, send_frames
from specsplit.transport.worker_batching import EngineBatching, _Job, scoped_session_id
from specsplit.transport.worker_handshake import CONTROL_SID, RouterHandshake, _Outcome

Handler = Callable[[Message], Message]
InlinePolicy = Callable[[Message], bool]
BatchHandler = Callable[[list[Message]], list[Message]]

_MAX_POLL_MS = 100
_DRAIN_BATCH = 512
_FLUSH_LINGER_MS = 1000
_DONE = [b""]  # one empty frame on the PAIR: the engine thread has finished


def small_request(msg: Message, max_tokens: int = 64) -> bool:
    """A fast-path policy: EndSession, and draft/verify requests whose forward covers at most
    ``max_tokens`` new tokens (no prefill). Growth and anything else go to the engine thread
    (growth runs for its budget and yields to queued requests)."""
    if isinstance(msg, EndSession):
        return True
    if isinstance(msg, VerifyRequest):
        return len(msg.sync.append_token_ids) + msg.tree.num_nodes <= max_tokens
    if isinstance(msg, DraftRequest):
        return len(msg.sync.append_token_ids) + msg.tree.max_nodes <= max_tokens
    return False


def error_frames(client_id: bytes, sid: str, rid: bytes, code: ErrorCode, message: str) -> list[bytes]:
    """Reply frames carrying a typed error for (session_id, request_id)."""
    return [client_id, *pack_frames(ErrorReply.of(code, message, session_id=sid), sid, rid)]


class WorkerLoop(EngineBatching, RouterHandshake):
    """Serve ``handler`` behind the router at ``backend_addr`` as worker ``identity``.

    ``run(stop_event)`` returns 0 after a clean stop (the request in hand is finished and its
    reply sent; queued ones are answered OVERLOADED), 1 if the engine did not finish within
    ``drain_timeout_s``, 2 if the router refused the hello. ``ready`` is set while admitted.
    ``may_inline(msg)`` (None: never) allows the socket-thread fast path for a request; it is
    taken only while the engine is idle and only for kinds whose last handling took under
    ``inline_max_s`` (default: a quarter of ``heartbeat_s``). ``compute`` (a ComputeThread: the
    one that loaded the model) runs the engine loop; a real worker passes it, and a fast path only
    where small forwards start no OpenMP team, so every team of the process starts from one
    thread (``specsplit.compute``).
    """

    def __init__(
        self,
        backend_addr: str,
        identity: bytes,
        hello: WorkerHello,
        handler: Handler,
        *,
        heartbeat_s: float = 1.0,
        liveness: int = 3,
        max_queue: int = 1024,
        reconnect_max_s: float = 2.0,  # a returning router is found within ~2 s
        drain_timeout_s: float = 60.0,
        sndhwm: int = DEFAULT_HWM,
        rcvhwm: int = DEFAULT_HWM,
        ctx: zmq.Context | None = None,
        may_inline: InlinePolicy | None = None,
        inline_max_s: float | None = None,
        curve: CurveKeys | None = None,
        batch_handler: BatchHandler | None = None,
        max_batch_tokens: int = 0,
        batch_cost: Callable[[Message], int | None] = verify_tokens,
        batch_hold: float = 0.0,
        secret: bytes | None = None,
        compute: ComputeThread | None = None,
    ) -> None:
        if heartbeat_s <= 0 or liveness < 1 or max_queue < 1:
            raise ValueError("heartbeat_s must be > 0, liveness >= 1, max_queue >= 1")
        if not secret:
            raise ValueError("a fleet secret is required (brokers.auth.load_fleet_secret)")
        self._secret = secret
        self.may_inline = may_inline
        self.inline_max_s = heartbeat_s / 4 if inline_max_s is None else inline_max_s
        # seconds the last request of each kind took in the handler (either thread writes it
        # only while it is the one handling, so the two never race on an entry)
        self._handle_s: dict[MsgKind, float] = {}
        # jobs put (socket thread only) and finished (engine thread only): equal = engine idle
        self._submitted = 0
        self._finished = 0
        self.inline_served = 0
        # batching (engine thread): None or max_batch_tokens 0 hands every request over alone
        self.batch_handler = batch_handler if max_batch_tokens > 0 else None
        self.max_batch_tokens, self.batch_cost = max_batch_tokens, batch_cost
        self.batches = 0  # handler calls with more than one request
        # a forward waits up to batch_hold x its recent duration for sessions due (transport.batching)
        self.gather = Gather(batch_hold) if self.batch_handler is not None and batch_hold > 0 else None
        self.batched_requests = 0  # requests answered by those calls
        self.backend_addr, self.identity, self.hello = backend_addr, identity, hello
        self.handler = handler
        self.heartbeat_s, self.liveness, self.max_queue = heartbeat_s, liveness, max_queue
        self.reconnect_max_s, self.drain_timeout_s = reconnect_max_s, drain_timeout_s
        self._hwm = (sndhwm, rcvhwm)
        self.curve = curve
        self._mon: zmq.Socket | None = None  # CURVE handshake failures of the DEALER (curve only)
        self._handshake_logged = 0.0
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.Context()
        # only the socket thread puts, so qsize() is a safe bound (it can only shrink meanwhile)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._pair_addr = f"inproc://specsplit-worker-{uuid.uuid4().hex}"
        self._rids = itertools.count(1)
        self.ready = threading.Event()
        self.log = get_logger("specsplit.worker_loop", service=hello.service, worker=identity.hex())
        self._sock: zmq.Socket | None = None
        self._pair: zmq.Socket | None = None
        self._engine: threading.Thread | Task | None = None
        self._compute = compute  # the thread the engine loop runs on (None: a thread of its own)
        self._engine_done = False
        self._draining = False
        self._hello_rid = b""
        self._hello_nonce = ""
        self._hello_body = b""
        self._router_proved = False  # the router answered this hello's nonce with a good proof
        self._last_hello = 0.0
        self.dropped_unadmitted = 0  # requests that came while not admitted (dropped)

    def requests_waiting(self) -> bool:
        """True when requests are queued for the engine behind the one in hand."""
        return not self._queue.empty()

    def queue_depth(self) -> int:
        """Requests queued for the engine thread behind the one in hand (a metrics gauge)."""
        return self._queue.qsize()

    # ------------------------------------------------------------ lifecycle
    def run(self, stop_event: threading.Event) -> int:
        """Serve until ``stop_event`` is set; see the class docstring for the return code."""
        self._pair = make_socket(self._ctx, zmq.PAIR, sndhwm=0, rcvhwm=0, bind=self._pair_addr)
        if self._compute is not None:
            self._engine = self._compute.submit(self._engine_main)
        else:
            self._engine = threading.Thread(target=self._engine_main, name="specsplit-engine", daemon=True)
            self._engine.start()
        delay, rc = self.heartbeat_s, 0
        try:
            while True:
                outcome, heard = self._serve(stop_event)
                if outcome is _Outcome.STOPPED:
                    rc = 0 if self._engine_done else 1
                    break
                if outcome is _Outcome.REFUSED:
                    rc = 2
                    break
                delay = self.heartbeat_s if heard else min(delay * 2, self.reconnect_max_s)
                self.log.warning("router_silent_reconnecting", backoff_s=delay)
                if sleep_unless(stop_event, delay):  # the SIGTERM handler sets it
                    break
        finally:
            engine_stopped = self._stop_engine(wait_s=0.0 if rc == 1 else self.drain_timeout_s)
            self._pair.close(linger=0)
            if self._own_ctx and engine_stopped:  # a stuck engine still holds a socket
                self._ctx.term()
        self.log.info("worker_stopped", rc=rc)
        return rc

    def _serve(self, stop_event: threading.Event) -> tuple[_Outcome, bool]:
        """One connection's lifetime: connect, hello, poll until stopped/silent/refused."""
        snd, rcv = self._hwm
        kw = dict(identity=self.identity, sndhwm=snd, rcvhwm=rcv, connect=self.backend_addr, curve=self.curve)
        if self.curve is not None:
            self._sock, self._mon = make_monitored_socket(self._ctx, zmq.DEALER, HANDSHAKE_FAILURES, **kw)
        else:
            self._sock = make_socket(self._ctx, zmq.DEALER, **kw)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._pair, zmq.POLLIN)
        if self._mon is not None:
            poller.register(self._mon, zmq.POLLIN)
        self.ready.clear()
        self._send_hello()
        silent_after = self.liveness * self.heartbeat_s
        now = time.monotonic()
        last_heard, next_hb, heard, deadline = now, now + self.heartbeat_s, False, None
        try:
            while True:
                if stop_event.is_set() and not self._draining:
                    deadline = time.monotonic() + self.drain_timeout_s
                    self._begin_drain()
                wait_ms = max(1, min(_MAX_POLL_MS, int((next_hb - time.monotonic()) * 1000) + 1))
                events = dict(poller.poll(wait_ms if deadline is None else min(wait_ms, 20)))
                if self._pair in events:
                    self._forward_replies()
                if self._mon is not None and self._mon in events and self._on_handshake_failed():
                    return _Outcome.REFUSED, heard
                if self._sock in events:
                    outcome = self._read_router()
                    last_heard, heard = time.monotonic(), True
                    if outcome is not None:
                        return outcome, heard
                now = time.monotonic()
                if self._draining and (self._engine_done or now > deadline):
                    return _Outcome.STOPPED, heard
                if now >= next_hb:
                    next_hb = now + self.heartbeat_s
                    self._send_control(Heartbeat(sent_at=time.time()), b"hb")
                if not self._draining and now - last_heard > silent_after:
                    return _Outcome.SILENT, heard
        finally:
            self.ready.clear()
            if self._mon is not None:
                self._sock.disable_monitor()
                self._mon.close(linger=0)
                self._mon = None
            # after a drain the last replies may still sit in the socket: give them time to leave
            self._sock.close(linger=_FLUSH_LINGER_MS if self._draining else 0)
            self._sock = None

    def _begin_drain(self) -> None:
        """Stop taking work: answer queued requests at once, let the engine finish its job."""
        self._draining = True
        self.log.info("worker_draining", queued=self._queue.qsize())
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._reject(job.client_id, job.session_id, job.request_id, "worker stopping")
        self._queue.put(None)  # unbounded SimpleQueue: never blocks

    def _stop_engine(self, wait_s: float) -> bool:
        """Make sure the engine thread ends; True when it did within ``wait_s``."""
        if not self._draining:
            self._begin_drain()  # no socket any more: queued requests are dropped (logged)
        if self._engine is None:
            return True
        self._engine.join(timeout=wait_s)
        if self._engine.is_alive():
            self.log.error("engine_thread_stuck", waited_s=wait_s)
            return False
        return True

    # -------------------------------------------------------- socket thread
    def _read_router(self) -> _Outcome | None:
        for _ in range(_DRAIN_BATCH):
            try:
                frames = recv_frames(self._sock)
            except zmq.Again:
                return None
            if not frames:
                continue
            client_id, env = frames[0], frames[1:]
            if client_id and not self.ready.is_set():  # only an admitting, proven router routes to us
                self.dropped_unadmitted += 1
                self.log.warning("request_before_admission_dropped")
            elif client_id:
                self._on_request(client_id, env)
            elif self._on_control(env) is _Outcome.REFUSED:
                return _Outcome.REFUSED
        return None

    def _on_request(self, client_id: bytes, env: list[bytes]) -> None:
        try:
            kind, sid, rid = check_envelope(env)
        except CodecError as exc:
            self.log.warning("bad_request_envelope", error=str(exc))
            self._send([client_id, *pack_frames(exc.to_reply(), CONTROL_SID, b"-")])
            return
        if self._draining:
            self._reject(client_id, sid, rid, "worker stopping")
            return
        if self._queue.qsize() >= self.max_queue:
            self._reject(client_id, sid, rid, f"worker queue full (max_queue={self.max_queue})")
            return
        job = _Job(client_id, env, sid, rid, arrived=time.monotonic())
        if self._fast_path_open(kind, job.key):
            job = self._try_inline(job)
            if job is None:
                return
        self._submitted += 1
        self._queue.put(job)

    def _fast_path_open(self, kind: MsgKind, key: tuple[bytes, str]) -> bool:
        if self.may_inline is None or self._submitted != self._finished:
            return False  # the engine thread holds or waits for work: keep the order, keep one handler
        if self.batch_handler is not None and self._sock.get(zmq.EVENTS) & zmq.POLLIN:
            return False  # more requests are readable: queue this one, so the engine batches them
        if self.gather is not None and self.gather.hold_s(now := time.monotonic(), now, exclude=(key,)) > 0:
            return False  # other sessions are due: the engine thread waits for them and batches
        took = self._handle_s.get(kind)
        return took is not None and took < self.inline_max_s

    def _try_inline(self, job: _Job) -> _Job | None:
        """Handle ``job`` here when the policy allows; else return it (decoded) for the engine."""
        try:
            env = unpack_frames(job.env)
        except CodecError as exc:
            self._send([job.client_id, *pack_frames(exc.to_reply(session_id=job.session_id), job.session_id,
                                                    job.request_id)])
            return None
        try:
            inline = bool(self.may_inline(env.msg))
        except Exception:
            self.log.exception("inline_policy_failed")
            inline = False
        job = _Job(job.client_id, job.env, job.session_id, job.request_id, env)
        if not inline:
            return job
        self.inline_served += 1
        t0 = time.monotonic()
        frames = self._handle(job)
        self._note_served([job], time.monotonic() - t0)
        self._send(frames)
        return None

    def _reject(self, client_id: bytes, sid: str, rid: bytes, why: str) -> None:
        self._send(error_frames(client_id, sid, rid, ErrorCode.OVERLOADED, why))

    def _forward_replies(self) -> None:
        while True:
            try:
                frames = recv_frames(self._pair)
            except zmq.Again:
                return
            if frames == _DONE:
                self._engine_done = True
            else:
                self._send(frames)

    def _send_control(self, msg: Message, rid: bytes) -> None:
        self._send([b"", *pack_frames(msg, CONTROL_SID, rid)])

    def _send(self, frames: list[bytes]) -> None:
        if self._sock is None:
            self.log.warning("reply_dropped", reason="not connected")
            return
        try:
            send_frames(self._sock, frames)
        except zmq.Again:
            self.log.warning("reply_dropped", reason="hwm")

    # -------------------------------------------------------- engine thread
    def _engine_main(self) -> None:
        out = make_socket(self._ctx, zmq.PAIR, sndhwm=0, rcvhwm=0, linger=1000, connect=self._pair_addr)
        rest: list[_Job | None] = []  # taken from the queue, not batched: handled next
        try:
            while (job := rest.pop() if rest else self._queue.get()) is not None:
                jobs = [job]
                if self.batch_handler is not None:
                    jobs, rest = take_batch(self._decoded(job), self._waiting(), self._cost, self.max_batch_tokens)
                    if not rest and self.gather is not None:
                        rest = self._hold(jobs)
                t0 = time.monotonic()
                frames = [self._handle(jobs[0])] if len(jobs) == 1 else self._handle_batch(jobs)
                self._note_served(jobs, time.monotonic() - t0)
                self._finished += len(jobs)  # before the replies leave: the fast path may open again
                for f in frames:
                    self._engine_send(out, f)
        finally:
            self._engine_send(out, _DONE)
            out.close()

    def _engine_send(self, out: zmq.Socket, frames: list[bytes]) -> None:
        try:  # unbounded inproc pipe: Again only once the socket thread has gone
            send_frames(out, frames)
        except zmq.ZMQError as exc:
            self.log.warning("reply_dropped", reason=f"socket thread gone: {exc.strerror}")

    def _handle(self, job: _Job) -> list[bytes]:
        """One request -> reply frames. Never raises."""
        sid, rid = job.session_id, job.request_id
        env = job.decoded
        if env is None:
            try:
                env = unpack_frames(job.env)
            except CodecError as exc:
                return [job.client_id, *pack_frames(exc.to_reply(session_id=sid), sid, rid)]
            except Exception as exc:  # defensive: the codec promises CodecError only
                self.log.exception("decode_failed")
                return error_frames(job.client_id, sid, rid, ErrorCode.INTERNAL, f"decode failed: {exc!r}")
        msg = env.msg
        round_ = getattr(msg, "round", None)
        scoped = scoped_session_id(job.client_id, sid)
        if getattr(msg, "session_id", None) == sid:
            msg = msg.model_copy(update={"session_id": scoped})
        with structlog.contextvars.bound_contextvars(session_id=sid, round=round_):
            t0 = time.perf_counter()
            try:
                reply = self.handler(msg)
            except Exception as exc:
                reply = self._exception_reply(exc, env.kind)
            self._handle_s[env.kind] = time.perf_counter() - t0
            if getattr(reply, "session_id", None) == scoped:
                reply = reply.model_copy(update={"session_id": sid})
            return self._reply_frames(job, reply)

    def _exception_reply(self, exc: Exception, kind: MsgKind) -> Message:
        to_reply = getattr(exc, "to_reply", None)
        if callable(to_reply):
            try:
                reply = to_reply()
            except Exception as inner:
                reply = None
                self.log.warning("to_reply_failed", error=repr(inner))
            if isinstance(reply, Message):
                self.log.info("handler_error_reply", kind=kind.name, error=str(exc))
                return reply
        self.log.exception("handler_failed", kind=kind.name)
        return ErrorReply.of(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _reply_frames(self, job: _Job, reply: Message) -> list[bytes]:
        sid, rid = job.session_id, job.request_id
        if isinstance(reply, ErrorReply) and reply.session_id != sid:
            reply = reply.model_copy(update={"session_id": sid})
        body_sid = getattr(reply, "session_id", None)
        if isinstance(body_sid, str) and body_sid not in (sid, CONTROL_SID):
            self.log.error("reply_session_mismatch", reply_session_id=body_sid)
            return error_frames(job.client_id, sid, rid, ErrorCode.INTERNAL, "handler replied for another session")
        try:
            return [job.client_id, *pack_frames(reply, sid, rid)]
        except Exception as exc:
            self.log.error("reply_encode_failed", reply_type=type(reply).__name__, error=str(exc))
            return error_frames(job.client_id, sid, rid, ErrorCode.INTERNAL, f"reply not encodable: {exc}")
