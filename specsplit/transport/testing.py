"""Test and benchmark helpers: an echo handler and a router / worker loop run in a thread.

Not used by production code paths; lives here so that transport, orchestrator and ops tests
share one way of standing up a router with workers on loopback (no torch).
"""

from __future__ import annotations

import secrets
import threading
import time

import zmq

from brokers import auth
from brokers.router import Router
from schemas.codec import MsgKind, decode, pack_frames
from schemas.messages import (
    Ack,
    AuthResponse,
    ClientHello,
    CacheSync,
    DraftReply,
    DraftRequest,
    EndSession,
    ErrorCode,
    ErrorReply,
    FlatTree,
    Heartbeat,
    Message,
    VerifyReply,
    VerifyRequest,
    WorkerHello,
)
from specsplit.transport.sockets import make_socket
from specsplit.transport.worker_loop import Handler, WorkerLoop

TEST_SECRET = b"specsplit-test-fleet-secret-0123456789"  # the in-process test fleets' secret


def client_id() -> bytes:
    """A routing id a router accepts from a client (random, 16 bytes, not ZeroMQ-assigned)."""
    return b"\x01" + secrets.token_bytes(15)


def authenticate(sock: zmq.Socket, secret: bytes = TEST_SECRET, timeout_ms: int = 15_000) -> list[bytes]:
    """Run a router client's handshake on a blocking DEALER made with ``identity=client_id()``;
    returns the router's final frames (HEARTBEAT when accepted, ERROR when refused)."""
    me = sock.getsockopt(zmq.IDENTITY)
    nonce = auth.new_nonce()
    sock.send_multipart(pack_frames(ClientHello(nonce=nonce), "-", b"auth-1"))
    if not sock.poll(timeout_ms):
        raise TimeoutError("no challenge")
    frames = sock.recv_multipart()
    if frames[1] != MsgKind.AUTH_CHALLENGE.as_byte():
        return frames
    challenge = decode(frames[1], frames[4])
    mac = auth.client_response(secret, challenge.nonce, nonce, me)
    sock.send_multipart(pack_frames(AuthResponse(mac=mac), "-", b"auth-2"))
    if not sock.poll(timeout_ms):
        raise TimeoutError("no answer to the auth response")
    return sock.recv_multipart()


def hello_raw_worker(sock: zmq.Socket, hello: WorkerHello | None = None, secret: bytes = TEST_SECRET,
                     timeout_ms: int = 15_000) -> list[bytes]:
    """Run a worker's hello and handshake on a blocking DEALER at a router backend (made with
    the worker's identity); returns the router's final control frames (HEARTBEAT: admitted)."""
    me = sock.getsockopt(zmq.IDENTITY)
    nonce = auth.new_nonce()
    frames = pack_frames((hello or make_hello()).model_copy(update={"nonce": nonce}), "-", b"hello-1")
    sock.send_multipart([b"", *frames])
    while True:
        if not sock.poll(timeout_ms):
            raise TimeoutError("no answer to the hello")
        reply = sock.recv_multipart()
        if reply[0] == b"" and reply[4] == b"hello-1":
            break
    if reply[2] != MsgKind.AUTH_CHALLENGE.as_byte():
        return reply
    challenge = decode(reply[2], reply[5])
    mac = auth.worker_response(secret, challenge.nonce, nonce, me, frames[4])
    sock.send_multipart([b"", *pack_frames(AuthResponse(mac=mac), "-", b"hello-1")])
    while True:
        if not sock.poll(timeout_ms):
            raise TimeoutError("no answer to the auth response")
        reply = sock.recv_multipart()
        if reply[0] == b"" and reply[4] == b"hello-1":
            return reply


def authed_dealer(ctx: zmq.Context, addr: str, secret: bytes = TEST_SECRET) -> zmq.Socket:
    """A blocking DEALER connected to a router frontend and authenticated."""
    sock = make_socket(ctx, zmq.DEALER, identity=client_id(), connect=addr)
    frames = authenticate(sock, secret)
    if frames[1] != MsgKind.HEARTBEAT.as_byte():
        sock.close(linger=0)
        raise RuntimeError(f"not authenticated: {frames!r}")
    return sock


