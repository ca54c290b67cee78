"""CURVE (issue 16, item 3): key files, the loopback-only rule without keys, and real CURVE
routers admitting listed keys and refusing others clearly on both sides (no torch)."""

from __future__ import annotations

import asyncio
import os
import stat
import time

import pytest
import zmq

from brokers import curve as curve_mod
from brokers.curve import (
    CurveError, CurveKeys, CurveRequired, load_authorized_keys, load_keypair, load_public_key, refused_count,
)
from brokers.settings import RouterSettings
from specsplit.cli import main as cli_main
from specsplit.client import OrchestratorRefused, SpecSplitClient
from specsplit.config import OrchestratorSettings
from specsplit.transport.rpc import AsyncRpcClient, RpcRefused, RpcTimeout
from specsplit.transport.sockets import make_monitored_socket, make_socket
from specsplit.transport.testing import TEST_SECRET, EchoHandler, RouterThread, WorkerThread, make_verify

pytestmark = pytest.mark.timeout(60)
HB = dict(heartbeat_s=0.1, liveness=20)  # generous (2 s): router, workers and test share one GIL


def keypair() -> tuple[bytes, bytes]:
    return zmq.curve_keypair()


@pytest.fixture
def fleet_keys():
    """(server keys, admitted client keys, unlisted client keys), all on one fleet server key."""
    spub, ssec = keypair()
    cpub, csec = keypair()
    opub, osec = keypair()
    authorized = frozenset({cpub})
    server = CurveKeys(spub, ssec, authorized=authorized)
    client = CurveKeys(cpub, csec, server_key=spub)
    stranger = CurveKeys(opub, osec, server_key=spub)
    return server, client, stranger


