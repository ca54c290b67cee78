"""Router configuration and the settings every role shares (pydantic-settings, env prefix
``SPECSPLIT_``), built in ``__main__``.

Addresses: ``frontend_addr`` / ``backend_addr`` (or the ``--frontend`` / ``--backend`` flags) win;
unset, they come from the fleet-wide per-service addresses that orchestrators and workers read too
(``FleetAddresses``), so one environment configures a whole fleet. A bind beyond loopback is
refused without CURVE keys (``CurveSettings``). Each field's ``description`` is its documentation:
docs/configuration.md is generated from it (``specsplit config --markdown``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from brokers.curve import SETTINGS_HINT, CurveError, CurveKeys, load_authorized_keys, load_keypair, load_public_key
from brokers.sockets import DEFAULT_HWM, is_loopback_address

SERVICES: tuple[str, ...] = ("draft", "target")
# The one definition of the fleet's default (loopback) addresses: routers, workers, orchestrators
# and producers all read them through ``FleetAddresses``.
_DEFAULT_ADDRESSES: dict[str, tuple[str, str]] = {
    "draft": ("tcp://127.0.0.1:5550", "tcp://127.0.0.1:5551"),
    "target": ("tcp://127.0.0.1:5560", "tcp://127.0.0.1:5561"),
}
DEFAULT_ORCHESTRATOR = "tcp://127.0.0.1:5570"


def default_addresses(service: str) -> tuple[str, str]:
    """(frontend, backend) loopback addresses of ``service``'s router."""
    try:
        return _DEFAULT_ADDRESSES[service]
    except KeyError:
        raise ValueError(f"unknown service {service!r}; expected one of {SERVICES}") from None


class CommonSettings(BaseSettings):
    """What every SpecSplit process reads, with one meaning: logging."""

    model_config = SettingsConfigDict(env_prefix="SPECSPLIT_", extra="ignore")

    log_level: str = Field(default="INFO", description="Least severe log level written: DEBUG, INFO, WARNING or "
                           "ERROR (`specsplit produce` logs WARNING and up unless this is set to another level).")
    log_json: bool = Field(default=False, description="Log one JSON object a line instead of console text.")


class CurveSettings(CommonSettings):
    """CURVE keys, one meaning in every process (schemas/PROTOCOL.md, "CURVE (off-box fleets)"):
    encryption and authentication of every fleet socket. Unset: CURVE is off and only loopback
    addresses work."""

    curve_secret_key_file: Path | None = Field(default=None, description=(
        "This process's CURVE keypair: the 0600 `*.key_secret` file of `specsplit keys new`. Set, CURVE is on; "
        "unset, CURVE is off and only loopback addresses are allowed."))
    curve_server_key: str | None = Field(default=None, description=(
        "Public key of the servers this process connects to (routers, orchestrators): Z85 text or a `*.key` "
        "file. Needs SPECSPLIT_CURVE_SECRET_KEY_FILE."))
    curve_authorized_keys: Path | None = Field(default=None, description=(
        "Client keys a server (router, orchestrator) admits: a directory of `*.key` files or a file of Z85 keys, "
        "one a line. Needs SPECSPLIT_CURVE_SECRET_KEY_FILE."))

    @property
    def curve_on(self) -> bool:
        return self.curve_secret_key_file is not None

    @model_validator(mode="after")
    def _check_curve(self) -> CurveSettings:
        if not self.curve_on and (self.curve_server_key or self.curve_authorized_keys):
            raise ValueError("SPECSPLIT_CURVE_SERVER_KEY / _AUTHORIZED_KEYS need SPECSPLIT_CURVE_SECRET_KEY_FILE "
                             "(this process's own keypair) too")
        return self

    def curve_keys(self, *, server: bool = False, client: bool = False) -> CurveKeys | None:
        """The loaded keys (None: CURVE off); ``server`` / ``client``: what this process needs,
        refused with a CurveError naming the missing setting."""
        if not self.curve_on:
            return None
        if server and self.curve_authorized_keys is None:
            raise CurveError("a CURVE server needs SPECSPLIT_CURVE_AUTHORIZED_KEYS (the client keys it admits)")
        if client and not self.curve_server_key:
            raise CurveError("a CURVE client needs SPECSPLIT_CURVE_SERVER_KEY (the public key of its servers)")
        public, secret = load_keypair(self.curve_secret_key_file)
        return CurveKeys(
            public_key=public, secret_key=secret,
            server_key=load_public_key(self.curve_server_key) if self.curve_server_key else None,
            authorized=load_authorized_keys(self.curve_authorized_keys) if self.curve_authorized_keys else None,
        )


