"""Trust boundaries at a router (issue 16): who may join its backend, whose replies reach its
clients, who may send it requests. A real Router in a thread, real ZeroMQ sockets, no torch."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import zmq

from brokers import rendezvous
from schemas.codec import MsgKind, decode, pack_frames, unpack_frames
from schemas.messages import ErrorCode, ErrorReply, VerifyReply
from specsplit.transport.rpc import AsyncRpcClient
from specsplit.transport.sockets import make_socket
from specsplit.transport.testing import (
    TEST_SECRET, EchoHandler, RouterThread, WorkerThread, authed_dealer, authenticate, client_id, hello_raw_worker,
    make_hello, make_verify,
)
from tests.conftest import async_wait_until, wait_until

pytestmark = pytest.mark.timeout(60)

HB = dict(heartbeat_s=0.1, liveness=20)
WRONG = b"not-the-fleet-secret-at-all-0000"


def assert_discloses_nothing(text: str) -> None:
    """A refusal to an unauthenticated peer names nothing of the fleet: no number (vocab size,
    round, length), no tokenizer hash, no model id."""
    assert not re.search(r"\d", text), text
    for secret_ish in ("tok", "echo", "vocab", "hash", "model"):
        assert secret_ish not in text.lower(), text


@pytest.fixture
def router():
    with RouterThread("target", **HB) as rt:
        yield rt


def _poll_all(sock: zmq.Socket, ms: int) -> list[list[bytes]]:
    got, deadline = [], time.monotonic() + ms / 1000
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            got.append(sock.recv_multipart())
    return got


def _first(sock: zmq.Socket, pred, timeout_s: float = 20.0) -> list[bytes]:
    """The first frames on ``sock`` that ``pred`` accepts (``timeout_s``: a hang guard)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1) and pred(frames := sock.recv_multipart()):
            return frames
    raise TimeoutError("no such frames")


def test_forged_worker_is_refused_learns_nothing_and_gets_no_requests(router):
    ctx = zmq.Context()
    forger = make_socket(ctx, zmq.DEALER, identity=b"forger", connect=router.backend)
    try:
        with WorkerThread(router.backend, b"real", EchoHandler(tag=1), **HB):
            # the forger sends exactly the hello a real worker sends, but cannot prove the secret
            refusal = hello_raw_worker(forger, make_hello(), secret=WRONG)
            assert refusal[2] == MsgKind.ERROR.as_byte()
            err = decode(refusal[2], refusal[5])
            assert err.code is ErrorCode.UNAUTHENTICATED and not err.retryable
            assert_discloses_nothing(err.message)
            # a hello without a nonce (an old worker, or a guess) is refused the same way
            forger.send_multipart([b"", *pack_frames(make_hello(), "-", b"h2")])
            bare = _first(forger, lambda f: f[4] == b"h2")
            assert decode(bare[2], bare[5]).message == err.message
            # a WorkerLoop with another secret finds that the router cannot prove its secret: it
            # answers nothing and stops as refused (rc 2)
            wrong = WorkerThread(router.backend, b"wrong", secret=WRONG, **HB).start(wait_ready=False)
            assert wrong.join(10) == 2
            assert router.live_workers() == (b"real",)
            client = authed_dealer(ctx, router.frontend)
            for i in range(20):
                client.send_multipart(pack_frames(make_verify(f"s{i}"), f"s{i}", b"r%d" % i))
            replies = [unpack_frames(client.recv_multipart()).msg for _ in range(20) if client.poll(5000)]
            client.close()
            assert len(replies) == 20 and all(isinstance(r, VerifyReply) and r.cache_len == 1 for r in replies)
            assert not [f for f in _poll_all(forger, 300) if f[0]]  # not one request reached the forger
        stats = router.router.stats
        assert stats.workers_refused == 2 and stats.auth_failed == 2 and stats.workers_admitted == 1
    finally:
        forger.close(linger=0)
        ctx.term()


