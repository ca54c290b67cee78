"""Router configuration (pydantic-settings, env prefix ``SPECSPLIT_``), built in ``__main__``.

Environment variables: SPECSPLIT_SERVICE, SPECSPLIT_FRONTEND_ADDR, SPECSPLIT_BACKEND_ADDR,
SPECSPLIT_HEARTBEAT_S, SPECSPLIT_LIVENESS, SPECSPLIT_MAX_WORKERS, SPECSPLIT_MAX_INFLIGHT,
SPECSPLIT_REQUEST_TTL_S, SPECSPLIT_SNDHWM, SPECSPLIT_RCVHWM, SPECSPLIT_LOG_LEVEL,
SPECSPLIT_LOG_JSON. Unset addresses default to the service's loopback pair
(``default_addresses``), so one environment can start both routers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from specsplit.transport.sockets import DEFAULT_HWM, is_loopback_address

SERVICES: tuple[str, ...] = ("draft", "target")
_DEFAULT_ADDRESSES: dict[str, tuple[str, str]] = {
    "draft": ("tcp://127.0.0.1:5550", "tcp://127.0.0.1:5551"),
    "target": ("tcp://127.0.0.1:5560", "tcp://127.0.0.1:5561"),
}


def default_addresses(service: str) -> tuple[str, str]:
    """(frontend, backend) loopback addresses of ``service``'s router."""
    try:
        return _DEFAULT_ADDRESSES[service]
    except KeyError:
        raise ValueError(f"unknown service {service!r}; expected one of {SERVICES}") from None


class RouterSettings(BaseSettings):
    """Settings of one router process."""

    model_config = SettingsConfigDict(env_prefix="SPECSPLIT_", extra="ignore")

    service: Literal["draft", "target"] = "draft"
    frontend_addr: str | None = None
    backend_addr: str | None = None
    heartbeat_s: float = Field(default=1.0, gt=0.0, le=60.0)
    liveness: int = Field(default=3, ge=1, le=100)
    max_workers: int = Field(default=256, ge=1, le=65_536)
    max_inflight: int = Field(default=65_536, ge=1, le=10_000_000)
    request_ttl_s: float = Field(default=300.0, gt=0.0)
    sndhwm: int = Field(default=DEFAULT_HWM, ge=0)
    rcvhwm: int = Field(default=DEFAULT_HWM, ge=0)
    allow_public_bind: bool = False
    log_level: str = "INFO"
    log_json: bool = False

    @model_validator(mode="after")
    def _fill_addresses(self) -> RouterSettings:
        frontend, backend = default_addresses(self.service)
        self.frontend_addr = self.frontend_addr or frontend
        self.backend_addr = self.backend_addr or backend
        if self.frontend_addr == self.backend_addr:
            raise ValueError("frontend_addr and backend_addr must differ")
        for addr in (self.frontend_addr, self.backend_addr):
            if not self.allow_public_bind and not is_loopback_address(addr):
                raise ValueError(f"{addr}: binding beyond loopback requires CURVE keys (not supported yet)")
        return self