def check_binds(addrs, curve_on: bool, has_authorized: bool) -> None:
    """Refuse, at startup, binds beyond loopback without CURVE, and CURVE servers without keys."""
    for addr in addrs:
        if not curve_on and not is_loopback_address(addr):
            raise ValueError(f"{addr}: binding beyond loopback requires CURVE keys: {SETTINGS_HINT}")
    if curve_on and not has_authorized:
        raise ValueError("CURVE is on (SPECSPLIT_CURVE_SECRET_KEY_FILE) but a server needs "
                         "SPECSPLIT_CURVE_AUTHORIZED_KEYS (the client keys it admits)")


class FleetAddresses(CurveSettings):
    """The fleet's addresses, one meaning in every process: routers bind ``*_router`` (their
    frontend, where orchestrators connect) and ``*_backend`` (where workers connect); the
    orchestrator binds ``orchestrator`` and producers connect to it."""

    draft_router: str = Field(default=_DEFAULT_ADDRESSES["draft"][0], description=(
        "The draft router's frontend: it binds it, orchestrators connect to it."))
    draft_backend: str = Field(default=_DEFAULT_ADDRESSES["draft"][1], description=(
        "The draft router's backend: it binds it, draft workers connect to it."))
    target_router: str = Field(default=_DEFAULT_ADDRESSES["target"][0], description=(
        "The target router's frontend: it binds it, orchestrators connect to it."))
    target_backend: str = Field(default=_DEFAULT_ADDRESSES["target"][1], description=(
        "The target router's backend: it binds it, target workers connect to it."))
    orchestrator: str = Field(default=DEFAULT_ORCHESTRATOR, description=(
        "The first orchestrator's address (producers and the API connect to it); instance N of "
        "`honcho start -c orchestrator=N` binds its port + N - 1."))

    @model_validator(mode="after")
    def _check_fleet_curve(self) -> FleetAddresses:
        """Every role binds or dials these: beyond loopback they need CURVE, refused at startup."""
        if not self.curve_on:
            for name in ("draft_router", "draft_backend", "target_router", "target_backend", "orchestrator"):
                addr = getattr(self, name)
                if not is_loopback_address(addr):
                    raise ValueError(f"SPECSPLIT_{name.upper()}={addr}: beyond loopback requires CURVE keys: "
                                     f"{SETTINGS_HINT}")
        return self


class HeartbeatSettings(FleetAddresses):
    """Liveness on router links, read by both sides with one meaning (Paranoid Pirate), and the
    fleet secret every router peer proves (brokers.auth)."""

    heartbeat_s: float = Field(default=1.0, gt=0.0, le=60.0, description=(
        "Seconds between heartbeats on every router link (workers and orchestrators to routers, and back)."))
    liveness: int = Field(default=3, ge=1, le=100, description=(
        "Heartbeats missed in a row before a peer is declared dead (a worker dropped, a router reconnected)."))
    fleet_secret: SecretStr | None = Field(default=None, description=(
        "The secret every router peer proves (at least 16 bytes). Unset: read from SPECSPLIT_FLEET_SECRET_FILE."))
    fleet_secret_file: str | None = Field(default=None, description=(
        "File holding the fleet secret, created with mode 0600 if missing (a file others may read is refused). "
        "Unset: ~/.cache/specsplit/fleet.secret (under $XDG_CACHE_HOME if set)."))

    def secret(self) -> bytes:
        """The fleet secret (reads or creates the file; raises brokers.auth.SecretError)."""
        from brokers.auth import load_fleet_secret

        value = self.fleet_secret.get_secret_value() if self.fleet_secret is not None else None
        return load_fleet_secret(value, self.fleet_secret_file)