async def test_a_hello_under_a_live_identity_does_not_replace_it(router):
    ctx = zmq.Context()
    with WorkerThread(router.backend, b"w1", EchoHandler(tag=1), **HB):
        impostor = make_socket(ctx, zmq.DEALER, identity=b"w1", connect=router.backend)
        try:
            impostor.send_multipart([b"", *pack_frames(make_hello(nonce="ab" * 16), "-", b"hello-1")])
            async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as client:
                for i in range(20):
                    reply = await client.call(make_verify(f"s{i}", 0), session_id=f"s{i}", timeout_s=5)
                    assert isinstance(reply, VerifyReply) and reply.cache_len == 1  # still the real worker
            assert await asyncio.to_thread(_poll_all, impostor, 300) == []  # nothing reached the impostor
            assert router.live_workers() == (b"w1",)
            assert router.router.stats.workers_admitted == 1  # not replaced, not re-registered
        finally:
            impostor.close(linger=0)
            ctx.term()


def _next_request(sock: zmq.Socket, timeout_ms: int = 5000) -> list[bytes]:
    """The next request a raw worker is sent, past the router's heartbeats (control frames
    start with an empty frame; a request with its routing token)."""
    while True:
        assert sock.poll(timeout_ms), "no request reached the worker"
        frames = sock.recv_multipart()
        if frames[0] != b"":
            return frames


def test_only_the_worker_sent_a_request_can_answer_it():
    with RouterThread("target", heartbeat_s=0.5, liveness=120) as rt:  # raw workers: no heartbeats
        ctx = zmq.Context()
        ids = [b"worker-a", b"worker-b"]
        workers = {}
        client = stranger = None
        try:
            for wid in ids:
                workers[wid] = make_socket(ctx, zmq.DEALER, identity=wid, connect=rt.backend)
                assert hello_raw_worker(workers[wid])[2] == MsgKind.HEARTBEAT.as_byte()
            stranger = make_socket(ctx, zmq.DEALER, identity=b"stranger", connect=rt.backend)
            sid = next(f"s{i}" for i in range(100) if rendezvous.pick(f"s{i}", ids) == b"worker-a")
            client = authed_dealer(ctx, rt.frontend)
            client.send_multipart(pack_frames(make_verify(sid), sid, b"rid-1"))
            request = _next_request(workers[b"worker-a"])
            token, env = request[0], request[1:]
            assert env[3] == b"rid-1"
            forged = VerifyReply(session_id=sid, round=0, accepted_token_ids=[6, 7, 8], accepted_nodes=[1, 2, 3],
                                 bonus_token_id=9, cache_len=999)
            # worker-b (admitted, but not sent this request), a never-admitted peer, and worker-a
            # itself with a request id it was never sent: all dropped
            workers[b"worker-b"].send_multipart([token, *pack_frames(forged, sid, b"rid-1")])
            stranger.send_multipart([token, *pack_frames(forged, sid, b"rid-1")])
            workers[b"worker-a"].send_multipart([token, *pack_frames(forged, sid, b"rid-9")])
            # on events: the router dropped all three; then the first thing the client gets is the real answer
            wait_until(lambda: rt.router.stats.unsolicited_replies == 3, 20, "the three forgeries dropped")
            real = VerifyReply(session_id=sid, round=0, accepted_token_ids=[], bonus_token_id=5, cache_len=1)
            workers[b"worker-a"].send_multipart([token, *pack_frames(real, sid, b"rid-1")])
            assert client.poll(20_000)
            got = unpack_frames(client.recv_multipart())
            assert got.request_id == b"rid-1" and got.msg.cache_len == 1
            workers[b"worker-a"].send_multipart([token, *pack_frames(forged, sid, b"rid-1")])  # a second answer
            wait_until(lambda: rt.router.stats.unsolicited_replies == 4, 20, "the second answer dropped")
            assert not client.poll(0)
        finally:
            for sock in (*workers.values(), client, stranger):
                if sock is not None:
                    sock.close(linger=0)
            ctx.term()


