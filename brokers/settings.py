"""Router configuration (pydantic-settings, env prefix ``SPECSPLIT_``), built in ``__main__``.

Addresses: ``frontend_addr`` / ``backend_addr`` (SPECSPLIT_FRONTEND_ADDR / _BACKEND_ADDR, or the
``--frontend`` / ``--backend`` flags) win; unset, they come from the fleet-wide per-service
variables that orchestrators and workers read too (SPECSPLIT_DRAFT_ROUTER, SPECSPLIT_DRAFT_BACKEND,
SPECSPLIT_TARGET_ROUTER, SPECSPLIT_TARGET_BACKEND), whose defaults are ``default_addresses``. So
one environment configures a whole fleet. Also: SPECSPLIT_SERVICE, _HEARTBEAT_S, _LIVENESS,
_MAX_WORKERS, _MAX_INFLIGHT, _REQUEST_TTL_S, _SNDHWM, _RCVHWM, _LOG_LEVEL, _LOG_JSON,
_FLEET_SECRET / _FLEET_SECRET_FILE, and the CURVE keys every process reads (``CurveSettings``): a
bind beyond loopback is refused without them.
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

    log_level: str = "INFO"
    log_json: bool = False


class CurveSettings(CommonSettings):
    """CURVE keys, one meaning in every process (PROTOCOL.md, "CURVE (off-box fleets)"). Unset:
    CURVE is off and only loopback addresses work. SPECSPLIT_CURVE_SECRET_KEY_FILE (this
    process's keypair, a 0600 ``*.key_secret`` from ``specsplit keys new``) turns it on;
    SPECSPLIT_CURVE_SERVER_KEY (Z85 text or a ``*.key`` file) is the public key of the servers a
    client connects to; SPECSPLIT_CURVE_AUTHORIZED_KEYS (a directory of ``*.key`` files, or a file
    of Z85 keys, one a line) are the client keys a server admits."""

    curve_secret_key_file: Path | None = None
    curve_server_key: str | None = None
    curve_authorized_keys: Path | None = None

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

    draft_router: str = _DEFAULT_ADDRESSES["draft"][0]
    draft_backend: str = _DEFAULT_ADDRESSES["draft"][1]
    target_router: str = _DEFAULT_ADDRESSES["target"][0]
    target_backend: str = _DEFAULT_ADDRESSES["target"][1]
    orchestrator: str = DEFAULT_ORCHESTRATOR

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
    """Router <-> worker liveness, read by both sides with one meaning (Paranoid Pirate), and the
    fleet secret every router peer proves (SPECSPLIT_FLEET_SECRET, else the 0600 file
    SPECSPLIT_FLEET_SECRET_FILE, default ~/.cache/specsplit/fleet.secret; see brokers.auth)."""

    heartbeat_s: float = Field(default=1.0, gt=0.0, le=60.0)
    liveness: int = Field(default=3, ge=1, le=100)
    fleet_secret: SecretStr | None = None
    fleet_secret_file: str | None = None

    def secret(self) -> bytes:
        """The fleet secret (reads or creates the file; raises brokers.auth.SecretError)."""
        from brokers.auth import load_fleet_secret

        value = self.fleet_secret.get_secret_value() if self.fleet_secret is not None else None
        return load_fleet_secret(value, self.fleet_secret_file)


class RouterSettings(HeartbeatSettings):
    """Settings of one router process."""

    service: Literal["draft", "target"] = "draft"
    frontend_addr: str | None = None
    backend_addr: str | None = None
    max_workers: int = Field(default=256, ge=1, le=65_536)
    max_inflight: int = Field(default=65_536, ge=1, le=10_000_000)
    request_ttl_s: float = Field(default=300.0, gt=0.0)
    sndhwm: int = Field(default=DEFAULT_HWM, ge=0)
    rcvhwm: int = Field(default=DEFAULT_HWM, ge=0)

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
    """Prometheus metrics of every role (brokers.metrics has the port scheme). Env:
    SPECSPLIT_METRICS_PORT (the fleet's base port; a process serves on base + its role's offset +
    its honcho instance - 1; 0: off), SPECSPLIT_METRICS_BIND_PORT (this process's port outright;
    0: off), SPECSPLIT_METRICS_HOST (loopback unless set). SPECSPLIT_SUPERVISED_RESTARTS is set
    by the supervisor for the child it starts (how many times it restarted the role)."""

    metrics_port: int = Field(default=9500, ge=0, le=65535)
    metrics_bind_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    supervised_restarts: int = Field(default=0, ge=0)
