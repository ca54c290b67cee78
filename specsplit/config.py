"""Process settings (pydantic-settings, env prefix ``SPECSPLIT_``), built in ``__main__`` only.

Models: ``specsplit.models.ModelSettings`` (SPECSPLIT_PRESET, SPECSPLIT_DRAFT_MODEL, ...).
Routers: ``brokers.settings.RouterSettings``. Here: workers, the orchestrator and producers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from brokers.settings import CommonSettings, FleetAddresses, HeartbeatSettings, check_binds
from schemas import SamplingSpec, SpecPVSpec, TreeSpec

# Variables that no longer exist, and what replaced them: setting one is an error at startup
# (a silently ignored setting is worse than a clear refusal).
REMOVED_SETTINGS = {
    "SPECSPLIT_OVERLAP": "best-path overlap was removed: it measured below tree growth (SPECSPLIT_GROW, on by default)",
    "SPECSPLIT_OVERLAP_MIN_HIT_RATE": "best-path overlap was removed (see SPECSPLIT_GROW)",
    "SPECSPLIT_MAX_SESSIONS": "split in two: SPECSPLIT_WORKER_MAX_SESSIONS (a worker's KV cache LRU) and "
                              "SPECSPLIT_ORCHESTRATOR_MAX_SESSIONS (sessions one orchestrator runs at once)",
    "SPECSPLIT_REQUEST_TIMEOUT_S": "split in two: SPECSPLIT_RPC_TIMEOUT_S (orchestrator -> worker requests) and "
                                   "SPECSPLIT_PRODUCE_TIMEOUT_S (a producer's whole generation)",
    "SPECSPLIT_CHUNK_TIMEOUT_S": "renamed SPECSPLIT_PRODUCE_CHUNK_TIMEOUT_S",
    "SPECSPLIT_FRONTEND": "renamed SPECSPLIT_ORCHESTRATOR (the orchestrator binds it, producers connect to it)",
    "SPECSPLIT_ALLOW_PUBLIC_BIND": "removed: a bind beyond loopback needs CURVE keys (SPECSPLIT_CURVE_SECRET_KEY_FILE, "
                                   "SPECSPLIT_CURVE_AUTHORIZED_KEYS; see `specsplit keys new`)",
}


def check_removed_settings(environ=None) -> None:
    """Refuse variables that were removed or split, naming their replacement."""
    environ = os.environ if environ is None else environ
    found = [f"{name}: {why}" for name, why in REMOVED_SETTINGS.items() if name in environ]
    if found:
        raise SystemExit("specsplit: settings no longer read:\n  " + "\n  ".join(found))


def honcho_slot(environ=None) -> int:
    """This process's instance number: N of honcho's HONCHO_PROCESS_NAME "role.N" (foreman: PS);
    1 without one."""
    environ = os.environ if environ is None else environ
    name = environ.get("HONCHO_PROCESS_NAME") or environ.get("PS") or ""
    tail = name.rsplit(".", 1)[-1]
    return int(tail) if "." in name and tail.isdigit() and int(tail) >= 1 else 1


def orchestrator_address(base: str, index: int) -> str:
    """The index-th (0-based) orchestrator's address: ``base`` with its TCP port + index."""
    if index == 0:
        return base
    head, sep, port = base.rpartition(":")
    if not (sep and port.isdigit()):
        raise ValueError(f"{base!r}: several orchestrators need a tcp://host:port base address")
    return f"{head}:{int(port) + index}"


class SessionLimitSettings(HeartbeatSettings):
    """Read by workers (their per-session KV limit) and orchestrators (which refuse, before it
    starts, a request that could never fit it): one variable, one meaning."""

    max_session_tokens: int = Field(default=4096, ge=16)