# ------------------------------------------------------------------------------- key files
def test_keys_new_writes_a_private_keypair_and_never_overwrites(tmp_path, capsys):
    assert cli_main(["keys", "new", "--dir", str(tmp_path / "k"), "--name", "w1"]) == 0
    public, secret = tmp_path / "k" / "w1.key", tmp_path / "k" / "w1.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert "secret-key" not in public.read_text()
    pub, sec = load_keypair(secret)
    assert load_public_key(str(public)) == pub and len(sec) == 40
    assert load_public_key(pub.decode()) == pub  # Z85 text works as well as a file
    assert zmq.curve_public(sec) == pub  # a real pair
    assert load_authorized_keys(tmp_path / "k") == {pub}  # a directory of *.key files
    assert cli_main(["keys", "new", "--dir", str(tmp_path / "k"), "--name", "w1"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err


def test_unsafe_or_malformed_keys_are_refused(tmp_path):
    cli_main(["keys", "new", "--dir", str(tmp_path), "--name", "s"])
    secret = tmp_path / "s.key_secret"
    os.chmod(secret, 0o644)
    with pytest.raises(CurveError, match="chmod 600"):
        load_keypair(secret)
    with pytest.raises(CurveError, match="no secret-key"):
        os.chmod(tmp_path / "s.key", 0o600)
        load_keypair(tmp_path / "s.key")
    with pytest.raises(CurveError, match="cannot read"):
        load_keypair(tmp_path / "missing")
    listed = tmp_path / "authorized.txt"
    pub = keypair()[0].decode()
    listed.write_text(f"# fleet\n{pub}  # worker 1\n\n")
    assert load_authorized_keys(listed) == {pub.encode()}
    listed.write_text("not-a-key\n")
    with pytest.raises(CurveError, match=r"authorized.txt:1"):
        load_authorized_keys(listed)
    listed.write_text("# nobody\n")
    with pytest.raises(CurveError, match="no public keys"):
        load_authorized_keys(listed)
    with pytest.raises(CurveError, match="SPECSPLIT_CURVE_SERVER_KEY"):
        load_public_key("x" * 12)


# ------------------------------------------------------------------------- the loopback rule
def test_sockets_beyond_loopback_need_curve_and_complete_keys(fleet_keys):
    server, client, _ = fleet_keys
    ctx = zmq.Context()
    try:
        with pytest.raises(CurveRequired, match="binding beyond loopback requires CURVE"):
            make_socket(ctx, zmq.ROUTER, bind="tcp://0.0.0.0:*")
        with pytest.raises(CurveRequired, match="connecting beyond loopback"):
            make_socket(ctx, zmq.DEALER, connect="tcp://10.213.0.1:5551")
        with pytest.raises(CurveError, match="SPECSPLIT_CURVE_AUTHORIZED_KEYS"):
            make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", curve=client)  # no admitted keys
        with pytest.raises(CurveError, match="SPECSPLIT_CURVE_SERVER_KEY"):
            make_socket(ctx, zmq.DEALER, connect="tcp://127.0.0.1:5551", curve=server)  # no server key
        assert ctx.underlying not in curve_mod._zaps  # a failed CURVE bind leaves no ZAP thread behind
        sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", curve=server)
        assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE and sock.getsockopt(zmq.CURVE_SERVER) == 1
        sock.close(linger=0)
        curve_mod.release_zap(ctx)
        assert ctx.underlying not in curve_mod._zaps
    finally:
        ctx.term()  # would hang if the ZAP thread still held its sockets


def test_settings_refuse_public_binds_without_keys_at_startup(tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("SPECSPLIT_")]:
        monkeypatch.delenv(k)
    with pytest.raises(ValueError, match="binding beyond loopback requires CURVE keys"):
        RouterSettings(service="draft", frontend_addr="tcp://10.213.0.1:5550")
    with pytest.raises(ValueError, match="SPECSPLIT_CURVE_SECRET_KEY_FILE"):
        RouterSettings(service="draft", curve_server_key="x")
    with pytest.raises(ValueError, match="binding beyond loopback"):
        OrchestratorSettings(orchestrator_bind="tcp://0.0.0.0:5570")
    from specsplit.config import ProducerSettings, WorkerSettings

    for cls in (WorkerSettings, ProducerSettings):  # clients dialling a remote fleet: refused at startup too
        with pytest.raises(ValueError, match="SPECSPLIT_TARGET_BACKEND=tcp://10.213.0.1:5561: beyond loopback"):
            cls(target_backend="tcp://10.213.0.1:5561")
    cli_main(["keys", "new", "--dir", str(tmp_path), "--name", "server"])
    secret, public = tmp_path / "server.key_secret", tmp_path / "server.key"
    with pytest.raises(ValueError, match="SPECSPLIT_CURVE_AUTHORIZED_KEYS"):
        RouterSettings(service="draft", frontend_addr="tcp://10.213.0.1:5550", curve_secret_key_file=secret)
    monkeypatch.setenv("SPECSPLIT_CURVE_SECRET_KEY_FILE", str(secret))
    monkeypatch.setenv("SPECSPLIT_CURVE_AUTHORIZED_KEYS", str(tmp_path))
    with pytest.raises(ValueError, match="SPECSPLIT_CURVE_SERVER_KEY"):
        OrchestratorSettings(orchestrator_bind="tcp://0.0.0.0:5570")  # it is a client of the routers too
    s = RouterSettings(service="draft", frontend_addr="tcp://10.213.0.1:5550")
    keys = s.curve_keys(server=True)
    assert keys.authorized == {load_public_key(str(public))} and keys.public_key in keys.authorized
    with pytest.raises(CurveError, match="SPECSPLIT_CURVE_SERVER_KEY"):
        s.curve_keys(client=True)
    monkeypatch.setenv("SPECSPLIT_CURVE_SERVER_KEY", str(public))
    o = OrchestratorSettings(orchestrator_bind="tcp://0.0.0.0:5570")
    assert o.curve_keys(server=True, client=True).server_key == keys.public_key


# ------------------------------------------------------------------------ real handshakes
def test_a_refusal_before_anyone_reads_the_monitor_is_still_reported(fleet_keys):
    """The monitor is attached before the socket connects: libzmq does not retry a refused key, so
    a refusal that came before a late-attached monitor would be lost and the client silent."""
    from zmq.utils.monitor import recv_monitor_message

    server, _, stranger = fleet_keys
    with RouterThread("target", curve=server, **HB) as rt:
        ctx = zmq.Context()
        sock, mon = make_monitored_socket(ctx, zmq.DEALER, curve_mod.HANDSHAKE_FAILURES, connect=rt.frontend,
                                          curve=stranger)
        try:
            time.sleep(1.0)  # the point: the handshake fails while nothing reads the monitor
            mon.setsockopt(zmq.RCVTIMEO, 10_000)  # a hang guard
            assert recv_monitor_message(mon)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        finally:
            sock.disable_monitor()
            mon.close(linger=0)
            sock.close(linger=0)
            ctx.term()


async def test_curve_router_serves_listed_keys_and_refuses_others_clearly(fleet_keys):
    server, client, stranger = fleet_keys
    with RouterThread("target", curve=server, **HB) as rt:
        assert rt.frontend.startswith("tcp://127.0.0.1:")
        good = WorkerThread(rt.backend, b"good", EchoHandler(tag=7), curve=client, **HB).start()
        bad = WorkerThread(rt.backend, b"bad", EchoHandler(), curve=stranger, **HB).start(wait_ready=False)
        try:
            assert bad.join(10.0) == 2  # refused: run() returns instead of reconnecting forever
            assert rt.live_workers() == (b"good",)
            assert refused_count(rt.router._ctx) >= 1  # the server side logged curve_key_refused
            async with AsyncRpcClient(rt.frontend, curve=client, default_timeout_s=5.0, secret=TEST_SECRET) as rpc:
                reply = await rpc.call(make_verify("s1"), session_id="s1")
                assert reply.cache_len == 7
            async with AsyncRpcClient(rt.frontend, curve=stranger, default_timeout_s=20.0, secret=TEST_SECRET) as rpc:
                # RpcRefused, not RpcTimeout: refused at the handshake, not at the call's timeout
                with pytest.raises(RpcRefused, match="SPECSPLIT_CURVE_AUTHORIZED_KEYS"):
                    await rpc.call(make_verify("s2"), session_id="s2")
            async with AsyncRpcClient(rt.frontend, default_timeout_s=0.5, secret=TEST_SECRET) as plain:  # no CURVE: no service
                with pytest.raises(RpcTimeout):
                    await plain.call(make_verify("s3"), session_id="s3")
            async with AsyncRpcClient(rt.frontend, curve=client, default_timeout_s=5.0, secret=TEST_SECRET) as rpc:  # still serving
                assert (await rpc.call(make_verify("s4"), session_id="s4")).cache_len == 7
        finally:
            good.stop()
            bad.stop()
    assert rt.router._ctx.closed and rt.router._ctx.underlying not in curve_mod._zaps


async def test_producer_with_an_unlisted_key_is_refused_not_left_waiting(fleet_keys):
    server, client, stranger = fleet_keys
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*", curve=server)  # an orchestrator frontend
    addr = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    try:
        async with SpecSplitClient(addr, curve=stranger, timeout_s=30.0, heartbeat_s=0.2) as producer:
            # OrchestratorRefused, not TimeoutError: refused at the handshake, not at the timeout
            with pytest.raises(OrchestratorRefused, match="refused this process's CURVE key"):
                await producer.generate([1, 2, 3], max_new_tokens=4)
            assert producer.refused  # remembered: a later call fails before it sends anything
            with pytest.raises(OrchestratorRefused):
                await asyncio.wait_for(producer.generate([1], max_new_tokens=1), 10.0)  # a hang guard
    finally:
        sock.close(linger=0)
        curve_mod.release_zap(ctx)
        ctx.term()
