"""Async request/reply over one DEALER: futures matched by request id (vLLM-client style).

Frames: out ``[PROTO, kind, session_id, request_id, body]``; in the same layout, with the
request id echoed. The socket is a plain (non-blocking) pyzmq socket confined to the event
loop's thread: ``call`` sends at once and awaits a future; a reader callback on the socket's
file descriptor (``loop.add_reader``) drains every waiting reply and resolves the pending future
whose request id matches, so a reply costs one event-loop wake-up and no extra task switch
(zmq.asyncio's future machinery cost ~200 us of CPU per round trip here). ZMQ's descriptor is
edge-triggered: after every send the client checks ``EVENTS`` and drains if replies are waiting.
Any number of tasks on that loop may ``call`` concurrently.

Router liveness (opt-in, ``heartbeat_s``): the client pings the router every ``heartbeat_s`` and
watches its socket's connection events. A dropped connection (the router process died), or
``liveness`` heartbeats without any frame from the router (hung, partitioned), marks the router
lost (``router_lost``); requests in flight on a lost connection can never be answered, so each
pending call fails with ``RpcRouterLost`` (retryable: resend) as soon as the connection drops
and again when the router answers after being lost (``router_back``), so that nothing waits for
its timeout. A resent request may reach a worker twice; ``round`` makes that harmless.

CURVE (``curve``): the client watches its handshakes too. A router whose ZAP handler refuses this
process's key makes every pending and later call fail at once with ``RpcRefused`` (logged
``curve_refused``) until a handshake succeeds; other failed handshakes are logged.

Authentication (a router's clients, ``secret`` given; PROTOCOL.md, "Security model"): the
client connects with a random 16-byte routing id and proves the fleet secret once per
connection (CLIENT_HELLO -> AUTH_CHALLENGE, whose proof it checks -> AUTH_RESPONSE -> HEARTBEAT);
calls wait for that (within their timeout). When the router no longer knows the client (it
restarted, or the connection dropped), the client authenticates again and the calls in flight
fail with ``RpcRouterLost``: the router gives the client a new token, so its sessions on the
workers start afresh (CACHE_MISS, then the full context). Pings need no authentication.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import secrets
import time

import zmq
import zmq.asyncio

from brokers.curve import HANDSHAKE_FAILURES, CurveKeys, handshake_failure
from brokers import auth
from schemas.codec import CodecError, check_envelope, decode, pack_frames
from schemas.messages import AuthChallenge, AuthResponse, ClientHello, ErrorCode, ErrorReply, Heartbeat, Message
from specsplit.logs import get_logger
from specsplit.transport.sockets import DEFAULT_HWM, make_monitored_socket, make_socket, recv_frames, send_frames


class RpcError(Exception):
    """Base of transport-level failures (a typed ErrorReply from the peer is not one)."""


class RpcTimeout(RpcError, TimeoutError):
    """No reply within the timeout; the pending entry has been dropped."""

    def __init__(self, session_id: str, request_id: bytes, timeout_s: float) -> None:
        super().__init__(f"no reply for session {session_id!r} request {request_id.hex()} in {timeout_s:.3f}s")
        self.session_id, self.request_id, self.timeout_s = session_id, request_id, timeout_s


class RpcClosed(RpcError):
    """The client was closed while (or before) the call was waiting."""


class RpcRouterLost(RpcError):
    """The router was lost (connection dropped, or silent for liveness x heartbeat) while the
    call was waiting: its reply will never come. Retryable: resend (the worker's state is
    unknown, so with the full context)."""


class RpcRefused(RpcError):
    """The router refused this process's CURVE key (ZAP): no call can succeed until the key is
    admitted. Not retryable."""


class AsyncRpcClient:
    """Request/reply client of one router frontend.

    ``call`` returns the reply message (ErrorReply included: typed errors are values, not
    exceptions), raises ``RpcTimeout`` after ``timeout_s``, returns ``ErrorReply(OVERLOADED)``
    at once when ``max_pending`` calls are already waiting, and raises ``RpcClosed`` after
    ``close()``. Start it with ``await client.start()`` or ``async with`` (``call`` also starts it).
    """

    def __init__(
        self,
        addr: str,
        *,
        ctx: zmq.Context | None = None,
        identity: bytes | None = None,
        max_pending: int = 4096,
        default_timeout_s: float = 10.0,
        sndhwm: int = DEFAULT_HWM,
        rcvhwm: int = DEFAULT_HWM,
        name: str = "rpc",
        heartbeat_s: float | None = None,
        liveness: int = 3,
        curve: CurveKeys | None = None,
        secret: bytes | None = None,
    ) -> None:
        self.addr = addr
        self.curve = curve
        self.refused: str | None = None  # why the router refused our CURVE key (None: not refused)
        self._handshake_logged = 0.0
        self._secret = secret
        if secret and identity is None:  # unguessable, and never one ZeroMQ assigns (those are reused)
            identity = b"\x01" + secrets.token_bytes(15)
        self._authed = asyncio.Event()
        self._auth_task: asyncio.Task | None = None
        self._auth_epoch = 0  # successful authentications so far (a refusal of an older one is moot)
        self.auth_error = ""  # why the last authentication failed ("" after a success)
        self.max_pending = max_pending
        self.default_timeout_s = default_timeout_s
        # plain sockets on the same underlying context (an asyncio context is shadowed)
        base = ctx if ctx is not None else zmq.asyncio.Context.instance()
        self._ctx = zmq.Context.shadow(base.underlying)
        self._identity, self._hwm = identity, (sndhwm, rcvhwm)
        self._sock: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[bytes, asyncio.Future] = {}
        self._rids = itertools.count(random.getrandbits(48))
        self._closed = False
        self.heartbeat_s, self.liveness = heartbeat_s, liveness
        self._mon: zmq.Socket | None = None
        self._watchdog: asyncio.Task | None = None
        self._last_heard = time.monotonic()
        self.router_lost = False
        self.router_losses = 0  # times the router was lost (connection dropped or silent)
        self.fleet_tokenizer: Heartbeat = Heartbeat()  # the router's last ping answer (its workers' tokenizer)
        self.log = get_logger("specsplit.rpc", client=name, addr=addr)

    @property
    def pending(self) -> int:
        """Calls waiting for a reply."""
        return len(self._pending)

    async def start(self) -> None:
        self._ensure_started()

    async def __aenter__(self) -> AsyncRpcClient:
        self._ensure_started()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _ensure_started(self) -> None:
        if self._closed:
            raise RpcClosed(f"client of {self.addr} is closed")
        if self._sock is None:
            snd, rcv = self._hwm
            kw = dict(identity=self._identity, sndhwm=snd, rcvhwm=rcv, connect=self.addr, curve=self.curve)
            if self.heartbeat_s or self.curve is not None:
                events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILURES
                self._sock, self._mon = make_monitored_socket(self._ctx, zmq.DEALER, events, **kw)
            else:
                self._sock = make_socket(self._ctx, zmq.DEALER, **kw)
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._sock.FD, self._drain)
            if self._mon is not None:
                self._loop.add_reader(self._mon.FD, self._on_monitor)
                self._loop.call_soon(self._on_monitor)  # edge-triggered: drain what came before
            if self.heartbeat_s:
                self._last_heard = time.monotonic()
                self._watchdog = self._loop.create_task(self._watch())
            if self._secret:
                self._reauth()

    async def call(self, msg: Message, *, session_id: str, timeout_s: float | None = None) -> Message:
        """Send ``msg`` for ``session_id`` and wait for the reply with the same request id."""
        needs_auth = self._secret is not None and not isinstance(msg, Heartbeat)
        sent_under: list[int] = []
        reply = await self._call(msg, session_id, timeout_s, needs_auth, sent_under)
        if needs_auth and isinstance(reply, ErrorReply) and reply.code is ErrorCode.UNAUTHENTICATED:
            if sent_under == [self._auth_epoch]:  # not already authenticated again since it was sent
                self._reauth()  # the router forgot us (restarted, or dropped us): our sessions start afresh
            raise RpcRouterLost(f"router {self.addr} no longer knows this client")
        return reply

    async def _call(self, msg: Message, session_id: str, timeout_s: float | None, needs_auth: bool,
                    sent_under: list[int] | None = None) -> Message:
        self._ensure_started()
        if self.refused is not None:
            raise RpcRefused(self.refused)
        if len(self._pending) >= self.max_pending:
            why = f"client has max_pending={self.max_pending} calls waiting"
            return ErrorReply.of(ErrorCode.OVERLOADED, why, session_id=session_id)
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        rid = (next(self._rids) & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")
        frames = pack_frames(msg, session_id, rid)  # CodecError here is the caller's bug
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            async with asyncio.timeout(timeout_s):
                if needs_auth and not self._authed.is_set():
                    # wait for authentication, or for the call to fail first (a refused CURVE key)
                    authed = asyncio.ensure_future(self._authed.wait())
                    try:
                        await asyncio.wait({authed, fut}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        authed.cancel()
                    if fut.done():
                        return fut.result()
                if sent_under is not None:
                    sent_under.append(self._auth_epoch)
                await self._send(frames)
                return await fut
        except TimeoutError:
            raise RpcTimeout(session_id, rid, timeout_s) from None
        except zmq.ZMQError as exc:  # the socket went away under us (close() from another task)
            raise (RpcClosed if self._closed else RpcError)(f"send failed: {exc}") from exc
        finally:
            self._pending.pop(rid, None)

    async def ping(self, timeout_s: float = 1.0) -> Message:
        """Round trip to the router itself (a HEARTBEAT it answers): readiness by handshake."""
        return await self.call(Heartbeat(), session_id="-", timeout_s=timeout_s)

    # ---- authentication ----------------------------------------------------------------------
    def _reauth(self) -> None:
        """(Re)start the handshake unless one is running; calls wait until it succeeds."""
        self._authed.clear()
        if self._loop is not None and (self._auth_task is None or self._auth_task.done()):
            self._auth_task = self._loop.create_task(self._authenticate())

    async def _authenticate(self) -> None:
        """Prove the fleet secret to the router (after checking its proof), retrying with back-off."""
        delay = 0.05
        while not self._closed:
            try:
                if await self._handshake():
                    return
            except RpcError as exc:
                self.auth_error = f"{type(exc).__name__}: {exc}"
            self.log.warning("rpc_auth_failed", reason=self.auth_error, retry_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _handshake(self) -> bool:
        nonce, timeout = auth.new_nonce(), self.default_timeout_s
        challenge = await self._call(ClientHello(nonce=nonce), "-", timeout, needs_auth=False)
        if not isinstance(challenge, AuthChallenge):
            self.auth_error = f"no challenge: {challenge!r}"[:200]
            return False
        if not auth.same(challenge.proof, auth.router_proof(self._secret, nonce, challenge.nonce, self._identity)):
            self.auth_error = "the router could not prove the fleet secret"
            return False
        mac = auth.client_response(self._secret, challenge.nonce, nonce, self._identity)
        done = await self._call(AuthResponse(mac=mac), "-", timeout, needs_auth=False)
        if not isinstance(done, Heartbeat):
            self.auth_error = f"refused: {done!r}"[:200]
            return False
        self.auth_error = ""
        self._auth_epoch += 1
        self._authed.set()
        self.log.info("rpc_authenticated")
        return True

    async def close(self) -> None:
        """Stop the reader, fail every pending call with ``RpcClosed``, close the socket."""
        if self._closed:
            return
        self._closed = True
        if self._auth_task is not None:
            self._auth_task.cancel()
            await asyncio.gather(self._auth_task, return_exceptions=True)
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        if self._sock is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.FD)
            if self._mon is not None:
                self._loop.remove_reader(self._mon.FD)
        if self._mon is not None:
            self._sock.disable_monitor()
            self._mon.close(linger=0)
            self._mon = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(RpcClosed(f"client of {self.addr} closed"))
        self._pending.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _send(self, frames: list[bytes]) -> None:
        """Send without blocking the loop; at the high-water mark, retry until the caller's timeout."""
        while True:
            if self._sock is None:
                raise RpcClosed(f"client of {self.addr} is closed")
            try:
                send_frames(self._sock, frames)
                break
            except zmq.Again:
                await asyncio.sleep(0.001)
        # the send may have consumed the descriptor's edge for replies already waiting
        if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        """The one reader of the socket (a loop callback): resolve futures by request id until no
        reply is waiting; never dies of a frame."""
        sock = self._sock
        while sock is not None and not self._closed:
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self.log.error("rpc_recv_failed", error=str(exc))
                return
            try:
                self._dispatch(frames)
            except Exception:  # a bug, not a frame problem: keep reading
                self.log.exception("rpc_dispatch_failed")

    # ---- router liveness -------------------------------------------------------------------
    async def _watch(self) -> None:
        """Ping the router every heartbeat; mark it lost after liveness beats of silence."""
        hb = self.heartbeat_s
        while not self._closed:
            await asyncio.sleep(hb)
            if len(self._pending) < self.max_pending:
                ping = self._loop.create_task(self.call(Heartbeat(sent_at=time.time()), session_id="-",
                                                        timeout_s=hb * self.liveness))
                ping.add_done_callback(_retrieve)
            if not self.router_lost and time.monotonic() - self._last_heard > hb * self.liveness:
                self._drain()  # a busy loop may not have read what is waiting: that is not silence
                if time.monotonic() - self._last_heard > hb * self.liveness:
                    self._lose_router("silent")

    def _on_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self._mon is not None:
            try:
                msg = recv_monitor_message(self._mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self.log.warning("rpc_monitor_failed", error=str(exc))
                return
            event = msg["event"]
            if event == zmq.EVENT_DISCONNECTED:
                if self.heartbeat_s:
                    self._lose_router("disconnected")
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self.refused is not None:
                    self.log.info("curve_admitted")
                    self.refused = None
                if self.router_lost:
                    self._router_back("reconnected")
            elif (why := handshake_failure(event, msg["value"], self.addr)) is not None:
                self._on_handshake_failed(event, why)

    def _on_handshake_failed(self, event: int, why: str) -> None:
        if event != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if time.monotonic() - self._handshake_logged >= 1.0:  # zmq retries every ~100 ms
                self._handshake_logged = time.monotonic()
                self.log.error("curve_handshake_failed", reason=why)
            return
        if self.refused is None:
            self.log.error("curve_refused", reason=why)
        self.refused = why
        for rid, fut in [(r, f) for r, f in self._pending.items() if not f.done()]:
            self._pending.pop(rid, None)
            fut.set_exception(RpcRefused(why))

    def _lose_router(self, why: str) -> None:
        if not self.router_lost:
            self.router_lost = True
            self.router_losses += 1
            self.log.warning("router_lost", reason=why, pending=len(self._pending))
        if why == "disconnected":  # replies to what was sent on that connection will never come
            self._fail_pending(why)

    def _router_back(self, why: str) -> None:
        self.router_lost = False
        if self._secret and why == "reconnected":  # a new connection: maybe a new router, prove it again
            self._reauth()
        self.log.info("router_back", reason=why, pending=len(self._pending))
        self._fail_pending(f"router back ({why})")  # sent while it was away: maybe never delivered

    def _fail_pending(self, why: str) -> None:
        pending = [(rid, fut) for rid, fut in self._pending.items() if not fut.done()]
        for rid, fut in pending:
            self._pending.pop(rid, None)
            fut.set_exception(RpcRouterLost(f"router {self.addr} lost: {why}"))

    def _dispatch(self, frames: list[bytes]) -> None:
        self._last_heard = time.monotonic()
        try:
            self._resolve(frames)
        finally:
            if self.router_lost:  # after resolving the reply that proved it back
                self._router_back("answered")

    def _resolve(self, frames: list[bytes]) -> None:
        try:
            kind, sid, rid = check_envelope(frames)
        except CodecError as exc:
            self.log.warning("bad_reply_dropped", error=str(exc), nframes=len(frames))
            return
        fut = self._pending.pop(rid, None)
        if fut is None or fut.done():
            self.log.debug("late_reply_dropped", session_id=sid, request_id=rid.hex(), kind=kind.name)
            return
        try:
            msg = decode(kind, frames[4])
        except CodecError as exc:
            # the caller is waiting for exactly this request id: fail it now, not at its timeout
            self.log.warning("bad_reply_body", session_id=sid, kind=kind.name, error=str(exc))
            msg = ErrorReply.of(ErrorCode.INTERNAL, f"malformed reply: {exc}", retryable=False, session_id=sid)
        if isinstance(msg, Heartbeat) and sid == "-":
            self.fleet_tokenizer = msg
        fut.set_result(msg)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # a lost ping is what the watchdog measures, not an error
