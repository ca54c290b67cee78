"""Router configuration (pydantic-settings, env prefix ``SPECSPLIT_``), built in ``__main__``.

Addresses: ``frontend_addr`` / ``backend_addr`` (SPECSPLIT_FRONTEND_ADDR / _BACKEND_ADDR, or the
``--frontend`` / ``--backend`` flags) win; unset, they come from the fleet-wide per-service
variables that orchestrators and workers read too (SPECSPLIT_DRAFT_ROUTER, SPECSPLIT_DRAFT_BACKEND,
SPECSPLIT_TARGET_ROUTER, SPECSPLIT_TARGET_BACKEND), whose defaults are ``default_addresses``. So
one environment configures a whole fleet. Also: SPECSPLIT_SERVICE, _HEARTBEAT_S, _LIVENESS,
_MAX_WORKERS, _MAX_INFLIGHT, _REQUEST_TTL_S, _SNDHWM, _RCVHWM, _LOG_LEVEL, _LOG_JSON,
_FLEET_SECRET / _FLEET_SECRET_FILE.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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


class FleetAddresses(CommonSettings):
    """The fleet's addresses, one meaning in every process: routers bind ``*_router`` (their
    frontend, where orchestrators connect) and ``*_backend`` (where workers connect); the
    orchestrator binds ``orchestrator`` and producers connect to it."""

    draft_router: str = _DEFAULT_ADDRESSES["draft"][0]
    draft_backend: str = _DEFAULT_ADDRESSES["draft"][1]
    target_router: str = _DEFAULT_ADDRESSES["target"][0]
    target_backend: str = _DEFAULT_ADDRESSES["target"][1]
    orchestrator: str = DEFAULT_ORCHESTRATOR


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
    allow_public_bind: bool = False

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
        for addr in (self.frontend_addr, self.backend_addr):
            if not self.allow_public_bind and not is_loopback_address(addr):
                raise ValueError(f"{addr}: binding beyond loopback requires CURVE keys (not supported yet)")
        return self
