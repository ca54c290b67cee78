"""The one socket factory: every ZeroMQ socket in SpecSplit is made by ``make_socket``.

It sets what the project relies on, explicitly, for every socket: linger (0: closing never
blocks), send/receive high-water marks, the identity, and ROUTER_MANDATORY / ROUTER_HANDOVER on
ROUTER sockets, and CURVE (brokers.curve): a socket beyond loopback is refused without CURVE
keys; with them, a binding socket is a CURVE server behind the context's ZAP handler and a
connecting one a CURVE client. It works for ``zmq.Context`` and ``zmq.asyncio.Context`` alike
(the context's ``socket()`` picks the socket class). Imports zmq only.
"""

from __future__ import annotations

import ipaddress
from typing import Callable
from urllib.parse import urlsplit

import zmq

from brokers.curve import SETTINGS_HINT, CurveError, CurveKeys, CurveRequired, acquire_zap, release_zap

DEFAULT_HWM = 10_000
MAX_IDENTITY_BYTES = 255

# The hot path skips pyzmq's Python "sugar" layer: its send_multipart/recv_multipart do IntFlag
# arithmetic and an option lookup per frame, which cost more than calling the Cython socket
# directly (docs/results.md, 3c91a23). Frames are always bytes built or received by SpecSplit itself.
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_raw_send = zmq.backend.Socket.send
_raw_recv = zmq.backend.Socket.recv
_raw_get = zmq.backend.Socket.get


def send_frames(sock: zmq.Socket, frames: list[bytes], flags: int = _NOBLOCK) -> None:
    """``sock.send_multipart(frames, flags)`` without the sugar (frames must be bytes-like). A
    multipart message is atomic in ZeroMQ: Again / EHOSTUNREACH can only come at the first frame."""
    last = len(frames) - 1
    more = _SNDMORE | flags
    for i, frame in enumerate(frames):
        _raw_send(sock, frame, more if i < last else flags)


def recv_frames(sock: zmq.Socket, flags: int = _NOBLOCK) -> list[bytes]:
    """``sock.recv_multipart(flags)`` without the sugar; raises ``zmq.Again`` when nothing waits."""
    parts = [_raw_recv(sock, flags)]
    while _raw_get(sock, _RCVMORE):
        parts.append(_raw_recv(sock, flags))
    return parts


def make_socket(
    ctx: zmq.Context,
    zmq_type: int,
    *,
    identity: bytes | None = None,
    sndhwm: int = DEFAULT_HWM,
    rcvhwm: int = DEFAULT_HWM,
    linger: int = 0,
    router_mandatory: bool | None = None,
    router_handover: bool = False,
    bind: str | None = None,
    connect: str | None = None,
    curve: CurveKeys | None = None,
    before_connect: Callable[[zmq.Socket], None] | None = None,
) -> zmq.Socket:
    """Create a socket of ``zmq_type`` on ``ctx`` with every option set explicitly.

    router_mandatory defaults to True for ROUTER sockets (a send to an unknown or vanished peer
    raises ``EHOSTUNREACH`` instead of being dropped silently) and must be left unset for other
    types; router_handover (a reconnecting peer with the same identity takes the identity over)
    is for ROUTER sockets only. ``bind`` / ``connect`` are applied last (``before_connect`` is
    called with the socket just before them); on any failure the socket is closed before the
    error propagates.

    ``curve`` (None: no CURVE, loopback addresses only, else ``CurveRequired``): with ``bind`` the
    socket is a CURVE server admitting ``curve.authorized`` (the caller calls
    ``brokers.curve.release_zap(ctx)`` after closing it); with ``connect`` a CURVE client of the
    server whose public key is ``curve.server_key``.
    """
    is_router = zmq_type == zmq.ROUTER
    if not is_router and (router_mandatory or router_handover):
        raise ValueError("router_mandatory / router_handover apply to ROUTER sockets only")
    if identity is not None:
        _check_identity(identity)
    server = _check_curve(curve, bind, connect)
    if server:
        acquire_zap(ctx, curve.authorized)  # before the socket exists: never a CURVE server without ZAP
    try:
        sock = ctx.socket(zmq_type)
    except BaseException:
        if server:
            release_zap(ctx)
        raise
    try:
        sock.setsockopt(zmq.LINGER, int(linger))
        sock.setsockopt(zmq.SNDHWM, int(sndhwm))
        sock.setsockopt(zmq.RCVHWM, int(rcvhwm))
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if is_router:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0 if router_mandatory is False else 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1 if router_handover else 0)
        if curve is not None:
            _set_curve(sock, curve, server)
        if before_connect is not None:
            before_connect(sock)
        if bind is not None:
            sock.bind(bind)
        if connect is not None:
            sock.connect(connect)
    except BaseException:
        sock.close(linger=0)
        if server:
            release_zap(ctx)
        raise
    return sock


def make_monitored_socket(ctx: zmq.Context, zmq_type: int, events: int, **kw) -> tuple[zmq.Socket, zmq.Socket]:
    """``make_socket(ctx, zmq_type, **kw)`` and a monitor socket of its ``events``, attached before
    it connects: a handshake that fails at once is reported, never missed (libzmq does not retry
    after a refused CURVE key, so a missed refusal would leave the socket silent for good)."""
    monitors: list[zmq.Socket] = []
    try:
        sock = make_socket(ctx, zmq_type, before_connect=lambda s: monitors.append(s.get_monitor_socket(events)), **kw)
    except BaseException:
        for mon in monitors:
            mon.close(linger=0)
        raise
    return sock, monitors[0]


def _check_curve(curve: CurveKeys | None, bind: str | None, connect: str | None) -> bool:
    """Refuse what CURVE policy forbids; True when the socket will be a CURVE server."""
    if curve is None:
        for verb, addr in (("binding", bind), ("connecting", connect)):
            if addr is not None and not is_loopback_address(addr):
                raise CurveRequired(f"{addr}: {verb} beyond loopback requires CURVE keys: {SETTINGS_HINT}")
        return False
    if (bind is None) == (connect is None):
        raise ValueError("a CURVE socket needs exactly one of bind / connect (server or client)")
    if bind is not None and not curve.authorized:
        raise CurveError(f"{bind}: a CURVE server needs admitted public keys: set SPECSPLIT_CURVE_AUTHORIZED_KEYS")
    if connect is not None and curve.server_key is None:
        raise CurveError(f"{connect}: a CURVE client needs the server's public key: set SPECSPLIT_CURVE_SERVER_KEY")
    return bind is not None


def _set_curve(sock: zmq.Socket, curve: CurveKeys, server: bool) -> None:
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
    if server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)


def _check_identity(identity: bytes) -> None:
    if not isinstance(identity, bytes):
        raise TypeError(f"identity must be bytes, got {type(identity).__name__}")
    if not 1 <= len(identity) <= MAX_IDENTITY_BYTES:
        raise ValueError(f"identity must be 1..{MAX_IDENTITY_BYTES} bytes")
    if identity[0] == 0:
        raise ValueError("identities starting with a zero byte are reserved by ZeroMQ")


def endpoint(sock: zmq.Socket) -> str:
    """The address a socket last bound to (resolves ``tcp://127.0.0.1:*`` to the real port)."""
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def is_loopback_address(addr: str) -> bool:
    """True for ipc://, inproc:// and tcp:// addresses on a loopback host (127/8, ::1, localhost)."""
    parts = urlsplit(addr)
    if parts.scheme in ("ipc", "inproc"):
        return True
    if parts.scheme != "tcp":
        return False
    host = parts.netloc.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name
        return False
