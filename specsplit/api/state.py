"""What the API process holds: settings, keys, the orchestrator pool, the tokenizer, metrics, and
its readiness (the tokenizer loaded, the fleet's tokenizer the same, one generation served)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from specsplit.api.background import BackgroundRuns
from specsplit.api.metrics import ApiMetrics
from specsplit.api.protocol import ApiError
from specsplit.api.routes import PromptRoutes
from specsplit.api.settings import ApiSettings
from specsplit.api.stored import ResponseStore
from specsplit.api.tokenizer import ServedTokenizer, target_model_dir, wait_for_tokenizer_dir
from specsplit.logs import get_logger
from specsplit.pool import OrchestratorPool

PROBE_TIMEOUT_S = 120.0  # one 1-token generation: workers may still be loading their models
WATCH_EVERY_S = 0.5


class ApiState:
    def __init__(self, settings: ApiSettings, model_settings, *, curve=None) -> None:
        self.settings, self.model_settings, self.curve = settings, model_settings, curve
        self.keys = settings.api_keys()
        self.metrics = ApiMetrics()
        self.log = get_logger("specsplit.api")
        self.pool: OrchestratorPool | None = None
        self.tokenizer: ServedTokenizer | None = None
        self.model_name = settings.api_model_name or ""
        self.started = int(time.time())
        self.inflight = 0  # choices generating now
        self.routes = PromptRoutes(settings.api_prompt_routes, self.metrics.routed)  # routing groups without a key
        self.responses = ResponseStore(settings.api_stored_responses, settings.api_stored_responses_mb << 20)
        self.background = BackgroundRuns()  # background responses running, and the last ones finished
        self.probed = False  # a generation went through end to end
        self.exit_code = 0  # 2: refused to serve (another tokenizer); the server then stops
        self.on_fatal = None  # set by the runner: stops the server

    # ---- lifecycle (Starlette lifespan) ----------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        s = self.settings
        self.pool = OrchestratorPool(s.orchestrator_addresses(), timeout_s=s.produce_timeout_s,
                                     chunk_timeout_s=s.produce_chunk_timeout_s, heartbeat_s=s.produce_heartbeat_s,
                                     liveness=s.produce_liveness, max_resumes=s.produce_max_resumes, curve=self.curve,
                                     retry_overloaded=False, wait_live_s=s.api_orchestrator_wait_s,
                                     per_prompt_token_s=s.produce_timeout_per_prompt_token_s)
        async with self.pool:
            watcher = asyncio.ensure_future(self._watch())
            try:
                yield
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
                await self.background.close()

    async def _watch(self) -> None:
        """Load the tokenizer, then keep checking the fleet's: refuse another one; probe once."""
        try:
            await asyncio.to_thread(self._load_tokenizer)
        except Exception as exc:  # noqa: BLE001  (no tokenizer: nothing can be served)
            self.log.error("tokenizer_unavailable", error=str(exc))
            self._fatal(1)
            return
        while True:
            mismatch = self.fleet_mismatch()
            if mismatch:
                self.log.error("tokenizer_mismatch", detail=mismatch)
                self._fatal(2)
                return
            if not self.probed and self.fleet_tokenizer():
                await self._probe()
            await asyncio.sleep(WATCH_EVERY_S)

    def _load_tokenizer(self) -> None:
        path = wait_for_tokenizer_dir(self.model_settings, self.settings.api_tokenizer_wait_s, log=self.log)
        template = self.settings.api_chat_template
        self.tokenizer = ServedTokenizer(path, template.expanduser().read_text() if template else None)
        if not self.model_name:
            default, _ = target_model_dir(self.model_settings)
            self.model_name = default.name if default.name != "target" else default.parent.name
        self.log.info("tokenizer_loaded", path=str(path), fingerprint=self.tokenizer.fingerprint[:16],
                      model=self.model_name)

    async def _probe(self) -> None:
        probe = (self.tokenizer.encode("Hello") or [0])[:8]
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                await self.pool.generate(probe, max_new_tokens=1)
        except Exception as exc:  # noqa: BLE001  (workers still loading: try again on the next beat)
            self.log.info("probe_failed", error=repr(exc)[:200])
            return
        self.probed = True
        self.log.info("api_serving", model=self.model_name, url=f"http://{self.settings.api_host}:"
                                                                f"{self.settings.bind_port()}/v1")

    def _fatal(self, code: int) -> None:
        self.exit_code = code
        if self.on_fatal is not None:
            self.on_fatal()

    # ---- the fleet ---------------------------------------------------------------------------
    def fleet_tokenizer(self) -> str:
        """The tokenizer fingerprint a live orchestrator reports ("" while none knows one)."""
        for c in self.pool.live if self.pool else ():
            if c.fleet.tokenizer_hash:
                return c.fleet.tokenizer_hash
        return ""

    def fleet_mismatch(self) -> str:
        """Why the fleet serves another tokenizer than ours ("" when it does not, or is unknown)."""
        if self.tokenizer is None:
            return ""
        for c in self.pool.live if self.pool else ():
            theirs = c.fleet.tokenizer_hash
            if theirs and theirs != self.tokenizer.fingerprint:
                return (f"the orchestrator at {c.addr} serves tokenizer {theirs}, this API holds "
                        f"{self.tokenizer.fingerprint} ({self.tokenizer.path}): set the same SPECSPLIT_PRESET / "
                        "SPECSPLIT_TARGET_MODEL for the API as for the workers")
        return ""

    def serving(self) -> tuple[bool, str]:
        """(ready, why not): /health's answer."""
        if self.tokenizer is None:
            return False, "loading the tokenizer"
        if not self.pool.live:
            return False, "no orchestrator answers"
        if not self.fleet_tokenizer():
            return False, "no target worker is live"
        if not self.probed:
            return False, "waiting for the fleet to serve a first generation"
        return True, ""

    def max_model_len(self) -> int:
        """Prompt + new tokens one request may ask for: what the live orchestrators admit."""
        reported = [c.fleet.max_session_tokens for c in self.pool.live if c.fleet.max_session_tokens]
        return min(reported) if reported else 0

    # ---- per request -------------------------------------------------------------------------
    def require_ready(self) -> ServedTokenizer:
        ok, why = self.serving()
        if not ok and (self.tokenizer is None or not self.pool.live or not self.fleet_tokenizer()):
            raise ApiError(503, f"not serving yet: {why}", type="server_error", code="service_unavailable")
        return self.tokenizer

    def check_model(self, name: str) -> None:
        if self.model_name and name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        vocab = max((c.fleet.vocab_size for c in self.pool.live), default=0) or self.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of range [0, {vocab})", param=param)
        return list(ids)
