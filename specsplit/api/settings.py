"""``specsplit api``'s settings (pydantic-settings, env prefix ``SPECSPLIT_``): the producer's
(``specsplit.config.ProducerSettings``) and the HTTP server's own."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from brokers.sockets import is_loopback_address
from specsplit.config import ProducerSettings, honcho_slot


class ApiSettings(ProducerSettings):
    """``specsplit api``, the OpenAI-compatible HTTP front door: a producer of the orchestrators
    (the producer's settings apply too) that serves HTTP."""

    api_host: str = Field(default="127.0.0.1", description=(
        "Host the HTTP API listens on; beyond loopback it needs SPECSPLIT_API_KEYS_FILE."))
    api_port: int = Field(default=8000, ge=0, le=65535, description=(
        "Port the HTTP API listens on; instance N of `honcho start -c api=N` listens on this + N - 1."))
    api_keys_file: Path | None = Field(default=None, description=(
        "API keys, one a line (blank lines and # comments skipped); clients send `Authorization: Bearer KEY` "
        "or `x-api-key: KEY` on /v1/*. Unset: no keys, and only a loopback SPECSPLIT_API_HOST is allowed."))
    api_model_name: str | None = Field(default=None, min_length=1, max_length=256, description=(
        "The model id clients name and /v1/models lists. Unset: the target model directory's name."))
    api_max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=1 << 30, description=(
        "Request bodies larger than this get 413 before they are read (the default holds a full-context "
        "prompt of 131072 tokens as JSON text)."))
    api_header_timeout_s: float = Field(default=10.0, gt=0, le=600, description=(
        "Seconds for a request's headers to arrive, from connect."))
    api_body_timeout_s: float = Field(default=30.0, gt=0, le=600, description=(
        "Seconds for a request's body to arrive, once its headers came."))
    api_keep_alive_s: float = Field(default=5.0, gt=0, le=600, description=(
        "Seconds an idle keep-alive connection stays open."))
    api_shutdown_grace_s: float = Field(default=5.0, gt=0, le=3600, description=(
        "Seconds a stopping API (SIGTERM) gives open requests and streams to finish before it closes them; "
        "under Kubernetes, less than the pod's termination grace period minus its preStop pause."))
    api_orchestrator_wait_s: float = Field(default=10.0, ge=0, le=600, description=(
        "Seconds a request waits for a live orchestrator (one restarting) before it gets 503."))
    api_tokenizer_wait_s: float = Field(default=1800.0, gt=0, description=(
        "Seconds the API waits at startup for the target's tokenizer files (the workers provision the models)."))
    api_prompt_routes: int = Field(default=16384, ge=0, le=1 << 24, description=(
        "Conversation affinity without prompt_cache_key: the API remembers this many recent prompts (~300 bytes "
        "each), and a request whose prompt begins with a whole remembered one (a conversation's last turn) is "
        "routed with it, to the workers whose prefix caches hold it. 0: off (each request routed on its own)."))
    api_stored_responses: int = Field(default=1024, ge=0, le=1 << 20, description=(
        "Responses API answers kept in this API process's memory for GET /v1/responses/{id} and "
        "previous_response_id (requests with store: true, the default), the oldest out first. 0: none kept. "
        "Behind several API replicas a stored response is found only through the one that made it."))
    api_stored_responses_mb: int = Field(default=256, ge=1, le=1 << 20, description=(
        "Megabytes of stored responses (their JSON) at most, the oldest out first."))
    api_max_concurrent_requests: int = Field(default=1024, ge=1, description=(
        "Requests served at once; beyond it a request gets 429 at once."))
    api_chat_template: Path | None = Field(default=None, description=(
        "A Jinja chat template file used instead of the served model's own (as vLLM's --chat-template); "
        "tool calls need one that shows tools and calls in <tool_call> tags."))

    @field_validator("api_chat_template")
    @classmethod
    def _template_readable(cls, v: Path | None) -> Path | None:
        if v is not None and not v.expanduser().is_file():
            raise ValueError(f"SPECSPLIT_API_CHAT_TEMPLATE={v}: no such file")
        return v

    @model_validator(mode="after")
    def _check_api_bind(self) -> ApiSettings:
        if not self.api_keys_file and not is_loopback_address(f"tcp://{self.api_host}:{self.api_port}"):
            raise ValueError(f"SPECSPLIT_API_HOST={self.api_host}: serving beyond loopback requires API keys "
                             "(SPECSPLIT_API_KEYS_FILE, one key a line)")
        return self

    def bind_port(self, environ=None) -> int:
        """This instance's port: api_port for the first (or no honcho slot), + N - 1 for "api.N"."""
        port = self.api_port + honcho_slot(environ) - 1 if self.api_port else 0
        if port > 65535:
            raise ValueError(f"SPECSPLIT_API_PORT={self.api_port}: instance {honcho_slot(environ)} would listen on {port}")
        return port

    def api_keys(self) -> tuple[str, ...]:
        """The keys in api_keys_file (empty: no keys); OSError / ValueError when unusable."""
        if self.api_keys_file is None:
            return ()
        keys = tuple(line.strip() for line in self.api_keys_file.expanduser().read_text().splitlines()
                     if line.strip() and not line.strip().startswith("#"))
        if not keys:
            raise ValueError(f"{self.api_keys_file}: no API key in it")
        return keys