class EchoHandler:
    """A no-op engine. VerifyRequest -> VerifyReply accepting the first ``accept`` non-root nodes
    (cache_len = ``tag``, so tests can tell workers apart); DraftRequest -> a root-only tree;
    EndSession -> Ack. ``delay_s`` simulates a forward; ``calls`` counts handled requests."""

    def __init__(self, tag: int = 0, delay_s: float = 0.0, accept: int = 3) -> None:
        self.tag, self.delay_s, self.accept = tag, delay_s, accept
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, msg: Message) -> Message:
        with self._lock:
            self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if isinstance(msg, VerifyRequest):
            ids = msg.tree.token_ids[1 : 1 + self.accept]
            return VerifyReply(
                session_id=msg.session_id,
                round=msg.round,
                accepted_token_ids=ids,
                accepted_nodes=list(range(1, 1 + len(ids))),
                bonus_token_id=msg.tree.token_ids[0],
                cache_len=self.tag,
            )
        if isinstance(msg, DraftRequest):
            tree = FlatTree(token_ids=[msg.root], parents=[-1], draft_logprobs=[0.0])
            return DraftReply(session_id=msg.session_id, round=msg.round, tree=tree, draft_ms=float(self.tag))
        if isinstance(msg, EndSession):
            return Ack(session_id=msg.session_id, existed=False)
        return ErrorReply.of(ErrorCode.BAD_REQUEST, f"echo handler does not serve {type(msg).__name__}")


def make_verify(session_id: str, round_: int = 0) -> VerifyRequest:
    """A small, valid VerifyRequest (a 4-node tree) for transport tests."""
    tree = FlatTree(token_ids=[5, 6, 7, 8], parents=[-1, 0, 1, 1])
    return VerifyRequest(session_id=session_id, round=round_, sync=CacheSync(base_len=0), tree=tree)


def make_hello(service: str = "target", *, vocab_size: int = 1000, tokenizer_hash: str = "tok", **kw) -> WorkerHello:
    return WorkerHello(service=service, model_id=kw.pop("model_id", "echo"), vocab_size=vocab_size,
                       tokenizer_hash=tokenizer_hash, **kw)


