"""The fleet secret and the HMAC challenge-response every router peer passes (PROTOCOL.md,
"Security model"). Plain functions and bounded tables, no sockets: imports stdlib only.

Every process of a fleet reads one secret: ``SPECSPLIT_FLEET_SECRET`` when set, otherwise the
file ``SPECSPLIT_FLEET_SECRET_FILE`` (default ``$XDG_CACHE_HOME/specsplit/fleet.secret``, i.e.
``~/.cache/specsplit/fleet.secret``), created with mode 0600 by the first process that needs it.
The secret never travels: peers prove it with HMAC-SHA256 over fresh nonces.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

MIN_SECRET_BYTES = 16
NONCE_HEX = 32  # 128-bit nonces
MIN_CLIENT_ID_BYTES = 16  # router clients connect with a random routing id of at least this length
_LABELS = {"router": b"SPS1 router proof", "client": b"SPS1 client response", "worker": b"SPS1 worker response"}


class SecretError(RuntimeError):
    """The fleet secret cannot be read or made (a configuration error: the process must not start)."""


def default_secret_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specsplit" / "fleet.secret"


def load_fleet_secret(secret: str | None = None, path: str | os.PathLike | None = None) -> bytes:
    """The fleet secret: ``secret`` when given (at least 16 bytes), else the file at ``path``
    (default ``default_secret_path()``), created atomically with mode 0600 if missing. A file
    that others may read or write is refused."""
    if secret:
        raw = secret.encode()
        if len(raw) < MIN_SECRET_BYTES:
            raise SecretError(f"the fleet secret must be at least {MIN_SECRET_BYTES} bytes")
        return raw
    p = Path(path) if path else default_secret_path()
    if not p.exists():
        _create_secret_file(p)
    try:
        st = p.stat()
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(f"{p}: the fleet secret file must not be accessible to others (chmod 600)")
        raw = p.read_bytes().strip()
    except OSError as exc:
        raise SecretError(f"{p}: cannot read the fleet secret: {exc.strerror}") from exc
    if len(raw) < MIN_SECRET_BYTES:
        raise SecretError(f"{p}: the fleet secret must be at least {MIN_SECRET_BYTES} bytes")
    return raw


def _create_secret_file(p: Path) -> None:
    """Write a fresh secret to a private temporary file, then link it into place: processes
    starting together either create it or read the complete file another one created."""
    try:
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
        finally:
            os.close(fd)
        try:
            os.link(tmp, p)
        except FileExistsError:
            pass  # another process of the fleet made it first: use theirs
        finally:
            os.unlink(tmp)
    except OSError as exc:
        raise SecretError(f"{p}: cannot create the fleet secret: {exc.strerror}") from exc


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def good_nonce(nonce: str) -> bool:
    return len(nonce) >= NONCE_HEX


def good_client_id(client_id: bytes) -> bool:
    """A routing id a router accepts from a client: random, not one ZeroMQ assigned (those are
    5 bytes starting with a zero byte, sequential and reused after a router restart)."""
    return len(client_id) >= MIN_CLIENT_ID_BYTES and client_id[0] != 0


def mac(secret: bytes, label: str, *parts: bytes | str) -> str:
    """HMAC-SHA256 (hex) of ``label`` and ``parts``, each length-prefixed (no ambiguity)."""
    h = hmac.new(secret, _LABELS[label], hashlib.sha256)
    for part in parts:
        b = part.encode() if isinstance(part, str) else bytes(part)
        h.update(len(b).to_bytes(4, "big"))
        h.update(b)
    return h.hexdigest()


def router_proof(secret: bytes, peer_nonce: str, router_nonce: str, peer_id: bytes) -> str:
    return mac(secret, "router", peer_nonce, router_nonce, peer_id)


def client_response(secret: bytes, router_nonce: str, client_nonce: str, client_id: bytes) -> str:
    return mac(secret, "client", router_nonce, client_nonce, client_id)


def worker_response(secret: bytes, router_nonce: str, worker_nonce: str, worker_id: bytes, hello_body: bytes) -> str:
    return mac(secret, "worker", router_nonce, worker_nonce, worker_id, hello_body)


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


@dataclass(frozen=True, slots=True)
class Challenge:
    """What a router remembers of a challenge it sent: both nonces and, for a worker, its hello
    (the decoded message and its exact body bytes) and the hello's request id."""

    router_nonce: str
    peer_nonce: str
    sent_at: float
    hello: object = None
    hello_body: bytes = b""
    request_id: bytes = b""


class BoundedTable:
    """identity -> value, at most ``max_entries`` (least recently used dropped first), entries
    idle longer than ``ttl_s`` dropped on access. Plain state: the router's thread owns it."""

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._items: OrderedDict[bytes, tuple[float, object]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: bytes, value: object, now: float | None = None) -> None:
        self._items[key] = (time.monotonic() if now is None else now, value)
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, key: bytes, now: float | None = None, touch: bool = True):
        item = self._items.get(key)
        if item is None:
            return None
        now = time.monotonic() if now is None else now
        if now - item[0] > self.ttl_s:
            del self._items[key]
            return None
        if touch:
            self._items[key] = (now, item[1])
            self._items.move_to_end(key)
        return item[1]

    def pop(self, key: bytes, now: float | None = None):
        value = self.get(key, now, touch=False)
        self._items.pop(key, None)
        return value
