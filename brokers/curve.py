"""CURVE for off-box fleets: key files, the ZAP authenticator, handshake failures. Imports zmq only.

A fleet beyond loopback encrypts and authenticates every socket with CurveZMQ. Each process has
a keypair (``specsplit keys new``: ``NAME.key`` holds the public key, ``NAME.key_secret`` both,
mode 0600; the ``zmq.auth`` certificate format). A server (router frontend/backend, the
orchestrator's producer frontend) admits only the public keys it is given, through a ZAP handler
(``zmq.auth.thread.ThreadAuthenticator``) that ``brokers.sockets.make_socket`` starts on the
socket's context before the first CURVE bind, so a CURVE server never runs without one (libzmq
admits every client when no ZAP handler is bound). A client needs the server's public key.

Refusals are clear on both sides: the server logs ``curve_key_refused`` with the client's public
key; the client's socket monitor reports ``EVENT_HANDSHAKE_FAILED_AUTH`` (ZAP status 400), which
``handshake_failure`` turns into a message naming the setting to fix.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from brokers.logs import get_logger

Z85_KEY_CHARS = 40  # a 32-byte Curve25519 key in Z85
# the monitor events that end a CURVE handshake unsuccessfully (libzmq >= 4.3)
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
SETTINGS_HINT = ("SPECSPLIT_CURVE_SECRET_KEY_FILE (this process's keypair), SPECSPLIT_CURVE_SERVER_KEY (clients: the "
                 "servers' public key), SPECSPLIT_CURVE_AUTHORIZED_KEYS (servers: admitted public keys); "
                 "make keys with `specsplit keys new`")


class CurveError(ValueError):
    """A CURVE key or setting is missing, malformed or unsafe; the message names which."""


class CurveRequired(CurveError):
    """A socket beyond loopback without CURVE keys."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """One process's CURVE material, all keys Z85 bytes. ``server_key``: the public key of the
    servers this process connects to (clients). ``authorized``: the public keys this process's
    server sockets admit (servers)."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    server_key: bytes | None = None
    authorized: frozenset[bytes] | None = None