class RouterThread:
    """A ``Router`` running in a daemon thread; ``start()`` returns once it is bound."""

    def __init__(self, service: str = "target", frontend_addr: str = "tcp://127.0.0.1:*",
                 backend_addr: str = "tcp://127.0.0.1:*", **kw) -> None:
        kw.setdefault("secret", TEST_SECRET)
        self.router = Router(service, frontend_addr, backend_addr, **kw)
        self.stop_event = threading.Event()
        self._thread = threading.Thread(target=self.router.run, args=(self.stop_event,), daemon=True,
                                        name=f"router-{service}")

    @property
    def frontend(self) -> str:
        return self.router.frontend_endpoint

    @property
    def backend(self) -> str:
        return self.router.backend_endpoint

    def start(self, timeout_s: float = 30.0) -> RouterThread:
        self._thread.start()
        if not self.router.ready.wait(timeout_s):
            raise TimeoutError("router did not bind")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self.stop_event.set()
        self._thread.join(timeout_s)
        self.router.close(timeout_s)

    def live_workers(self) -> tuple[bytes, ...]:
        return self.router.live_workers()

    def wait_live(self, n: int, timeout_s: float = 15.0) -> None:
        """Wait until exactly ``n`` workers are live."""
        deadline = time.monotonic() + timeout_s
        while len(self.router.live_workers()) != n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.router.live_workers())} live workers, expected {n}")
            time.sleep(0.005)

    def __enter__(self) -> RouterThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class WorkerThread:
    """A ``WorkerLoop`` running in a daemon thread; ``start()`` returns once admitted
    (``wait_ready=False`` for workers expected to be refused)."""

    def __init__(self, backend_addr: str, identity: bytes, handler: Handler | None = None,
                 hello: WorkerHello | None = None, **kw) -> None:
        self.handler = handler if handler is not None else EchoHandler()
        kw.setdefault("secret", TEST_SECRET)
        self.loop = WorkerLoop(backend_addr, identity, hello or make_hello(), self.handler, **kw)
        self.stop_event = threading.Event()
        self.rc: int | None = None
        self._thread = threading.Thread(target=self._main, daemon=True, name=f"worker-{identity!r}")

    def _main(self) -> None:
        self.rc = self.loop.run(self.stop_event)

    def start(self, wait_ready: bool = True, timeout_s: float = 30.0) -> WorkerThread:
        self._thread.start()
        if wait_ready and not self.loop.ready.wait(timeout_s):
            raise TimeoutError("worker was not admitted")
        return self

    def stop(self, timeout_s: float = 5.0) -> int | None:
        self.stop_event.set()
        self._thread.join(timeout_s)
        return self.rc

    def join(self, timeout_s: float) -> int | None:
        self._thread.join(timeout_s)
        return self.rc

    def __enter__(self) -> WorkerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SilentWorker:
    """A worker that registers and heartbeats but never answers a request (a stuck engine).

    ``stop_heartbeats()`` makes it fall silent (the router then expires it); ``close()`` closes
    its socket (a vanished process). ``requests`` holds the request frames it received."""

    def __init__(self, backend_addr: str, identity: bytes, hello: WorkerHello | None = None,
                 heartbeat_s: float = 0.05, secret: bytes = TEST_SECRET) -> None:
        self.secret = secret
        self.backend_addr, self.identity = backend_addr, identity
        self.hello = hello or make_hello()
        self.heartbeat_s = heartbeat_s
        self.requests: list[list[bytes]] = []
        self.admitted = threading.Event()
        self.refused = threading.Event()
        self._beating = threading.Event()
        self._beating.set()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name=f"silent-{identity!r}")

    def start(self, wait_admitted: bool = True, timeout_s: float = 30.0) -> SilentWorker:
        self._thread.start()
        if wait_admitted and not self.admitted.wait(timeout_s):
            raise TimeoutError("silent worker was not admitted")
        return self

    def stop_heartbeats(self) -> None:
        self._beating.clear()

    def close(self, timeout_s: float = 5.0) -> None:
        self._closed.set()
        self._thread.join(timeout_s)

    def _main(self) -> None:
        ctx = zmq.Context()
        sock = make_socket(ctx, zmq.DEALER, identity=self.identity, connect=self.backend_addr)
        self._nonce = auth.new_nonce()
        hello = pack_frames(self.hello.model_copy(update={"nonce": self._nonce}), "-", b"hello-1")
        self._hello_body = hello[4]
        sock.send_multipart([b"", *hello])
        next_hb = time.monotonic() + self.heartbeat_s
        try:
            while not self._closed.is_set():
                if sock.poll(10):
                    self._on_message(sock, sock.recv_multipart())
                if self._beating.is_set() and time.monotonic() >= next_hb:
                    next_hb = time.monotonic() + self.heartbeat_s
                    sock.send_multipart([b"", *pack_frames(Heartbeat(), "-", b"hb")])
        finally:
            sock.close(linger=0)
            ctx.term()

    def _on_message(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        if frames[0]:
            self.requests.append(frames)
        elif frames[2] == MsgKind.AUTH_CHALLENGE.as_byte():
            challenge = decode(frames[2], frames[5])
            mac = auth.worker_response(self.secret, challenge.nonce, self._nonce, self.identity, self._hello_body)
            sock.send_multipart([b"", *pack_frames(AuthResponse(mac=mac), "-", b"hello-1")])
        elif frames[2] == MsgKind.HEARTBEAT.as_byte() and frames[4] == b"hello-1":
            self.admitted.set()
        elif frames[2] == MsgKind.ERROR.as_byte() and frames[4] == b"hello-1":
            self.refused.set()