class WorkerSettings(SessionLimitSettings):
    """A draft or target worker. Env: SPECSPLIT_WORKER_ID, SPECSPLIT_THREADS, ..."""

    worker_id: str | None = None  # stable identity, so a restarted worker reclaims it
    threads: int | None = None  # torch threads (CPU); default: see backends.default_threads
    draft_threads: int | None = None  # per-role overrides of threads
    target_threads: int | None = None
    # torch threads for forwards of more than 64 new tokens (prefills); default: every core
    prefill_threads: int | None = Field(default=None, ge=1)
    worker_max_sessions: int = Field(default=256, ge=1)  # sessions whose KV caches a worker keeps (LRU)
    session_ttl_s: float = Field(default=900.0, gt=0)
    max_tree_nodes: int = Field(default=64, ge=1, le=256)
    max_tree_depth: int = Field(default=16, ge=1, le=64)
    max_queue: int = Field(default=1024, ge=1)
    # a target worker verifies the requests queued when a forward starts in ONE forward, up to
    # this many new tokens (sync tokens + tree nodes) per forward; 0: one request per forward
    target_max_batch_tokens: int = Field(default=256, ge=0)
    # the same for a draft worker: greedy sessions' trees built in lockstep, one forward per
    # step (sampled sessions draft alone, so a seeded run's output never depends on which
    # sessions shared a forward: engine.draft_batch.batchable). Off by default: under load the
    # cost model decodes plainly (no draft call) on the CPUs measured, so it has not paid yet
    draft_max_batch_tokens: int = Field(default=0, ge=0)
    # a batching worker holds a forward open for up to this fraction of its recent forward time
    # while sessions it serves are due to send their next request (measured turnaround), so that
    # sessions in lockstep share one forward instead of alternating in groups (transport.batching.Gather)
    batch_hold: float = Field(default=0.3, ge=0, le=1)
    # small requests (tree-sized forwards that recently took < heartbeat_s / 4) served on the
    # socket thread while the engine thread is idle: no thread hand-off (see transport.worker_loop).
    # Unset: only where such a forward runs on one thread (Backend.inline_safe): a multi-thread
    # forward on a second thread makes libgomp stop spinning (specsplit.compute; measured on the
    # 2-core box, the 1.5B llama.cpp target's 1-token verify on 2 threads 100-130 ms inline, ~60 not)
    inline: bool | None = None
    # dynamic int8 Linear layers (CPU backend; torch.ao, fbgemm): a quantized target is its own
    # reference (greedy output = that quantized model's greedy decoding, up to the dynamic
    # activation scale, which depends on how many tokens a forward carries)
    draft_quantize: Literal["none", "int8"] = "none"
    target_quantize: Literal["none", "int8"] = "none"
    # bf16/fp16 Linear weights reordered once into oneDNN's layout (bit-identical, ~1.4x faster
    # target forwards on CPU; see specsplit.models.packing)
    pack_weights: bool = True
    # CPU: each tree-sized forward runs on the role's threads or on every core (the prefill
    # threads), whichever the worker measures faster for forwards of that size
    # (backends.ThreadChooser): every core when the other role idles, the role's share when it
    # computes beside it
    adaptive_threads: bool = False
    # CPU: at most every this many seconds, after a forward, a worker gives its C heap's free
    # pages back to the system (glibc malloc_trim; backends.CpuBackend.trim), so its RSS follows
    # what it holds instead of the high-water mark of sessions and batches come and gone. 0: never
    trim_every_s: float = Field(default=10.0, ge=0, le=3600)
    # CUDA: let torch's scaled-dot-product attention pick cuDNN's kernel. Off by default: for the
    # additive masks every tree forward passes, cuDNN builds a plan per new key length, and a
    # serving cache grows by a token or more every round, so nearly every forward paid it
    # (H200, torch 2.11: ~70 ms per fresh length against 0.3-3 ms for the memory-efficient
    # kernel at 4K-64K keys; a 1.5B verify at 16K 126 -> 32 ms; backends.CudaBackend)
    cuda_cudnn_attention: bool = False
    # CUDA: decode steps and trees (up to 64 new tokens) over 8K+ cached tokens attend through
    # grouped matmuls (models.attention.gqa_attention) instead of sdpa's memory-efficient kernel,
    # which runs a few blocks of threads for a few queries (a 1.5B verify at 64K cached tokens on
    # an H200: 97.8 -> 44.7 ms). Off: every forward through transformers' sdpa
    cuda_grouped_attention: bool = True
    # draft forwards allowed after re-rooting a grown tree (None: up to max_depth, as from scratch).
    # These are on the round's critical path (the target waits for them), while growth expands the
    # same nodes during the next verify at no wait; a re-rooted tree always has the bonus node's
    # children. Measured on the 2-core box (qwen-coder, int8, HumanEval 60-62): None 10.9 tok/s
    # (440 ms of draft per round), 0 13.8 tok/s (54 ms), 1 13.4; so 0 by default
    draft_steps_after_reuse: int | None = Field(default=0, ge=0, le=64)
    # long contexts: past sink + window cached tokens, draft forwards attend to the first
    # draft_sink_tokens and the last draft_window_tokens only (0: the whole context). The draft
    # only proposes, so this never changes the output (specsplit.engine.draftview)
    draft_window_tokens: int = Field(default=2048, ge=0, le=1_048_576)
    draft_sink_tokens: int = Field(default=64, ge=0, le=65_536)
    # which kernels run a role's model: "torch" (transformers on the role's device, with the
    # backend's int8/packing/threads) or "llamacpp" (the role's GGUF on llama.cpp's CPU kernels
    # through llama-cpp-python; specsplit.engine.llamacpp)
    draft_engine: Literal["torch", "llamacpp"] = "torch"
    target_engine: Literal["torch", "llamacpp"] = "torch"
    llamacpp_ctx: int = Field(default=32768, ge=256, le=1_048_576)  # cells of a llama.cpp worker's shared KV cache

    def engine_for(self, service: str) -> str:
        return self.draft_engine if service == "draft" else self.target_engine

    def quantize_for(self, service: str) -> str:
        return self.draft_quantize if service == "draft" else self.target_quantize

    def threads_for(self, service: str) -> int | None:
        return getattr(self, f"{service}_threads") or self.threads

    def backend(self, service: str) -> str:
        return self.draft_backend if service == "draft" else self.target_backend

    def identity(self, service: str) -> str:
        # honcho sets HONCHO_PROCESS_NAME ("target.2"), foreman PS: stable across restarts of that slot
        slot = os.environ.get("HONCHO_PROCESS_NAME") or os.environ.get("PS") or str(os.getpid())
        return self.worker_id or f"{service}-{slot}"


