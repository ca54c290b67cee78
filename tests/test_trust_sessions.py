"""Session isolation (issue 16): the adversarial tester's attacks on another client's session,
sent straight to the routers' frontends of a real fleet (tiny preset, greedy). The victim's
output must equal an undisturbed run, and the attacker learns nothing from its answers."""

from __future__ import annotations

import asyncio
import re
import uuid

import pytest
import zmq

from schemas import (
    CacheSync, DraftReply, DraftRequest, ErrorCode, ErrorReply, FlatTree, VerifyReply, VerifyRequest, decode,
    pack_frames, unpack_frames,
)
from specsplit.engine.base import MAX_ROUND_STEP, EngineLimits
from specsplit.engine.target import TargetEngine
from specsplit.launch import Fleet
from specsplit.transport.rpc import AsyncRpcClient
from specsplit.transport.sockets import make_socket
from specsplit.transport.testing import client_id, hello_raw_worker, make_hello
from tests.conftest import tiny_model

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
NEW_TOKENS = 48
TOP_ROUND = 2**53 - 1
ROOT_ONLY = FlatTree(token_ids=[5], parents=[-1])


def assert_no_numbers(reply, *own: int) -> None:
    """A refusal names no round, length or size of a session: no number but the request's own
    (``own``) and the protocol's "base_len 0"."""
    assert isinstance(reply, ErrorReply), reply
    text = reply.message.replace("base_len 0", "")
    for n in own:
        text = text.replace(str(n), "")
    assert not re.search(r"\d", text), reply.message


# ------------------------------------------------------------------ the engine's round rule
def test_a_round_far_ahead_cannot_advance_a_session_without_its_whole_context():
    eng = TargetEngine(tiny_model("qwen2", seed=4), EngineLimits(max_sessions=4, max_session_tokens=128))
    prompt = PROMPT[:5]
    first = eng.handle(VerifyRequest(session_id="s", round=0, sync=CacheSync(base_len=0, append_token_ids=prompt[:-1]),
                                     tree=FlatTree(token_ids=[prompt[-1], 3], parents=[-1, 0])))
    assert isinstance(first, VerifyReply)
    for rnd in (MAX_ROUND_STEP + 1, TOP_ROUND):
        jump = eng.handle(VerifyRequest(session_id="s", round=rnd, sync=CacheSync(base_len=first.cache_len),
                                        tree=ROOT_ONLY))
        assert jump.code is ErrorCode.CACHE_MISS and jump.retryable
        assert_no_numbers(jump)
    assert eng.store.get("s").last_round == 0
    nxt = eng.handle(VerifyRequest(session_id="s", round=1, sync=CacheSync(base_len=first.cache_len), tree=ROOT_ONLY))
    assert isinstance(nxt, VerifyReply)  # the owner's next round is not STALE_ROUND
    step = eng.handle(VerifyRequest(session_id="s", round=1 + MAX_ROUND_STEP, sync=CacheSync(base_len=nxt.cache_len),
                                    tree=ROOT_ONLY))
    assert isinstance(step, VerifyReply)  # a bounded step is fine (a draft skips confirm rounds)
    rebuilt = eng.handle(VerifyRequest(session_id="s", round=TOP_ROUND, sync=CacheSync(base_len=0, append_token_ids=prompt),
                                       tree=ROOT_ONLY))
    assert isinstance(rebuilt, VerifyReply)  # the whole context: a rebuild, like a new session


# -------------------------------------------------------------------------------- the fleet
@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    # a stall of a few seconds on a starved box must not expire the worker (one admission, asserted)
    fleet = Fleet.create(tmp_path_factory.mktemp("trust"), SPECSPLIT_LIVENESS=100)
    fleet.start(drafts=1, targets=1)
    try:
        fleet.wait_ready(drafts=1, targets=1)
        yield fleet
    finally:
        fleet.stop()


async def _victim(fleet: Fleet, session_id: str | None = None):
    from specsplit.client import SpecSplitClient

    async with SpecSplitClient(fleet.orchestrator, timeout_s=120) as client:
        return await client.generate(PROMPT, max_new_tokens=NEW_TOKENS, session_id=session_id)


@pytest.fixture(scope="module")
def undisturbed(fleet):
    return asyncio.run(_victim(fleet))


def _insider(fleet: Fleet, service: str) -> AsyncRpcClient:
    """Another client of the fleet's router that holds the fleet secret (a second orchestrator):
    authenticated, yet it must not reach another client's sessions."""
    return AsyncRpcClient(fleet.addr(f"{service}_fe"), secret=fleet.secret(), name=f"attacker-{service}")


async def _attacked(fleet: Fleet, before, during):
    """The victim's run with ``before()`` awaited first and ``during(stop)`` running beside it."""
    sid = f"victim-{uuid.uuid4().hex[:8]}"
    pre = await before(sid)
    stop = asyncio.Event()
    spray = asyncio.ensure_future(during(sid, stop))
    await asyncio.sleep(0.05)
    try:
        result = await _victim(fleet, sid)
    finally:
        stop.set()
    return sid, result, pre, await spray