def test_unauthenticated_clients_reach_no_worker_and_learn_nothing(router):
    handler = EchoHandler()
    with WorkerThread(router.backend, b"w", handler, **HB):
        ctx = zmq.Context()
        try:
            plain = make_socket(ctx, zmq.DEALER, identity=client_id(), connect=router.frontend)
            plain.send_multipart(pack_frames(make_verify("victim", 2**53 - 1), "victim", b"r1"))
            assert plain.poll(5000)
            err = unpack_frames(plain.recv_multipart()).msg
            assert isinstance(err, ErrorReply) and err.code is ErrorCode.UNAUTHENTICATED
            assert_discloses_nothing(err.message)
            wrong = authenticate(plain, WRONG)  # a wrong secret is refused
            err = decode(wrong[1], wrong[4])
            assert err.code is ErrorCode.UNAUTHENTICATED and not err.retryable
            assert_discloses_nothing(err.message)
            auto = make_socket(ctx, zmq.DEALER, connect=router.frontend)  # a ZeroMQ-assigned (sequential) id
            refused = authenticate(auto)
            assert decode(refused[1], refused[4]).code is ErrorCode.UNAUTHENTICATED
            plain.close()
            auto.close()
            assert handler.calls == 0
        finally:
            ctx.term()


async def test_a_client_with_a_wrong_secret_cannot_call(router):
    with WorkerThread(router.backend, b"w", **HB):
        async with AsyncRpcClient(router.frontend, secret=WRONG) as client:
            with pytest.raises(TimeoutError):
                await client.call(make_verify("s"), session_id="s", timeout_s=0.5)
            # mutual: it does not even answer the router (the check may end after the call's timeout)
            await async_wait_until(lambda: client.auth_error, 20, "the client's verdict on the router")
            assert "could not prove" in client.auth_error


async def test_two_clients_with_one_session_id_have_two_sessions(router):
    seen: list[str] = []

    def handler(msg):
        seen.append(msg.session_id)
        return EchoHandler()(msg)

    with WorkerThread(router.backend, b"w", handler, **HB):
        async with AsyncRpcClient(router.frontend, secret=TEST_SECRET) as a, \
                AsyncRpcClient(router.frontend, secret=TEST_SECRET) as b:
            ra = await a.call(make_verify("same", 0), session_id="same", timeout_s=5)
            rb = await b.call(make_verify("same", 0), session_id="same", timeout_s=5)
            ra2 = await a.call(make_verify("same", 1), session_id="same", timeout_s=5)
    assert ra.session_id == rb.session_id == ra2.session_id == "same"  # each client sees its own id
    assert len(seen) == 3 and seen[0] == seen[2] != seen[1]  # the worker keyed them apart
    assert all(s.endswith("/same") for s in seen)


async def test_a_client_authenticates_again_after_a_router_restart():
    first = RouterThread("target", **HB).start()
    frontend, backend = first.frontend, first.backend
    worker = WorkerThread(backend, b"w", reconnect_max_s=0.4, **HB).start()
    try:
        async with AsyncRpcClient(frontend, secret=TEST_SECRET) as client:
            assert isinstance(await client.call(make_verify("s", 0), session_id="s", timeout_s=5), VerifyReply)
            first.stop()
            with RouterThread("target", frontend, backend, **HB) as second:
                await asyncio.to_thread(second.wait_live, 1, 10.0)
                for attempt in range(20):  # the first call may learn that the router forgot us
                    try:
                        reply = await client.call(make_verify("s", 1), session_id="s", timeout_s=5)
                        break
                    except Exception as exc:  # RpcRouterLost: resend, as the actor does
                        assert type(exc).__name__ == "RpcRouterLost", exc
                assert isinstance(reply, VerifyReply)
                assert second.router.stats.clients_authenticated == 1
    finally:
        worker.stop()


def test_the_fleet_secret_file_is_made_once_private_and_refused_when_others_can_read_it(tmp_path, monkeypatch):
    import os
    import stat

    from brokers.auth import SecretError, load_fleet_secret
    from brokers.settings import RouterSettings

    path = tmp_path / "sub" / "fleet.secret"
    first = load_fleet_secret(None, path)
    assert len(first) >= 32 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_fleet_secret(None, path) == first  # every process of the fleet reads the same one
    monkeypatch.setenv("SPECSPLIT_FLEET_SECRET_FILE", str(path))
    assert RouterSettings(service="target").secret() == first
    monkeypatch.setenv("SPECSPLIT_FLEET_SECRET", "x" * 20)  # the variable wins over the file
    assert RouterSettings(service="target").secret() == b"x" * 20
    with pytest.raises(SecretError):
        load_fleet_secret("too-short")
    os.chmod(path, 0o644)
    with pytest.raises(SecretError):
        load_fleet_secret(None, path)