class OrchestratorSettings(SessionLimitSettings):
    """The orchestrator. Env: SPECSPLIT_ORCHESTRATOR, SPECSPLIT_TREE_MAX_NODES, SPECSPLIT_GROW, ...
    SPECSPLIT_HEARTBEAT_S / _LIVENESS keep their one meaning (liveness with a router): the
    orchestrator pings each router every heartbeat and declares it lost after liveness beats."""

    # measured on 2 cores with the qwen-coder pair: a deep, narrow tree that stops below
    # unlikely paths (16 nodes, depth 10, branch 2, min_path_prob 0.3) beat 10/6/2 by ~25%
    tree_max_nodes: int = Field(default=16, ge=1, le=256)
    tree_max_depth: int = Field(default=10, ge=0, le=64)
    tree_branch: int = Field(default=2, ge=1, le=32)
    tree_min_path_prob: float = Field(default=0.3, ge=0.0, le=1.0)
    # greedy sessions: the draft worker keeps expanding the tree while the target verifies it,
    # for grow_fraction of the previous verify time; the next round re-roots it at the bonus token
    # greedy sessions: up to this many prompt-lookup tokens (what followed an earlier occurrence of
    # the context's last >= lookup_min_ngram tokens) hung under each round's tree; 0: off
    lookup_max_tokens: int = Field(default=8, ge=0, le=64)
    # where the context has no prompt-lookup candidate, the continuation that earlier sessions'
    # answers had after the same 2-4 tokens (specsplit.orchestrator.ngrams: a cross-session
    # n-gram cache of at most this many n-grams, ~400 bytes each; 0: off, e.g. where clients must
    # not learn from their speed whether others generated the same text)
    lookup_cache_keys: int = Field(default=65536, ge=0, le=16_777_216)
    # greedy sessions: "cost" keeps, per round, the tree nodes whose expected acceptance pays for
    # their measured verify time and sets the round's min_path_prob from the measured draft cost
    # (tree_min_path_prob is then only the first rounds' value; specsplit.orchestrator.costmodel);
    # "fixed": the whole tree as configured
    tree_budget: Literal["cost", "fixed"] = "cost"
    lookup_min_ngram: int = Field(default=3, ge=1, le=16)
    # where a round's candidates come from: "draft" (the draft worker's tree, plus prompt lookup)
    # or "lookup" (prompt lookup alone, no draft call: every round verifies its root plus the
    # lookup candidates that pay, like vLLM's "ngram" speculator and llama.cpp's lookup decoding;
    # sampled sessions decode plainly). For targets whose forward of a few tokens costs about
    # what one token's does (GPUs; not measured here), or when no draft model fits; measured
    # slower than drafting on the AVX2 2-core box (README). No draft worker is then needed
    # (`honcho start -c draft=0`), and the target may take every core (SPECSPLIT_TARGET_THREADS)
    speculator: Literal["draft", "lookup"] = "draft"
    grow: bool = True
    grow_fraction: float = Field(default=0.9, gt=0.0, le=4.0)
    grow_width: int = Field(default=4, ge=1, le=32)
    rpc_timeout_s: float = Field(default=60.0, gt=0)  # one orchestrator -> worker request
    max_attempts: int = Field(default=8, ge=1)
    backoff_s: float = Field(default=0.05, gt=0)
    backoff_max_s: float = Field(default=2.0, gt=0)
    orchestrator_max_sessions: int = Field(default=1024, ge=1)  # sessions admitted (running + queued); more: OVERLOADED
    # sessions drafting/verifying at once (the rest wait in a fair queue): at most what the workers'
    # KV caches hold (SPECSPLIT_WORKER_MAX_SESSIONS each), divided among the orchestrators
    orchestrator_active_sessions: int = Field(default=256, ge=1)
    orchestrator_client_share: float = Field(default=0.75, gt=0, le=1)  # of max_sessions one producer may hold
    # max_session_tokens (SessionLimitSettings): a request that can never fit (prompt +
    # max_new_tokens + a tree) is refused with BAD_REQUEST before it starts
    # this instance's producer address; default: SPECSPLIT_ORCHESTRATOR for instance 1 (or no
    # honcho slot), its port + N-1 for honcho's "orchestrator.N" (see orchestrator_address)
    orchestrator_bind: str | None = None
    # SpecPV partial verification for sessions whose GenerateRequest has no ``specpv`` of its own:
    # SPECSPLIT_SPECPV=true turns it on with SpecPVSpec's defaults, and so does setting any
    # SPECSPLIT_SPECPV_* parameter (off unless set; SPECSPLIT_SPECPV=false keeps it off)
    specpv: bool | None = None
    specpv_block_size: int | None = None
    specpv_sink_blocks: int | None = None
    specpv_retrieval_blocks: int | None = None
    specpv_window_blocks: int | None = None
    specpv_buffer_tokens: int | None = None
    specpv_threshold: int | None = None
    specpv_refresh_every: int | None = None
    specpv_exact: bool | None = None

    def specpv_spec(self) -> SpecPVSpec | None:
        """The fleet's default SpecPV spec, validated (bounds: SpecPVSpec), or None (off)."""
        given = {name: getattr(self, f"specpv_{name}") for name in SpecPVSpec.model_fields
                 if getattr(self, f"specpv_{name}") is not None}
        if self.specpv is False or (self.specpv is None and not given):
            return None
        return SpecPVSpec(**given)

    @model_validator(mode="after")
    def _check_specpv(self) -> OrchestratorSettings:
        try:
            self.specpv_spec()  # a bad SPECSPLIT_SPECPV_* value is refused at startup, not per request
        except ValidationError as exc:
            raise ValueError(f"SPECSPLIT_SPECPV_*: {exc}") from None
        return self

    @model_validator(mode="after")
    def _check_bind(self) -> OrchestratorSettings:
        check_binds([self.bind_address()], self.curve_on, self.curve_authorized_keys is not None)
        if self.curve_on and not self.curve_server_key:
            raise ValueError("CURVE is on (SPECSPLIT_CURVE_SECRET_KEY_FILE) but the orchestrator, a client of the "
                             "routers, needs SPECSPLIT_CURVE_SERVER_KEY (their public key)")
        return self

    def bind_address(self, environ=None) -> str:
        environ = os.environ if environ is None else environ
        if self.orchestrator_bind:
            return self.orchestrator_bind
        return orchestrator_address(self.orchestrator, honcho_slot(environ) - 1)

    def tree(self) -> TreeSpec:
        return TreeSpec(max_nodes=self.tree_max_nodes, max_depth=self.tree_max_depth, branch=self.tree_branch,
                        min_path_prob=self.tree_min_path_prob)


