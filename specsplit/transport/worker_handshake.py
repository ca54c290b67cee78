"""The worker's side of its router's control frames (``WorkerLoop`` mixes this in): the hello
(with a fresh nonce), the fleet-secret challenge it answers only when the router proves the secret,
admission (a HEARTBEAT echoing the hello), refusals (only one echoing our own hello ends the
worker; anyone else's is ignored), and CURVE handshake failures. See schemas/PROTOCOL.md,
"Security model", and ``specsplit.transport.worker_loop`` for the frames.
"""

from __future__ import annotations

import enum
import time
import uuid

import zmq

from brokers import auth
from brokers.curve import handshake_failure
from schemas.codec import CodecError, MsgKind, check_envelope, decode, pack_frames
from schemas.messages import AuthChallenge, AuthResponse

CONTROL_SID = "-"


class _Outcome(enum.Enum):
    STOPPED = "stopped"
    SILENT = "silent"
    REFUSED = "refused"


class RouterHandshake:
    """Control-frame handling of ``WorkerLoop`` (uses its socket, identity, hello, secret, log)."""

    def _on_control(self, env: list[bytes]) -> _Outcome | None:
        try:
            kind, _, rid = check_envelope(env)
            if kind is MsgKind.HEARTBEAT:
                if rid == self._hello_rid and self._router_proved and not self.ready.is_set():
                    self.ready.set()
                    self.log.info("worker_admitted", router=self.backend_addr)
                return None
            if kind is MsgKind.AUTH_CHALLENGE:
                return self._answer_challenge(decode(kind, env[4]), rid)
            if kind is not MsgKind.ERROR:
                self.log.warning("unexpected_control", kind=kind.name)
                return None
            err = decode(kind, env[4])
        except CodecError as exc:
            self.log.warning("bad_control_frame", error=str(exc))
            return None
        if not err.retryable:
            if rid != self._hello_rid:  # the refusal of another process's hello under our identity
                self.log.warning("foreign_refusal_ignored", code=err.code.value, reason=err.message)
                return None
            self.log.error("worker_refused", code=err.code.value, reason=err.message)
            return _Outcome.REFUSED
        self.ready.clear()  # the router does not know us (restarted, or it expired us)
        if time.monotonic() - self._last_hello >= self.heartbeat_s:
            self.log.info("worker_rehello", reason=err.message)
            self._send_hello()
        return None

    def _on_handshake_failed(self) -> bool:
        """Log failed CURVE handshakes; True when the router refused our key (stop: retrying
        with the same key cannot succeed)."""
        from zmq.utils.monitor import recv_monitor_message

        refused = False
        while True:
            try:
                ev = recv_monitor_message(self._mon, zmq.NOBLOCK)
            except zmq.Again:
                return refused
            why = handshake_failure(ev["event"], ev["value"], self.backend_addr)
            if why is None:
                continue
            if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                refused = True
                self.log.error("curve_refused", reason=why, public_key=self.curve.public_key.decode())
            elif time.monotonic() - self._handshake_logged >= self.heartbeat_s:  # at most once a heartbeat
                self._handshake_logged = time.monotonic()
                self.log.error("curve_handshake_failed", reason=why)

    def _send_hello(self) -> None:
        # unguessable: only the router's answer to this very hello may admit or refuse us
        self._hello_rid = b"hello-%d-%s" % (next(self._rids), uuid.uuid4().hex[:12].encode())
        self._last_hello = time.monotonic()
        self._hello_nonce, self._router_proved = auth.new_nonce(), False
        frames = pack_frames(self.hello.model_copy(update={"nonce": self._hello_nonce}), CONTROL_SID,
                             self._hello_rid)
        self._hello_body = frames[4]  # the response's HMAC covers these exact bytes
        self._send([b"", *frames])

    def _answer_challenge(self, challenge: AuthChallenge, rid: bytes) -> _Outcome | None:
        """Answer only a challenge to our latest hello whose proof shows the router holds the
        fleet secret. A router that cannot prove it gets nothing and is never served: the
        worker stops as refused (the secrets differ: a configuration error, or not our router)."""
        if rid != self._hello_rid:
            self.log.warning("stale_challenge_ignored")
            return None
        proof = auth.router_proof(self._secret, self._hello_nonce, challenge.nonce, self.identity)
        if not auth.same(challenge.proof, proof):
            self.log.error("router_proof_bad", router=self.backend_addr,
                           hint="the router does not hold this worker's fleet secret")
            return _Outcome.REFUSED
        self._router_proved = True
        mac = auth.worker_response(self._secret, challenge.nonce, self._hello_nonce, self.identity, self._hello_body)
        self._send_control(AuthResponse(mac=mac), rid)
        return None
