"""The router's side of the fleet's authentication (PROTOCOL.md, "Security model") and of its
workers' admission: the handlers of CLIENT_HELLO / AUTH_RESPONSE on the frontend and WORKER_HELLO /
AUTH_RESPONSE on the backend, mixed into ``brokers.router.Router`` (which owns the sockets, tables
and stats they use).
"""

from __future__ import annotations

import secrets
import time

from brokers import auth
from schemas.codec import CodecError, MsgKind, decode, pack_frames
from schemas.messages import AuthChallenge, ErrorCode, ErrorReply, Heartbeat, WorkerHello

CONTROL_SID = "-"
REFUSED = "authentication refused"  # the one text an unauthenticated peer is told
ASKED_HELLO_MAX = 1024  # workers told to register again, remembered to ask each once a heartbeat


class RouterAuth:
    """Challenge-response handlers; every method runs on the router's thread."""

    def _on_client_hello(self, client_id: bytes, env: list[bytes], rid: bytes) -> None:
        """Step 1 of a client's authentication: answer with our nonce and proof."""
        try:
            hello = decode(MsgKind.CLIENT_HELLO, env[4])
        except CodecError as exc:
            self._send_error(client_id, CONTROL_SID, rid, ErrorCode.BAD_REQUEST, str(exc))
            return
        if not (auth.good_client_id(client_id) and auth.good_nonce(hello.nonce)):
            self._refuse_client(client_id, rid, "weak client id or nonce")
            return
        challenge = auth.Challenge(auth.new_nonce(), hello.nonce, time.monotonic())
        self._client_challenges.put(client_id, challenge)
        proof = auth.router_proof(self._secret, hello.nonce, challenge.router_nonce, client_id)
        self._send_client(client_id, pack_frames(AuthChallenge(nonce=challenge.router_nonce, proof=proof),
                                                 CONTROL_SID, rid))

    def _on_client_response(self, client_id: bytes, env: list[bytes], rid: bytes) -> None:
        """Step 2: a correct response makes the client known under a fresh random token."""
        challenge = self._client_challenges.pop(client_id)
        try:
            resp = decode(MsgKind.AUTH_RESPONSE, env[4])
        except CodecError:
            resp = None
        want = challenge and auth.client_response(self._secret, challenge.router_nonce, challenge.peer_nonce,
                                                  client_id)
        if resp is None or not want or not auth.same(resp.mac, want):
            self._refuse_client(client_id, rid, "bad response" if challenge else "no challenge pending")
            return
        self._clients.put(client_id, secrets.token_bytes(16))
        self.stats.clients_authenticated += 1
        self.log.info("client_authenticated", client=client_id.hex()[:16], clients=len(self._clients))
        self._send_client(client_id, pack_frames(Heartbeat(sent_at=time.time()), CONTROL_SID, rid))

    def _refuse_client(self, client_id: bytes, rid: bytes, why: str) -> None:
        self.stats.auth_failed += 1
        self._warn.warning("client_auth_failed", client=client_id.hex()[:16], reason=why)
        self._send_error(client_id, CONTROL_SID, rid, ErrorCode.UNAUTHENTICATED, REFUSED, retryable=False)

    def _challenge_worker(self, worker_id: bytes, env: list[bytes], rid: bytes) -> None:
        """A hello changes nothing until its sender proves the fleet secret: answer a challenge."""
        try:
            hello = decode(MsgKind.WORKER_HELLO, env[4])
        except CodecError as exc:
            self._refuse_worker(worker_id, rid, f"undecodable hello: {exc}")
            return
        if not auth.good_nonce(hello.nonce):
            self._refuse_worker(worker_id, rid, "hello without a nonce")
            return
        challenge = auth.Challenge(auth.new_nonce(), hello.nonce, time.monotonic(), hello, bytes(env[4]), rid)
        self._worker_challenges.put(worker_id, challenge)
        proof = auth.router_proof(self._secret, hello.nonce, challenge.router_nonce, worker_id)
        self._send_control(worker_id, AuthChallenge(nonce=challenge.router_nonce, proof=proof), rid)

    def _on_worker_response(self, worker_id: bytes, env: list[bytes], rid: bytes) -> None:
        challenge = self._worker_challenges.pop(worker_id)
        try:
            resp = decode(MsgKind.AUTH_RESPONSE, env[4])
        except CodecError:
            resp = None
        want = challenge and auth.worker_response(self._secret, challenge.router_nonce, challenge.peer_nonce,
                                                  worker_id, challenge.hello_body)
        if resp is None or not want or not auth.same(resp.mac, want):
            self._refuse_worker(worker_id, rid, "bad response" if challenge else "no challenge pending")
            return
        self._on_hello(worker_id, challenge.hello, challenge.request_id)

    def _refuse_worker(self, worker_id: bytes, rid: bytes, why: str) -> None:
        """The peer has not proved the secret: it learns nothing (not why, not what we serve)."""
        self.stats.workers_refused += 1
        self.stats.auth_failed += 1
        self._warn.warning("worker_auth_failed", worker=worker_id.hex(), reason=why)
        self._send_control(worker_id, ErrorReply.of(ErrorCode.UNAUTHENTICATED, REFUSED, retryable=False), rid)

    def _on_hello(self, worker_id: bytes, hello: WorkerHello, rid: bytes) -> None:
        """An authenticated hello: admit unless it disagrees with the admitted workers (an
        authenticated worker may be told why)."""
        adm = self.registry.admit(worker_id, hello, time.monotonic())
        wid = worker_id.hex()
        if adm.replaced:
            self._fail_inflight(worker_id, "re-registered")
        if not adm.ok:
            self.stats.workers_refused += 1
            self.log.error("worker_refused", worker=wid, reason=adm.reason, model_id=hello.model_id)
            self._send_control(worker_id, ErrorReply.of(ErrorCode.BAD_REQUEST, adm.reason), rid)
            return
        self.stats.workers_admitted += 1
        self._asked_hello.pop(worker_id, None)
        if len(self.registry.model_ids()) > 1:
            self.log.warning("worker_model_ids_differ", model_ids=sorted(self.registry.model_ids()))
        self.log.info(
            "worker_admitted", worker=wid, model_id=hello.model_id, pid=hello.pid,
            replaced=adm.replaced, live=len(self.registry),
        )
        self._send_control(worker_id, Heartbeat(sent_at=time.time()), rid)
        self._send_owed_ends(worker_id)

    def _ask_hello(self, worker_id: bytes) -> None:
        """Tell an unknown worker (router restarted, or it was expired) to register again;
        at most once a heartbeat per worker."""
        now = time.monotonic()
        last = self._asked_hello.get(worker_id)
        if last is not None and now - last < self.heartbeat_s:
            return
        self._asked_hello[worker_id] = now
        self._asked_hello.move_to_end(worker_id)
        while len(self._asked_hello) > ASKED_HELLO_MAX:
            self._asked_hello.popitem(last=False)
        self.log.info("worker_asked_hello", worker=worker_id.hex())
        msg = ErrorReply.of(ErrorCode.NO_WORKER, "unknown worker: send WORKER_HELLO", retryable=True)
        self._send_control(worker_id, msg, b"hello?")