class RouterSettings(HeartbeatSettings):
    """One router process: what it binds and how much it tracks."""

    service: Literal["draft", "target"] = Field(default="draft", description=(
        "Which service this router serves; `specsplit router draft|target` sets it."))
    frontend_addr: str | None = Field(default=None, description=(
        "Address this router binds for orchestrators (or `--frontend`). Unset: SPECSPLIT_DRAFT_ROUTER or "
        "SPECSPLIT_TARGET_ROUTER, by service."))
    backend_addr: str | None = Field(default=None, description=(
        "Address this router binds for workers (or `--backend`). Unset: SPECSPLIT_DRAFT_BACKEND or "
        "SPECSPLIT_TARGET_BACKEND, by service."))
    max_workers: int = Field(default=256, ge=1, le=65_536, description=(
        "Workers one router registers at most; a READY beyond that is refused."))
    max_inflight: int = Field(default=65_536, ge=1, le=10_000_000, description=(
        "Requests the router tracks in flight at most (which worker holds which client's request)."))
    request_ttl_s: float = Field(default=3600.0, gt=0.0, description=(
        "Seconds after which a request still in flight is forgotten (its client timed out long ago). A long "
        "prompt's prefill takes minutes on a CPU (21,000 tokens: 340 s on 2 cores), and a reply whose request "
        "was forgotten is dropped; the table stays bounded by SPECSPLIT_MAX_INFLIGHT."))
    sndhwm: int = Field(default=DEFAULT_HWM, ge=0, description=(
        "ZeroMQ send high-water mark of both router sockets, in messages (0: unbounded); beyond it, "
        "messages are dropped and logged."))
    rcvhwm: int = Field(default=DEFAULT_HWM, ge=0, description=(
        "ZeroMQ receive high-water mark of both router sockets, in messages (0: unbounded)."))

    @model_validator(mode="after")
    def _fill_addresses(self) -> RouterSettings:
        if self.service == "draft":
            frontend, backend = self.draft_router, self.draft_backend
        else:
            frontend, backend = self.target_router, self.target_backend
        self.frontend_addr = self.frontend_addr or frontend
        self.backend_addr = self.backend_addr or backend
        if self.frontend_addr == self.backend_addr:
            raise ValueError("frontend_addr and backend_addr must differ")
        check_binds((self.frontend_addr, self.backend_addr), self.curve_on, self.curve_authorized_keys is not None)
        return self


class MetricsSettings(CommonSettings):
    """Prometheus metrics of routers, workers and orchestrators (brokers.metrics has the port scheme:
    with the default base, router_draft 9500, router_target 9600, orchestrator.N 9700+N-1, draft.N
    9800+N-1, target.N 9900+N-1). A port already in use is logged and the process runs without metrics."""

    metrics_port: int = Field(default=9500, ge=0, le=65535, description=(
        "The fleet's base metrics port: a process serves on base + its role's offset + its honcho instance - 1. "
        "0: metrics off."))
    metrics_bind_port: int | None = Field(default=None, ge=0, le=65535, description=(
        "This one process's metrics port outright, instead of the scheme. 0: metrics off."))
    metrics_host: str = Field(default="127.0.0.1", description="Host the metrics endpoint listens on.")
    supervised_restarts: int = Field(default=0, ge=0, description=(
        "Set by the supervisor in the child it starts (how many times it restarted the role), reported as a "
        "metric; not for users."))
