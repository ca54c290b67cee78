"""``specsplit api``: settings, the app, uvicorn with a header timeout. Exit codes: 0 stopped,
2 bad settings or another tokenizer than the fleet's (the supervisor does not restart it), 1 a
failure (no tokenizer in time, the port taken)."""

from __future__ import annotations

import argparse
import json
import sys

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

USAGE = """Serve the fleet over HTTP with OpenAI's API: GET /v1/models, POST /v1/completions,
POST /v1/chat/completions, GET /health, GET /metrics. Configured by environment variables only
(and .env): SPECSPLIT_API_HOST (127.0.0.1), SPECSPLIT_API_PORT (8000), SPECSPLIT_API_KEYS_FILE
(required beyond loopback), SPECSPLIT_API_MODEL_NAME, SPECSPLIT_API_MAX_BODY_BYTES, the
orchestrators (SPECSPLIT_ORCHESTRATOR, SPECSPLIT_ORCHESTRATOR_COUNT) and the models
(SPECSPLIT_PRESET / SPECSPLIT_TARGET_MODEL: the API loads the target's tokenizer only).
`specsplit config api` prints the effective settings."""


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, and a connection whose request headers have not all arrived
    ``header_timeout_s`` after its first byte (or after connecting) is closed: a slow client
    cannot hold a connection open by trickling headers. Idle keep-alive connections are uvicorn's
    own ``timeout_keep_alive``."""

    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        waiting = self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE
        timer = getattr(self, "_header_timer", None)
        if waiting and timer is None:  # bytes of a new request's headers: the clock starts
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)
        elif not waiting and timer is not None:
            timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request that is not valid HTTP gets OpenAI's error body too (uvicorn's is plain text)."""
        body = json.dumps({"error": {"message": f"malformed HTTP request: {msg}", "type": "invalid_request_error",
                                     "param": None, "code": "invalid_http"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def api_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="specsplit api", description=USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args(argv)  # --help only: settings come from the environment
    from specsplit.api.tokenizer import keep_torch_out

    keep_torch_out()
    import uvicorn
    from pydantic import ValidationError

    from brokers.curve import CurveError
    from specsplit.api.server import build_app
    from specsplit.api.settings import ApiSettings
    from specsplit.api.state import ApiState
    from specsplit.logs import configure_logging
    from specsplit.models import ModelSettings

    try:
        settings = ApiSettings()
        curve = settings.curve_keys(client=True)
        state = ApiState(settings, ModelSettings(), curve=curve)
    except (ValidationError, CurveError, OSError, ValueError) as exc:
        print(f"specsplit api: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_json)
    protocol = type("GuardedH11", (GuardedH11Protocol,), {"header_timeout_s": settings.api_header_timeout_s})
    try:
        port = settings.bind_port()
    except ValueError as exc:
        print(f"specsplit api: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(build_app(state), host=settings.api_host, port=port, http=protocol,
                            lifespan="on", log_config=None, access_log=False, server_header=False,
                            timeout_keep_alive=max(1, int(settings.api_keep_alive_s)),
                            timeout_graceful_shutdown=max(1, round(settings.api_shutdown_grace_s)))
    server = uvicorn.Server(config)

    def stop() -> None:
        server.should_exit = True

    state.on_fatal = stop
    server.run()
    if state.exit_code:
        return state.exit_code
    return 0 if server.started else 1
