"""One router per service (``draft``, ``target``): clients on the frontend, workers on the backend.

Frames, exactly (``env`` = ``[PROTO, kind, session_id, request_id, body]``, see schemas/codec.py):

frontend (ROUTER, binds; orchestrators and clients connect DEALERs)
    in   [client_id, *env]
    out  [client_id, *env]                        worker replies, router errors, ping replies
backend (ROUTER, binds, no ROUTER_HANDOVER; workers connect DEALERs)
    out  [worker_id, token, *env]                 a client request for the worker
    in   [worker_id, token, *env]                 the worker's reply for that client
    in   [worker_id, b"", *env]                   addressed to the router: WORKER_HELLO,
                                                  AUTH_RESPONSE, HEARTBEAT
    out  [worker_id, b"", *env]                   router to worker: AUTH_CHALLENGE, HEARTBEAT
                                                  (admitted when its request_id echoes the
                                                  hello's), ERROR

Trust (PROTOCOL.md, "Security model"): every peer proves the fleet secret by HMAC
challenge-response (brokers.auth). A client (CLIENT_HELLO -> AUTH_CHALLENGE -> AUTH_RESPONSE ->
HEARTBEAT) gets a random 16-byte *token*; the router sends its requests to workers with the token
as the return address, so workers key sessions by (token, session_id): another client's request
for the same session id addresses another session. A worker is routed to only once its hello is
authenticated and admitted; a reply is delivered only when that worker was sent that request id.
No ROUTER_HANDOVER: a second connection cannot take an admitted identity over.
CURVE (``curve``, off-box fleets) encrypts both sockets and admits only listed keys (brokers.curve).

Control envelopes use session_id "-". A router validates envelopes with ``check_envelope`` and
decodes only bodies addressed to itself (hellos and auth responses), never a request. A retryable
ERROR to a worker means "unknown worker: send WORKER_HELLO", a non-retryable one "refused". A
HEARTBEAT from a client on the frontend is answered by the router itself (a ping; no auth needed).

Liveness: the router heartbeats its workers every ``heartbeat_s``; any message from a worker
proves it alive; ``liveness`` beats of silence expire it. A backend disconnect (socket monitor)
probes the workers at once, so a killed worker is dropped in milliseconds. Either way the lost
worker's in-flight requests are answered NO_WORKER (retryable) at once, and only its sessions move;
they stay where they moved when it comes back (``WorkerRegistry.pick``: new sessions go to it).

A session that moved (its worker expired, then came back) may have a cache on more than one
worker. An END_SESSION therefore goes to the session's worker, which answers it, and a copy under
a router-owned request id to every other live worker, whose acks the router drops; an expired
worker gets the copies it missed when it is admitted again (``registry.EndCopies``). A session's
end frees its caches wherever they are, not only where it lives now.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

import zmq

from brokers import auth
from brokers.curve import CurveKeys, CurveRequired, release_zap
from brokers.logs import LogLimiter, get_logger
from brokers.registry import EndCopies, Inflight, InflightTable, WorkerRegistry
from brokers.router_auth import REFUSED, RouterAuth  # noqa: F401  (REFUSED: part of this module's API)
from brokers.sockets import DEFAULT_HWM, endpoint, is_loopback_address, make_socket, recv_frames, send_frames
from schemas.codec import CodecError, MsgKind, check_envelope, pack_frames
from schemas.messages import ErrorCode, ErrorReply, Heartbeat, Message

CONTROL_SID = "-"
PLACEHOLDER_RID = b"-"
_DRAIN_BATCH = 512
_MAX_POLL_MS = 100
_LRU_SIZE = 1024
_CHALLENGE_TTL_S = 10.0


@dataclass(slots=True)
class RouterStats:
    """Counters since start (read them from any thread; they are only ever incremented)."""

    routed: int = 0
    replies: int = 0
    bad_frames: int = 0
    no_worker: int = 0
    overloaded: int = 0
    workers_admitted: int = 0
    workers_refused: int = 0
    workers_expired: int = 0  # silent for liveness x heartbeat_s
    workers_lost: int = 0  # a send to them failed (disconnected, killed)
    inflight_failed: int = 0
    clients_authenticated: int = 0
    auth_failed: int = 0  # bad or missing proofs, clients and workers
    unauthenticated: int = 0  # requests from clients that have not authenticated
    unsolicited_replies: int = 0  # replies for a request id the worker was not sent (dropped)
    ends_copied: int = 0  # END_SESSION copies sent to workers other than the session's (see above)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _readable_sid(env: list[bytes]) -> str:
    if len(env) > 2 and 1 <= len(env[2]) <= 128:
        try:
            return bytes(env[2]).decode("utf-8")
        except UnicodeDecodeError:
            pass
    return CONTROL_SID


def _readable_rid(env: list[bytes]) -> bytes:
    if len(env) > 3 and 1 <= len(env[3]) <= 32:
        return bytes(env[3])
    return PLACEHOLDER_RID


class Router(RouterAuth):
    """Routes a service's requests to its workers by rendezvous hash of the session id (a
    session stays on the worker it was routed to while that one is live).

    ``run(stop_event)`` owns both sockets in the calling thread (one ``zmq.Poller`` loop) and
    returns when ``stop_event`` is set or ``close()`` is called. ``ready`` is set once both
    sockets are bound; ``frontend_endpoint`` / ``backend_endpoint`` then hold the resolved
    addresses (``tcp://127.0.0.1:*`` binds a free port).
    """

    def __init__(
        self,
        service: str,
        frontend_addr: str,
        backend_addr: str,
        *,
        heartbeat_s: float = 1.0,
        liveness: int = 3,
        max_workers: int = 256,
        max_inflight: int = 65_536,
        request_ttl_s: float = 3600.0,
        sndhwm: int = DEFAULT_HWM,
        rcvhwm: int = DEFAULT_HWM,
        ctx: zmq.Context | None = None,
        curve: CurveKeys | None = None,
        secret: bytes | None = None,
        max_clients: int = 4096,
        client_ttl_s: float = 24 * 3600.0,
    ) -> None:
        if heartbeat_s <= 0 or liveness < 1:
            raise ValueError("heartbeat_s must be > 0 and liveness >= 1")
        if not secret or len(secret) < auth.MIN_SECRET_BYTES:
            raise ValueError(f"a fleet secret of at least {auth.MIN_SECRET_BYTES} bytes is required")
        self._secret = secret
        for addr in (frontend_addr, backend_addr):
            if curve is None and not is_loopback_address(addr):
                raise CurveRequired(f"{addr}: binding beyond loopback requires CURVE keys (router curve=None)")
        self.curve = curve  # both sockets are CURVE servers admitting curve.authorized
        self.service = service
        self.frontend_addr, self.backend_addr = frontend_addr, backend_addr
        self.heartbeat_s, self.liveness = heartbeat_s, liveness
        self._hwm = (sndhwm, rcvhwm)
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.Context()
        self.registry = WorkerRegistry(service, ttl_s=heartbeat_s * liveness, max_workers=max_workers)
        self.inflight = InflightTable(max_entries=max_inflight, ttl_s=request_ttl_s)
        self.stats = RouterStats()
        # routing id -> token of authenticated clients; pending challenges of clients and workers
        self._clients = auth.BoundedTable(max_clients, client_ttl_s)
        self._client_challenges = auth.BoundedTable(_LRU_SIZE, _CHALLENGE_TTL_S)
        self._worker_challenges = auth.BoundedTable(_LRU_SIZE, _CHALLENGE_TTL_S)
        self.ready = threading.Event()
        self.frontend_endpoint: str | None = None
        self.backend_endpoint: str | None = None
        self._closing = threading.Event()
        self._done = threading.Event()
        self._done.set()
        self._fe: zmq.Socket | None = None
        self._be: zmq.Socket | None = None
        self._mon: zmq.Socket | None = None
        self._probe_at = float("inf")
        self._asked_hello: OrderedDict[bytes, float] = OrderedDict()
        self._unreachable_logged: OrderedDict[bytes, None] = OrderedDict()
        self._copies = EndCopies(max_inflight)
        self.log = get_logger("brokers.router", service=service)
        self._warn = LogLimiter(self.log)

    def live_workers(self) -> tuple[bytes, ...]:
        """Identities of the admitted, live workers (a snapshot; safe from any thread)."""
        return self.registry.live

    # ----------------------------------------------------------------- loop
    def run(self, stop_event: threading.Event) -> None:
        """Bind, then route until ``stop_event`` is set (or ``close()``). Sockets close on exit."""
        self._done.clear()
        try:
            self._open_sockets()
            poller = zmq.Poller()
            poller.register(self._be, zmq.POLLIN)
            poller.register(self._fe, zmq.POLLIN)
            poller.register(self._mon, zmq.POLLIN)
            now = time.monotonic()
            self._next_hb = self._next_check = now
            self.ready.set()
            self.log.info("router_started", frontend=self.frontend_endpoint, backend=self.backend_endpoint,
                          curve=self.curve is not None)
            while not (stop_event.is_set() or self._closing.is_set()):
                events = dict(poller.poll(self._poll_ms()))
                if self._be in events:
                    self._drain(self._be, self._on_backend)
                if self._fe in events:
                    self._drain(self._fe, self._on_frontend)
                if self._mon in events:
                    self._on_disconnect()
                self._housekeeping(time.monotonic())
        finally:
            self.ready.clear()
            self._close_sockets()
            self.log.info("router_stopped", **self.stats.as_dict())
            self._done.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop ``run`` (if running, waiting up to ``timeout_s``) and release the context."""
        self._closing.set()
        if not self._done.wait(timeout_s):
            self.log.warning("router_close_timeout", timeout_s=timeout_s)
            return
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    def _open_sockets(self) -> None:
        snd, rcv = self._hwm
        self._fe = make_socket(self._ctx, zmq.ROUTER, sndhwm=snd, rcvhwm=rcv, bind=self.frontend_addr,
                               curve=self.curve)
        self._be = make_socket(
            self._ctx, zmq.ROUTER, sndhwm=snd, rcvhwm=rcv, router_handover=False, bind=self.backend_addr,
            curve=self.curve,
        )
        self.frontend_endpoint, self.backend_endpoint = endpoint(self._fe), endpoint(self._be)
        monitor_addr = f"inproc://specsplit-router-monitor-{id(self):x}-{time.monotonic_ns()}"
        self._be.monitor(monitor_addr, zmq.EVENT_DISCONNECTED)
        self._mon = make_socket(self._ctx, zmq.PAIR, connect=monitor_addr)

    def _close_sockets(self) -> None:
        if self._be is not None and self._mon is not None:
            self._be.disable_monitor()
        for sock in (self._mon, self._fe, self._be):
            if sock is not None:
                sock.close(linger=0)
                if self.curve is not None and sock is not self._mon:
                    release_zap(self._ctx)  # the last one stops the ZAP thread, before ctx.term()
        self._fe = self._be = self._mon = None

    def _poll_ms(self) -> int:
        due = min(self._next_hb, self._next_check, self._probe_at) - time.monotonic()
        return max(0, min(_MAX_POLL_MS, int(due * 1000) + 1))

    def _drain(self, sock: zmq.Socket, handle) -> None:
        """Handle up to one batch of waiting messages; a frame never kills the loop."""
        for _ in range(_DRAIN_BATCH):
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return
            try:
                handle(frames)
            except Exception:  # a bug, not a frame problem: log it and keep routing
                self.log.exception("router_handler_failed", nframes=len(frames))

    def _on_disconnect(self) -> None:
        """A backend peer disconnected (a worker stopped or was killed): probe the live workers
        now and once more shortly after, so that a vanished worker's send fails with
        EHOSTUNREACH and its in-flight requests are answered at once instead of at expiry."""
        while True:
            try:
                self._mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
        self._heartbeat_workers()
        self._probe_at = time.monotonic() + 0.05

    def _heartbeat_workers(self) -> None:
        beat = pack_frames(Heartbeat(sent_at=time.time()), CONTROL_SID, b"hb")
        for worker_id in self.registry.live:
            self._send_worker(worker_id, [b"", *beat])

    def _housekeeping(self, now: float) -> None:
        if now >= self._probe_at:
            self._probe_at = float("inf")
            self._heartbeat_workers()
        if now >= self._next_hb:
            self._next_hb = now + self.heartbeat_s
            self._heartbeat_workers()
        if now >= self._next_check:
            self._next_check = now + min(0.1, self.heartbeat_s / 4)
            for worker_id in self.registry.expire(now):
                self.stats.workers_expired += 1
                self.log.warning("worker_expired", worker=worker_id.hex(), live=len(self.registry))
                self._fail_inflight(worker_id, "expired")
                self._copies.away(worker_id, now)
            stale = self.inflight.sweep(now)
            if stale:
                self.log.info("inflight_swept", count=len(stale))

    # ------------------------------------------------------------- frontend
    def _on_frontend(self, frames: list[bytes]) -> None:
        client_id, env = frames[0], frames[1:]
        try:
            kind, sid, rid = check_envelope(env)
        except CodecError as exc:
            self.stats.bad_frames += 1
            self._warn.warning("bad_client_frame", client=client_id.hex(), error=str(exc))
            self._send_error(client_id, _readable_sid(env), _readable_rid(env), ErrorCode.BAD_REQUEST, str(exc))
            return
        if kind is MsgKind.HEARTBEAT:  # a ping, answered by the router itself
            self._send_client(client_id, pack_frames(self._pong(self._clients.get(client_id, touch=False) is not None), sid, rid))
            return
        if kind is MsgKind.CLIENT_HELLO:
            self._on_client_hello(client_id, env, rid)
            return
        if kind is MsgKind.AUTH_RESPONSE:
            self._on_client_response(client_id, env, rid)
            return
        if kind is MsgKind.WORKER_HELLO:
            self.stats.bad_frames += 1
            self._send_error(client_id, sid, rid, ErrorCode.BAD_REQUEST, "WORKER_HELLO belongs on the backend")
            return
        token = self._clients.get(client_id)
        if token is None:
            self.stats.unauthenticated += 1
            self._warn.warning("unauthenticated_request", client=client_id.hex()[:16])
            self._send_error(client_id, sid, rid, ErrorCode.UNAUTHENTICATED, "not authenticated: send CLIENT_HELLO")
            return
        self._dispatch(client_id, token, env, sid, rid)
        if kind is MsgKind.END_SESSION:
            self._copy_end(token, env, sid)

    def _copy_end(self, token: bytes, env: list[bytes], sid: str) -> None:
        """An END_SESSION to every live worker but the session's own (which has the original),
        and kept for the expired ones (sent if they come back: ``_send_owed_ends``)."""
        owner = self.registry.pick(sid)
        self.registry.ended(sid)
        for worker_id in self.registry.live:
            if worker_id != owner:
                self._send_copy(worker_id, token, env)
        self._copies.owe((token, env), time.monotonic())

    def _send_copy(self, worker_id: bytes, token: bytes, env: list[bytes]) -> None:
        rid = self._copies.next_id()
        try:
            send_frames(self._be, [worker_id, token, *env[:3], rid, env[4]])
        except zmq.ZMQError:
            return  # best effort: the worker's session TTL and LRU still bound what it holds
        self._copies.sent(rid, worker_id)
        self.stats.ends_copied += 1

    def _send_owed_ends(self, worker_id: bytes) -> None:
        """The ends of sessions a worker admitted again missed while it was expired."""
        for token, env in self._copies.back(worker_id, time.monotonic()):
            self._send_copy(worker_id, token, env)

    def _dispatch(self, client_id: bytes, token: bytes, env: list[bytes], sid: str, rid: bytes) -> None:
        """Forward to the session's worker; an unreachable worker is dropped and the next tried."""
        while True:
            worker_id = self.registry.pick(sid)
            if worker_id is None:
                self.stats.no_worker += 1
                self._send_error(client_id, sid, rid, ErrorCode.NO_WORKER, f"no live {self.service} worker")
                return
            if not self.inflight.add(Inflight(token, rid, sid, worker_id, time.monotonic(), client_id)):
                self.stats.overloaded += 1
                self._send_error(client_id, sid, rid, ErrorCode.OVERLOADED, "router in-flight table full")
                return
            try:
                send_frames(self._be, [worker_id, token, *env])
            except zmq.Again:
                self.inflight.pop(token, rid)
                self.stats.overloaded += 1
                self._send_error(client_id, sid, rid, ErrorCode.OVERLOADED, "worker queue full")
                return
            except zmq.ZMQError as exc:
                self.inflight.pop(token, rid)
                self._lose_worker(worker_id, f"send failed: {exc.strerror}")
                continue
            self.stats.routed += 1
            return

    # -------------------------------------------------------------- backend
    def _on_backend(self, frames: list[bytes]) -> None:
        worker_id = frames[0]
        known = self.registry.touch(worker_id, time.monotonic())
        if len(frames) < 2:
            self.stats.bad_frames += 1
            self._warn.warning("bad_worker_frame", worker=worker_id.hex(), nframes=len(frames))
            return
        token, env = frames[1], frames[2:]
        if not token:
            self._on_control(worker_id, env, known)
            return
        if not known:
            self._ask_hello(worker_id)
        rid = _readable_rid(env)
        if self._copies.acked(rid, worker_id):  # an END_SESSION copy's ack: nobody waits for it
            return
        entry = self.inflight.get(token, rid) if known else None
        if entry is None or entry.worker_id != worker_id:  # never sent to this worker: forged or stale
            self.stats.unsolicited_replies += 1
            self._warn.warning("unsolicited_reply_dropped", worker=worker_id.hex(), admitted=known)
            return
        self.inflight.pop(token, entry.request_id)
        try:
            _, sid, _ = check_envelope(env)
            if sid != entry.session_id:
                raise CodecError("reply for another session")
        except CodecError as exc:
            self.stats.bad_frames += 1
            self._warn.warning("bad_worker_reply", worker=worker_id.hex(), error=str(exc))
            msg = f"malformed reply from worker: {exc}"
            self._send_error(entry.route, entry.session_id, entry.request_id, ErrorCode.INTERNAL, msg)
            return
        self.stats.replies += 1
        self._send_client(entry.route, env)

    def _on_control(self, worker_id: bytes, env: list[bytes], known: bool) -> None:
        """Messages addressed to the router itself. WORKER_HELLO is the one body a router
        decodes: it is the worker's registration, addressed to the router, not a client's."""
        try:
            kind, _, rid = check_envelope(env)
        except CodecError as exc:
            self.stats.bad_frames += 1
            self._warn.warning("bad_control_frame", worker=worker_id.hex(), error=str(exc))
            return
        if kind is MsgKind.WORKER_HELLO:
            self._challenge_worker(worker_id, env, rid)
        elif kind is MsgKind.AUTH_RESPONSE:
            self._on_worker_response(worker_id, env, rid)
        elif kind is MsgKind.HEARTBEAT:
            if not known:
                self._ask_hello(worker_id)
        elif kind is MsgKind.ERROR:
            self._warn.warning("worker_sent_error", worker=worker_id.hex(), body_bytes=len(env[4]))
        else:
            self._warn.warning("unexpected_control", worker=worker_id.hex(), kind=kind.name)

    def _pong(self, authenticated: bool) -> Heartbeat:
        """A client's ping answered; to an authenticated client, the tokenizer the live workers
        serve (they all agree: ``WorkerRegistry.admit``), none while no worker is live."""
        live = self.registry.live
        info = self.registry.get(live[0]) if live and authenticated else None
        if info is None:
            return Heartbeat(sent_at=time.time())
        return Heartbeat(sent_at=time.time(), tokenizer_hash=info.hello.tokenizer_hash,
                         vocab_size=info.hello.vocab_size)

    # ------------------------------------------------------- worker loss/io
    def _lose_worker(self, worker_id: bytes, reason: str) -> None:
        if self.registry.remove(worker_id) is not None:
            self.stats.workers_lost += 1
            self.log.warning("worker_unreachable", worker=worker_id.hex(), reason=reason)
        self._fail_inflight(worker_id, reason)

    def _fail_inflight(self, worker_id: bytes, reason: str) -> None:
        """Answer everything in flight on a lost worker at once: NO_WORKER, retryable (PROTOCOL.md:
        "the worker died with the request in flight")."""
        lost = self.inflight.pop_worker(worker_id)
        for e in lost:
            msg = f"{self.service} worker lost ({reason}) with the request in flight"
            self._send_error(e.route, e.session_id, e.request_id, ErrorCode.NO_WORKER, msg, retryable=True)
        if lost:
            self.stats.inflight_failed += len(lost)
            self.log.warning("inflight_failed", worker=worker_id.hex(), count=len(lost), reason=reason)

    def _send_control(self, worker_id: bytes, msg: Message, rid: bytes) -> None:
        self._send_worker(worker_id, [b"", *pack_frames(msg, CONTROL_SID, rid)])

    def _send_worker(self, worker_id: bytes, frames: list[bytes]) -> None:
        try:
            send_frames(self._be, [worker_id, *frames])
        except zmq.Again:
            self._warn.warning("worker_send_dropped", worker=worker_id.hex(), reason="hwm")
        except zmq.ZMQError as exc:
            if worker_id in self.registry:
                self._lose_worker(worker_id, f"send failed: {exc.strerror}")

    def _send_error(
        self, client_id: bytes, sid: str, rid: bytes, code: ErrorCode, message: str, retryable: bool | None = None
    ) -> None:
        kw = {} if retryable is None else {"retryable": retryable}
        reply = ErrorReply.of(code, message, session_id=sid, **kw)
        self._send_client(client_id, pack_frames(reply, sid, rid))

    def _send_client(self, client_id: bytes, env: list[bytes]) -> None:
        try:
            send_frames(self._fe, [client_id, *env])
        except zmq.Again:
            self._warn.warning("client_send_dropped", client=client_id.hex(), reason="hwm")
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                self._warn.warning("client_send_failed", client=client_id.hex(), error=exc.strerror)
            elif client_id not in self._unreachable_logged:  # log once per vanished client
                self._unreachable_logged[client_id] = None
                while len(self._unreachable_logged) > _LRU_SIZE:
                    self._unreachable_logged.popitem(last=False)
                self.log.info("client_unreachable", client=client_id.hex())