class SupervisorSettings(CommonSettings):
    """The supervising parent of every role's command (specsplit.supervise). Env:
    SPECSPLIT_SUPERVISE (false: the command does the work itself, unsupervised),
    SPECSPLIT_SUPERVISE_BACKOFF_S / _BACKOFF_MAX_S (restart back-off, doubling), _STABLE_S (uptime
    after which the back-off starts over), _STOP_TIMEOUT_S (SIGTERM to SIGKILL of the child),
    _MAX_QUICK_RESTARTS (give up on a crash loop)."""

    supervise: bool = True
    supervise_backoff_s: float = Field(default=0.5, gt=0)
    supervise_backoff_max_s: float = Field(default=10.0, gt=0)
    supervise_stable_s: float = Field(default=30.0, gt=0)
    supervise_stop_timeout_s: float = Field(default=90.0, gt=0)
    # a crash loop (this many deaths in a row, each before supervise_stable_s of uptime: a missing
    # model, a bad setting) ends the supervisor with the child's code, so the operator sees it
    supervise_max_quick_restarts: int = Field(default=20, ge=1)


class ProducerSettings(FleetAddresses):
    """specsplit produce. Env: SPECSPLIT_ORCHESTRATOR, SPECSPLIT_ORCHESTRATOR_COUNT,
    SPECSPLIT_PRODUCE_TIMEOUT_S, ..."""

    produce_timeout_s: float = Field(default=600.0, gt=0)  # one whole generation
    produce_chunk_timeout_s: float = Field(default=300.0, gt=0)  # between two streamed chunks
    # orchestrators serving side by side (honcho -c orchestrator=N): SPECSPLIT_ORCHESTRATOR and the
    # next N-1 ports; producers spread requests over the live ones and resume on another when one dies
    orchestrator_count: int = Field(default=1, ge=1, le=64)
    produce_heartbeat_s: float = Field(default=1.0, gt=0, le=60)  # producer -> orchestrator pings
    produce_liveness: int = Field(default=3, ge=1, le=100)  # missed pings before an orchestrator is dead
    produce_max_resumes: int = Field(default=16, ge=0)  # per prompt: resumes after a lost orchestrator

    def orchestrator_addresses(self) -> list[str]:
        return [orchestrator_address(self.orchestrator, i) for i in range(self.orchestrator_count)]

    @staticmethod
    def sampling(temperature: float, top_p: float, top_k: int, seed: int) -> SamplingSpec:
        return SamplingSpec(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


class ApiSettings(ProducerSettings):
    """``specsplit api``, the OpenAI-compatible HTTP front door: a producer of the orchestrators
    (SPECSPLIT_ORCHESTRATOR, _ORCHESTRATOR_COUNT, the SPECSPLIT_PRODUCE_* timeouts and resumes)
    that serves HTTP. Env: SPECSPLIT_API_HOST, SPECSPLIT_API_PORT, SPECSPLIT_API_KEYS_FILE, ..."""

    api_host: str = "127.0.0.1"
    # instance N of `honcho start -c api=N` listens on api_port + N - 1 (as orchestrators do)
    api_port: int = Field(default=8000, ge=0, le=65535)
    # one API key a line (blank lines and # comments skipped); clients send "Authorization: Bearer
    # KEY" on /v1/*. Unset: no keys, and then only a loopback api_host is allowed
    api_keys_file: Path | None = None
    # the model id clients name (and /v1/models lists); unset: the target model directory's name
    api_model_name: str | None = Field(default=None, min_length=1, max_length=256)
    # request bodies larger than this get 413 before they are read (default: a full-context
    # prompt of 131072 tokens as JSON text, escapes included)
    api_max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=1 << 30)
    api_header_timeout_s: float = Field(default=10.0, gt=0, le=600)  # a request's headers, from connect
    api_body_timeout_s: float = Field(default=30.0, gt=0, le=600)  # a request's body, once its headers came
    api_keep_alive_s: float = Field(default=5.0, gt=0, le=600)  # an idle keep-alive connection
    # how long a request waits for a live orchestrator before 503 (an orchestrator restarting)
    api_orchestrator_wait_s: float = Field(default=10.0, ge=0, le=600)
    # the workers provision the models; the API waits this long for the target's tokenizer files
    api_tokenizer_wait_s: float = Field(default=1800.0, gt=0)
    api_max_concurrent_requests: int = Field(default=1024, ge=1)  # beyond: 429 at once

    @model_validator(mode="after")
    def _check_api_bind(self) -> ApiSettings:
        from brokers.sockets import is_loopback_address

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


