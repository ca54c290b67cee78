"""Protocol fuzzer, part 2: send the cases to a live fleet's sockets and judge what comes back.

One DEALER per lane: each router's frontend (a client with a fixed identity, so that forged
"replies" posted on a backend could reach it), the orchestrator's frontend (two producers), each
router's backend (a fake worker that was never admitted) and, at the end, a short burst per
router backend under a real worker's identity (``stolen``), whose replies race with the real
worker's and are only checked for being well-formed. Sending is paced by a window of unanswered
cases; replies are collected by request id from every socket while sending, so no case waits
on its own. Every wait is bounded by ``deadline_s``.

Verdict (``Report.failures`` empty means pass): every ANSWER case got a terminal reply with its
request id (an ErrorReply with a known code, or the request's normal reply), no case a drop
rule covers got one, every frame the fleet sent decodes, and nothing unsolicited arrived.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import zmq

from schemas import (
    CodecError, DraftReply, ErrorCode, ErrorReply, GenerateDone, GrowReply, Heartbeat, MsgKind, TokenChunk, VerifyReply,
    unpack_frames,
)
from schemas.messages import Ack
from specsplit.fuzz.gen import (
    ANSWER, ANY, BE_IDENTITY, BE_LANES, DROP_OR_HELLO, FE_IDENTITY, FE_LANES, HELLO_RID, LANES, ORCH_LANES,
    PLACEHOLDER_RID, STEAL_LANES, WEIGHTS, Case, Generator,
)
from specsplit.transport.sockets import make_socket, recv_frames, send_frames

TERMINAL = (ErrorReply, GenerateDone, DraftReply, VerifyReply, GrowReply, Ack, Heartbeat)
STEAL_BURST = 8  # messages per stolen-identity burst


@dataclass(frozen=True)
class FleetAddrs:
    draft_fe: str
    draft_be: str
    target_fe: str
    target_be: str
    orchestrator: str
    worker_ids: dict[str, bytes]  # service -> a real worker's identity (for the stolen lanes)
    secret: bytes | None = None  # the fleet secret: the frontend lanes are authenticated clients (insiders)

    def of(self, lane: str) -> str:
        return {"draft_fe": self.draft_fe, "target_fe": self.target_fe, "draft_be": self.draft_be,
                "target_be": self.target_be, "draft_steal": self.draft_be, "target_steal": self.target_be}.get(
                    lane, self.orchestrator)


@dataclass
class Report:
    seed: int
    sent: Counter = field(default_factory=Counter)  # by lane
    expected: Counter = field(default_factory=Counter)  # by expectation
    answered: Counter = field(default_factory=Counter)  # by reply type / error code
    failures: list[str] = field(default_factory=list)
    notes: Counter = field(default_factory=Counter)
    elapsed_s: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def fail(self, why: str) -> None:
        if len(self.failures) < 200:
            self.failures.append(why)
        self.notes["failures"] += 1

    def summary(self) -> str:
        return (f"seed={self.seed} sent={self.total} {dict(self.sent)} expected={dict(self.expected)} "
                f"answered={dict(self.answered)} notes={dict(self.notes)} failures={self.notes['failures']} "
                f"elapsed_s={self.elapsed_s:.1f}")


def reply_name(msg) -> str:
    return f"ERROR:{msg.code.value}" if isinstance(msg, ErrorReply) else type(msg).__name__


class Fuzzer:
    def __init__(self, addrs: FleetAddrs, seed: int, count: int, *, vocab: int = 448,
                 foreign_sids: tuple[str, ...] = (), window: int = 48, deadline_s: float = 45.0) -> None:
        self.addrs, self.count, self.window = addrs, count, window
        self.gen = Generator(seed, vocab=vocab, foreign_sids=foreign_sids)
        self.report = Report(seed)
        self.deadline = time.monotonic() + deadline_s
        self.ctx = zmq.Context()
        self.socks: dict[str, zmq.Socket] = {}
        self.waiting: dict[tuple[str, bytes], list[Case]] = defaultdict(list)  # ANSWER cases by (lane, key)
        self.dropped: dict[tuple[str, bytes], Case] = {}  # drop-rule cases with a unique key
        self.may_hello: Counter = Counter()  # lane -> cases that may be answered "send WORKER_HELLO"
        self.outstanding = 0

    # ---------------------------------------------------------------------------- run
    def run(self) -> Report:
        t0 = time.monotonic()
        try:
            for lane in FE_LANES + ORCH_LANES + BE_LANES:
                ident = FE_IDENTITY.get(lane) or BE_IDENTITY.get(lane)
                if lane in FE_LANES and self.addrs.secret is not None:
                    from specsplit.transport.testing import authenticate, client_id

                    ident = client_id()  # routers take authenticated clients with random ids only
                    sock = make_socket(self.ctx, zmq.DEALER, identity=ident, connect=self.addrs.of(lane))
                    if authenticate(sock, self.addrs.secret)[1] != MsgKind.HEARTBEAT.as_byte():
                        raise RuntimeError(f"{lane}: the router refused the fleet secret")
                    self.socks[lane] = sock
                    continue
                self.socks[lane] = make_socket(self.ctx, zmq.DEALER, identity=ident, connect=self.addrs.of(lane))
            lanes = [lane for lane in LANES if lane not in STEAL_LANES]
            weights = [WEIGHTS[lane] for lane in lanes]
            n_steal = self.count * sum(WEIGHTS[s] for s in STEAL_LANES) // sum(WEIGHTS.values())
            for _ in range(self.count - n_steal):
                self.send(self.gen.case(self.gen.rng.choices(lanes, weights)[0]))
                self.pace()
            self.settle(lambda: self.outstanding == 0)
            self.collect(0.3)  # replies to cases that should have none arrive about as fast as answers
            self.steal(n_steal)
            self.verdict()
        finally:
            for sock in self.socks.values():
                sock.close(linger=0)
            self.ctx.term()
        self.report.elapsed_s = time.monotonic() - t0
        return self.report

    def send(self, case: Case) -> None:
        r = self.report
        r.sent[case.lane] += 1
        r.expected[case.expect] += 1
        lane_key = (case.lane, case.key)
        if case.expect == ANSWER:
            self.waiting[lane_key].append(case)
            self.outstanding += 1
        elif case.expect == DROP_OR_HELLO:
            self.may_hello[case.lane] += 1
        elif case.expect != ANY and case.key != PLACEHOLDER_RID:
            self.dropped[lane_key] = case
        sock = self.socks[case.lane]
        while True:
            try:
                send_frames(sock, case.frames)
                return
            except zmq.Again:  # at the high-water mark: read replies meanwhile, bounded
                if time.monotonic() > self.deadline:
                    raise TimeoutError(f"fuzz deadline passed while sending ({r.total} sent)") from None
                self.collect(0.01)

    def pace(self) -> None:
        """Keep at most ``window`` cases unanswered; never wait more than 2 s for the window."""
        self.collect(0.0)
        if self.outstanding >= self.window:
            until = time.monotonic() + 2.0
            self.settle(lambda: self.outstanding < self.window // 2, until=min(until, self.deadline))

    def settle(self, done, until: float | None = None) -> None:
        until = self.deadline if until is None else until
        while not done() and time.monotonic() < until:
            self.collect(0.02)

    def collect(self, wait_s: float) -> None:
        """Read every reply waiting on any socket (polling up to ``wait_s`` for the first)."""
        poller = zmq.Poller()
        for sock in self.socks.values():
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(int(wait_s * 1000)))
        by_sock = {s: lane for lane, s in self.socks.items()}
        for sock in ready:
            for _ in range(4096):
                try:
                    frames = recv_frames(sock)
                except zmq.Again:
                    break
                self.on_reply(by_sock[sock], frames)

    # -------------------------------------------------------------------------- judge
    def on_reply(self, lane: str, frames: list[bytes]) -> None:
        r = self.report
        if lane in BE_LANES or lane in STEAL_LANES:
            if frames and frames[0]:  # a real request routed to the fake worker: it was admitted
                r.notes[f"{lane}_got_work"] += 1
                if lane in BE_LANES:
                    r.fail(f"{lane}: the router routed a client request to a worker it never admitted")
                return
            frames = frames[1:]
        try:
            env = unpack_frames(frames)
        except CodecError as exc:
            r.fail(f"{lane}: the fleet sent an undecodable message ({exc}): {[f[:40] for f in frames]}")
            return
        msg = env.msg
        r.answered[reply_name(msg)] += 1
        if lane in STEAL_LANES:
            return
        if lane in BE_LANES:
            return self.on_control_reply(lane, env)
        if isinstance(msg, TokenChunk):
            if (lane, env.request_id) not in self.waiting:
                r.fail(f"{lane}: TokenChunk for request {env.request_id!r} that is not running")
            return
        if not isinstance(msg, TERMINAL):
            r.fail(f"{lane}: unexpected {type(msg).__name__} for request {env.request_id!r}")
            return
        cases = self.waiting.get((lane, env.request_id))
        if not cases:
            dropped = self.dropped.get((lane, env.request_id))
            why = f" (case {dropped.what!r} should be dropped: {dropped.expect})" if dropped else ""
            r.fail(f"{lane}: unsolicited {reply_name(msg)} for request {env.request_id!r}{why}: {str(msg)[:200]}")
            return
        cases.pop(0)
        if not cases:
            del self.waiting[(lane, env.request_id)]
        self.outstanding -= 1

    def on_control_reply(self, lane: str, env) -> None:
        """The router talking to a fake worker: refusals of its hellos, "send WORKER_HELLO"."""
        msg, key = env.msg, env.request_id
        if key == HELLO_RID:
            self.may_hello[lane] -= 1
            if not (isinstance(msg, ErrorReply) and msg.code is ErrorCode.NO_WORKER and msg.retryable):
                self.report.fail(f"{lane}: a 'send WORKER_HELLO' that is not a retryable NO_WORKER: {msg}")
            elif self.may_hello[lane] < 0:
                self.report.fail(f"{lane}: more 'send WORKER_HELLO' answers than messages that may cause one")
            return
        cases = self.waiting.get((lane, key))
        if not cases:
            self.report.fail(f"{lane}: unsolicited {reply_name(msg)} with request id {key!r}")
            return
        cases.pop(0)
        if not cases:
            del self.waiting[(lane, key)]
        self.outstanding -= 1
        if isinstance(msg, Heartbeat):
            self.report.fail(f"{lane}: the router admitted a fake worker ({cases and cases[0].what})")

    def verdict(self) -> None:
        for (lane, key), cases in self.waiting.items():
            for case in cases:
                self.report.fail(f"{lane}: no answer for request {key!r} ({case.what}): "
                                 f"{[f[:24] for f in case.frames]}")

    # ------------------------------------------------------------------ stolen identities
    def steal(self, n: int) -> None:
        """Bursts under real workers' identities: connect, send, read briefly, leave. The
        router hands the identity over (ROUTER_HANDOVER) and back when the worker reconnects."""
        sent = 0
        while sent < n and time.monotonic() < self.deadline:
            lane = self.gen.rng.choice(STEAL_LANES)
            ident = self.addrs.worker_ids[lane.split("_")[0]]
            sock = make_socket(self.ctx, zmq.DEALER, identity=ident, connect=self.addrs.of(lane))
            self.socks[lane] = sock
            try:
                for _ in range(min(STEAL_BURST, n - sent)):
                    case = self.gen.case(lane)
                    self.report.sent[lane] += 1
                    self.report.expected[case.expect] += 1
                    send_frames(sock, case.frames)
                    sent += 1
                self.collect(0.05)
            except zmq.Again:
                self.report.notes["steal_hwm"] += 1
            finally:
                del self.socks[lane]
                sock.close(linger=100)