def check_key(key: bytes | str, what: str) -> bytes:
    """``key`` as Z85 bytes, or CurveError when it is not a 40-character Z85 Curve25519 key."""
    raw = key.encode("ascii", "replace") if isinstance(key, str) else bytes(key)
    raw = raw.strip()
    if len(raw) != Z85_KEY_CHARS:
        raise CurveError(f"{what}: a CURVE key is {Z85_KEY_CHARS} Z85 characters, got {len(raw)}")
    try:
        z85.decode(raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise CurveError(f"{what}: not a Z85 key ({exc})") from None
    return raw


def load_keypair(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) from a ``*.key_secret`` certificate; refuses a file others can read."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise CurveError(f"SPECSPLIT_CURVE_SECRET_KEY_FILE: cannot read {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CurveError(f"SPECSPLIT_CURVE_SECRET_KEY_FILE: {path} is accessible by group/others "
                         f"(mode {stat.S_IMODE(mode):o}); chmod 600 it")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveError(f"SPECSPLIT_CURVE_SECRET_KEY_FILE: {path}: {exc}") from None
    if secret is None:
        raise CurveError(f"SPECSPLIT_CURVE_SECRET_KEY_FILE: {path} holds no secret-key (a public .key file?)")
    return check_key(public, f"{path} public-key"), check_key(secret, f"{path} secret-key")


def load_public_key(value: str, what: str = "SPECSPLIT_CURVE_SERVER_KEY") -> bytes:
    """A public key given as Z85 text or as the path of a certificate file (``NAME.key``)."""
    value = value.strip()
    if len(value) == Z85_KEY_CHARS and not Path(value).exists():
        return check_key(value, what)
    try:
        public, _ = zmq.auth.load_certificate(value)
    except (OSError, ValueError) as exc:
        raise CurveError(f"{what}: neither a {Z85_KEY_CHARS}-character Z85 key nor a readable key file: {exc}") from None
    return check_key(public, f"{what} ({value})")


def load_authorized_keys(path: str | os.PathLike) -> frozenset[bytes]:
    """Admitted public keys: a directory of ``*.key`` certificates, or a text file with one Z85
    key at the start of each line (text after it, blank lines and ``#`` comment lines are
    ignored). An empty set is refused."""
    path, what = Path(path), "SPECSPLIT_CURVE_AUTHORIZED_KEYS"
    keys: set[bytes] = set()
    if path.is_dir():
        for cert in sorted(path.glob("*.key")):
            keys.add(load_public_key(str(cert), f"{what} ({cert.name})"))
    else:
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise CurveError(f"{what}: cannot read {path}: {exc.strerror}") from None
        for n, line in enumerate(lines, 1):
            words = line.split()  # the key, then anything (a comment); Z85 itself may hold '#'
            if not words or (words[0].startswith("#") and len(words[0]) != Z85_KEY_CHARS):
                continue  # blank, or a comment line
            keys.add(check_key(words[0], f"{what} {path}:{n}"))
    if not keys:
        raise CurveError(f"{what}: no public keys in {path} (a directory of *.key files or one Z85 key a line)")
    return frozenset(keys)


def write_keypair(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (0600, created with that mode)
    in ``directory`` (made 0700 if missing); never overwrites. Returns (public, secret) paths."""
    if not name or "/" in name or name.startswith("."):
        raise CurveError(f"key name {name!r}: use a plain file name")
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    for p in (public_path, secret_path):
        if p.exists():
            raise CurveError(f"{p} exists; refusing to overwrite a key")
    public, secret = (k.decode("ascii") for k in zmq.curve_keypair())
    def body(kind: str) -> str:  # (Z85 keys may hold braces: no str.format on them)
        return f"# SpecSplit CURVE {kind} ({name}); zmq.auth certificate format\ncurve\n    public-key = \"{public}\"\n"

    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(body("secret key: keep it private") + f"    secret-key = \"{secret}\"\n")
    fd = os.open(public_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(body("public key"))
    return public_path, secret_path


def handshake_failure(event: int, value: int, addr: str) -> str | None:
    """A clear message for a failed CURVE handshake monitor event (None for other events)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"{addr} refused this process's CURVE key (ZAP status {value}): add its public key to the "
                f"server's SPECSPLIT_CURVE_AUTHORIZED_KEYS")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return (f"CURVE handshake with {addr} failed (protocol error {value:#x}): one side has CURVE off, or "
                f"the keys do not match")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (f"CURVE handshake with {addr} failed: is SPECSPLIT_CURVE_SERVER_KEY the server's public key, "
                f"and does the server use CURVE?")
    return None


# ---- the ZAP handler: one per context, started by make_socket before a CURVE server socket --------
class _Admit:
    """ZAP credentials provider: admits listed public keys, logs every refusal."""

    def __init__(self, authorized: frozenset[bytes]) -> None:
        self.authorized = authorized
        self.refused = 0
        self.log = get_logger("brokers.curve")

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.authorized:
            return True
        self.refused += 1
        self.log.warning("curve_key_refused", public_key=key.decode("ascii", "replace"), domain=domain or "*")
        return False


@dataclass
class _Zap:
    auth: ThreadAuthenticator
    admit: _Admit
    sockets: int = 0


_zaps: dict[int, _Zap] = {}
_zap_lock = threading.Lock()


def acquire_zap(ctx: zmq.Context, authorized: frozenset[bytes]) -> None:
    """Make sure a ZAP handler admitting ``authorized`` serves ``ctx``; counts one more server
    socket on it (``release_zap`` once per socket closed; the last one stops the handler). One
    key set per context: a different one is refused rather than silently merged."""
    if not authorized:
        raise CurveError("a CURVE server needs admitted public keys: set SPECSPLIT_CURVE_AUTHORIZED_KEYS")
    with _zap_lock:
        zap = _zaps.get(ctx.underlying)
        if zap is not None and not zap.auth.is_alive():
            zap = None  # its context was terminated
        if zap is None:
            admit = _Admit(frozenset(authorized))
            auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
            auth.start()
            auth.configure_curve_callback("*", credentials_provider=admit)
            zap = _zaps[ctx.underlying] = _Zap(auth, admit)
        elif zap.admit.authorized != authorized:
            raise CurveError("this context's ZAP handler already admits another key set")
        zap.sockets += 1


def release_zap(ctx: zmq.Context) -> None:
    """One CURVE server socket on ``ctx`` is closed; the last one stops the ZAP handler (which
    must happen before ``ctx.term()``: its thread holds sockets on the context)."""
    with _zap_lock:
        zap = _zaps.get(ctx.underlying)
        if zap is None:
            return
        zap.sockets -= 1
        if zap.sockets > 0:
            return
        del _zaps[ctx.underlying]
    zap.auth.stop()


def refused_count(ctx: zmq.Context) -> int:
    """Client keys this context's ZAP handler has refused (0 without one)."""
    zap = _zaps.get(ctx.underlying)
    return zap.admit.refused if zap is not None else 0