ROLES = ("router", "draft", "target", "orchestrator", "produce", "api")


def effective_settings(role: str) -> dict:
    """What a process of ``role`` would run with, from this environment, as JSON-ready data:
    its settings objects plus the values derived from them (model dtype and device, backend
    threads, addresses). ``specsplit config [ROLE]`` prints it."""
    if role == "router":
        from brokers.settings import SERVICES, RouterSettings

        return {service: {**RouterSettings(service=service).model_dump(mode="json"),
                          **metrics_effective(f"router_{service}")} for service in SERVICES}
    if role in ("draft", "target"):
        from specsplit.backends import build_backend
        from specsplit.models import ModelSettings
        from specsplit.workers import model_dtype

        worker, models = WorkerSettings(), ModelSettings()
        device = getattr(models, f"{role}_device")
        backend = build_backend(role, device, worker)
        return {
            "worker": worker.model_dump(mode="json"),
            "models": models.model_dump(mode="json"),
            "effective": {
                "identity": worker.identity(role), "router_backend": worker.backend(role),
                "model": getattr(models, f"{role}_model") or f"preset {models.preset}",
                "dtype": backend.load_dtype(model_dtype(role, models)), "device": device,
                **backend.describe(), **metrics_effective(role),
            },
        }
    if role == "orchestrator":
        s = OrchestratorSettings()
        spec = s.specpv_spec()
        return {"orchestrator": s.model_dump(mode="json"),
                "effective": {"tree": s.tree().model_dump(mode="json"),
                              "specpv": spec.model_dump(mode="json") if spec else None,
                              **metrics_effective(role)}}
    if role == "produce":
        return {"produce": ProducerSettings().model_dump(mode="json")}
    if role == "api":
        s = ApiSettings()
        return {"api": s.model_dump(mode="json"), "effective": {"url": f"http://{s.api_host}:{s.bind_port()}/v1"}}
    raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")


def metrics_effective(role: str) -> dict:
    """The metrics settings a process of ``role`` (this honcho instance) reads, and the URL it
    serves (None: off)."""
    from brokers.metrics import instance_slot, metrics_port
    from brokers.settings import MetricsSettings

    s = MetricsSettings()
    try:
        port = metrics_port(s, role, instance_slot())
    except ValueError as exc:  # the process would log it and serve no metrics
        return {"metrics": s.model_dump(mode="json"), "metrics_url": None, "metrics_error": str(exc)}
    return {"metrics": s.model_dump(mode="json"),
            "metrics_url": f"http://{s.metrics_host}:{port}/metrics" if port else None}