@pytest.mark.system
@pytest.mark.timeout(300)
def test_a_round_of_2_53_for_anothers_session_neither_fails_nor_changes_it(fleet, undisturbed):
    async def run():
        async with _insider(fleet, "draft") as draft, _insider(fleet, "target") as target:
            async def before(sid):  # before the session starts, at the highest round there is
                req = DraftRequest(session_id=sid, round=TOP_ROUND, sync=CacheSync(base_len=0), root=5)
                return await draft.call(req, session_id=sid, timeout_s=60)

            async def during(sid, stop):
                got = []
                while not stop.is_set():
                    for base_len in (0, 7):  # a fresh start, and a guess at the victim's length
                        req = VerifyRequest(session_id=sid, round=TOP_ROUND, sync=CacheSync(base_len=base_len),
                                            tree=ROOT_ONLY)
                        got.append(await target.call(req, session_id=sid, timeout_s=60))
                    await asyncio.sleep(0.01)
                return got

            sid, result, pre, got = await _attacked(fleet, before, during)
            fresh = f"nobody-{uuid.uuid4().hex[:8]}"  # what the same requests get for an unused id
            ref = await target.call(VerifyRequest(session_id=fresh, round=TOP_ROUND, sync=CacheSync(base_len=0),
                                                  tree=ROOT_ONLY), session_id=fresh, timeout_s=60)
            return result, pre, got, ref

    result, pre, got, ref = asyncio.run(run())
    assert result.token_ids == undisturbed.token_ids and result.finish_reason == undisturbed.finish_reason
    assert isinstance(pre, DraftReply)  # the attacker drafted in a session of its own
    assert got, "the attack never ran"
    for reply in got:  # exactly what a session nobody uses answers: nothing about the victim's
        if isinstance(reply, VerifyReply):
            # (the forward's measurements, like its time, tell the worker's load, not the victim's state)
            measured = {"verify_ms", "batch_tokens", "batch_size", "session_id"}
            assert reply.model_dump(exclude=measured) == ref.model_dump(exclude=measured)
        else:
            assert reply.code is ErrorCode.CACHE_MISS
            assert_no_numbers(reply, 7)


@pytest.mark.system
@pytest.mark.timeout(300)
def test_a_sync_of_3000_garbage_tokens_for_anothers_session_changes_nothing(fleet, undisturbed):
    garbage = [(7 * i + 11) % 97 for i in range(3000)]

    async def run():
        async with _insider(fleet, "target") as target:
            async def before(sid):
                return None

            async def during(sid, stop):  # every length the victim's cache may have, at rounds it may be at
                got = []
                while not stop.is_set():
                    for base_len in range(len(PROMPT) - 1, len(PROMPT) + NEW_TOKENS + 1):
                        for rnd in range(0, 24, 3):
                            req = VerifyRequest(session_id=sid, round=rnd, tree=ROOT_ONLY,
                                                sync=CacheSync(base_len=base_len, append_token_ids=garbage))
                            got.append((base_len, await target.call(req, session_id=sid, timeout_s=60)))
                        if stop.is_set():
                            break
                return got

            sid, result, _, got = await _attacked(fleet, before, during)
            own = await target.call(VerifyRequest(session_id=sid, round=0, tree=ROOT_ONLY,
                                                  sync=CacheSync(base_len=0, append_token_ids=garbage)),
                                    session_id=sid, timeout_s=120)
            return result, got, own

    result, got, own = asyncio.run(run())
    assert result.token_ids == undisturbed.token_ids and result.finish_reason == undisturbed.finish_reason
    assert got, "the attack never ran"
    for base_len, reply in got:  # the attacker addressed a session of its own, which it never started
        assert reply.code is ErrorCode.CACHE_MISS, reply
        assert_no_numbers(reply, base_len)
    assert isinstance(own, VerifyReply) and own.cache_len > len(garbage)  # under that id: its own garbage


@pytest.mark.system
@pytest.mark.timeout(120)
def test_a_process_without_the_secret_reaches_no_router(fleet, undisturbed):
    ctx = zmq.Context()
    socks = []

    def sock_at(addr: str, identity: bytes) -> zmq.Socket:
        socks.append(make_socket(ctx, zmq.DEALER, identity=identity, connect=addr))
        return socks[-1]

    try:
        for service in ("draft", "target"):
            plain = sock_at(fleet.addr(f"{service}_fe"), client_id())
            req = VerifyRequest(session_id="victim", round=TOP_ROUND, sync=CacheSync(base_len=0), tree=ROOT_ONLY)
            plain.send_multipart(pack_frames(req, "victim", b"r1"))
            assert plain.poll(10_000)
            err = unpack_frames(plain.recv_multipart()).msg
            assert err.code is ErrorCode.UNAUTHENTICATED
            assert_no_numbers(err)
            impostor = sock_at(fleet.addr(f"{service}_be"), f"{service}-0".encode())  # a live worker's identity
            impostor.send_multipart([b"", *pack_frames(make_hello(service, nonce="ab" * 16), "-", b"hello-1")])
            forger = sock_at(fleet.addr(f"{service}_be"), b"forger")
            refusal = hello_raw_worker(forger, make_hello(service), secret=b"a-guess-at-the-fleet-secret-000")
            err = decode(refusal[2], refusal[5])
            assert err.code is ErrorCode.UNAUTHENTICATED and err.message == "authentication refused"
            assert not impostor.poll(300)  # the live worker keeps its identity: nothing reaches the impostor
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
    assert asyncio.run(_victim(fleet)).token_ids == undisturbed.token_ids
    assert "worker_auth_failed" in fleet.log("router_target")
    assert fleet.log("router_target").count("worker_admitted") == 1
