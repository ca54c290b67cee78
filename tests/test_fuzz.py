"""Protocol fuzzer (issue 16, item 6): 10,000 seeded random and mutated messages against every
socket of a real tiny fleet; no process may crash or restart, every message is answered with a
typed error (or its normal reply) or dropped by a rule PROTOCOL.md lists, and greedy output is
the same after the run as before it. ``SPECSPLIT_FUZZ_SEED`` / ``SPECSPLIT_FUZZ_COUNT`` change
the seed (default 16, printed) and the count. Plus the fuzzer's own oracle, and the bugs it found."""

from __future__ import annotations

import os
import threading

import msgpack
import pytest
import zmq

from brokers import auth
from schemas import PROTO, AuthChallenge, ErrorCode, ErrorReply, Heartbeat, MsgKind, WorkerHello, pack_frames
from schemas.codec import decode
from specsplit.transport.testing import TEST_SECRET
from specsplit.fuzz.gen import (
    ANSWER, ANY, DROP_BAD_CONTROL, DROP_CANCEL, DROP_CONTROL_KIND, DROP_OR_HELLO, HELLO_RID, LANES, PLACEHOLDER_RID,
    Generator, expect_of,
)
from specsplit.transport.sockets import endpoint, make_socket
from tests.conftest import wait_until

SEED = int(os.environ.get("SPECSPLIT_FUZZ_SEED", "16"))
COUNT = int(os.environ.get("SPECSPLIT_FUZZ_COUNT", "10000"))


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fleet_survives_ten_thousand_fuzzed_messages(tmp_path):
    from specsplit.fuzz.__main__ import fuzz_fleet

    print(f"fuzz seed={SEED} count={COUNT} (set SPECSPLIT_FUZZ_SEED to change it)")
    res = fuzz_fleet(tmp_path, SEED, COUNT, deadline_s=300)  # a hang guard: every message must be sent
    rep = res.report
    print(rep.summary(), res.timings)
    assert not res.problems, f"seed {SEED}: " + "\n".join(res.problems)
    assert not rep.failures, f"seed {SEED}: {rep.notes['failures']} failures, first:\n" + "\n".join(rep.failures[:30])
    assert rep.total == COUNT and set(rep.sent) == set(LANES), rep.sent
    # the run really reached the workers and the drop rules, not just the routers' envelope checks
    assert rep.answered["ERROR:BAD_REQUEST"] > COUNT // 4 and rep.answered["DraftReply"] and rep.answered["VerifyReply"]
    assert rep.answered["GenerateDone"] and rep.expected[DROP_OR_HELLO] and rep.expected[DROP_CANCEL]
    assert res.before == res.after and all(len(t) == 16 for t in res.before)


def test_cases_are_reproducible_from_the_seed():
    a, b, c = Generator(7), Generator(7), Generator(8)
    lanes = LANES * 40
    first = [(x.lane, x.frames, x.expect) for x in map(a.case, lanes)]
    assert first == [(x.lane, x.frames, x.expect) for x in map(b.case, lanes)]
    assert first != [(x.lane, x.frames, x.expect) for x in map(c.case, lanes)]


def test_oracle_follows_the_documented_rules():
    hb = pack_frames(Heartbeat(), "-", b"r1")
    hello = pack_frames(WorkerHello(service="x", model_id="m", vocab_size=1, tokenizer_hash="h"), "-", b"r2")
    err = pack_frames(ErrorReply.of(ErrorCode.INTERNAL, "x"), "-", b"r3")
    # frontends answer everything; an unreadable request id is echoed as "-"
    assert expect_of("draft_fe", [b"junk"]) == (ANSWER, PLACEHOLDER_RID)
    assert expect_of("target_fe", [PROTO, b"\x01", b"s", b"r" * 33, b""]) == (ANSWER, PLACEHOLDER_RID)
    assert expect_of("orch_a", [b"XXXX", b"\x20", b"s", b"rid", b""]) == (ANSWER, PLACEHOLDER_RID)
    cancel = [PROTO, MsgKind.CANCEL.as_byte(), b"s", b"r4", msgpack.packb({"session_id": "s"})]
    assert expect_of("orch_b", cancel) == (DROP_CANCEL, b"r4")
    # a fake worker: hellos are answered, the rest dropped (or "send WORKER_HELLO")
    assert expect_of("draft_be", [b"", *hello]) == (ANSWER, b"r2")
    assert expect_of("draft_be", [b"", *hb]) == (DROP_OR_HELLO, HELLO_RID)
    assert expect_of("draft_be", [b"", *err])[0] == DROP_CONTROL_KIND
    assert expect_of("draft_be", [b"", b"junk"])[0] == DROP_BAD_CONTROL
    assert expect_of("target_be", [b"fuzz-fe-target", *err]) == (DROP_OR_HELLO, HELLO_RID)
    assert expect_of("target_steal", [b"", *hello])[0] == ANY


@pytest.mark.timeout(60)
def test_worker_ignores_the_refusal_of_a_hello_it_did_not_send():
    """Found by the fuzzer: a forged WORKER_HELLO under a real worker's identity is refused by the
    router, and the refusal goes to whoever holds the identity then; the real worker took any
    non-retryable ERROR as its own refusal and exited 2, for good (its supervisor does not restart
    exit 2). Now only a refusal echoing its own hello's request id ends it."""
    from specsplit.transport.worker_loop import WorkerLoop

    ctx = zmq.Context()
    be = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    hello = WorkerHello(service="draft", model_id="m", vocab_size=8, tokenizer_hash="h")
    loop = WorkerLoop(endpoint(be), b"w-1", hello, lambda m: m, heartbeat_s=0.2, liveness=50, ctx=ctx,
                      secret=TEST_SECRET)
    stop, rc = threading.Event(), []
    thread = threading.Thread(target=lambda: rc.append(loop.run(stop)), daemon=True)
    thread.start()
    try:
        assert be.poll(10_000), "no hello"
        frames = be.recv_multipart()  # [identity, b"", PROTO, WORKER_HELLO, "-", rid, body]
        assert frames[3] == MsgKind.WORKER_HELLO.as_byte()
        own_rid = frames[5]
        # the router's side of the handshake: a challenge with its proof of the fleet secret
        worker_nonce = decode(MsgKind.WORKER_HELLO, frames[6]).nonce
        router_nonce = auth.new_nonce()
        proof = auth.router_proof(TEST_SECRET, worker_nonce, router_nonce, b"w-1")
        be.send_multipart([b"w-1", b"", *pack_frames(AuthChallenge(nonce=router_nonce, proof=proof), "-", own_rid)])
        assert be.poll(10_000), "no answer to the challenge"
        assert be.recv_multipart()[3] == MsgKind.AUTH_RESPONSE.as_byte()
        refused = ErrorReply.of(ErrorCode.BAD_REQUEST, "worker serves 'target'")
        for guess in (b"hello-1", b"hello-2", b"forged"):
            be.send_multipart([b"w-1", b"", *pack_frames(refused, "-", guess)])
        be.send_multipart([b"w-1", b"", *pack_frames(Heartbeat(), "-", own_rid)])  # in order, after them
        wait_until(loop.ready.is_set, 10, "admitted after the forged refusals")
        assert thread.is_alive() and not rc
        be.send_multipart([b"w-1", b"", *pack_frames(refused, "-", own_rid)])  # its own refusal still ends it
        thread.join(10)
        assert rc == [2]
    finally:
        stop.set()
        thread.join(10)
        be.close(linger=0)
        ctx.term()
