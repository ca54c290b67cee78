"""Process settings (pydantic-settings, env prefix ``SPECSPLIT_``), built in ``__main__`` only.

Models: ``specsplit.models.ModelSettings``. Routers and the shared settings: ``brokers.settings``.
Here: workers, the orchestrator, the supervisor and producers; the HTTP API's are in
``specsplit.api.settings``. Each field's ``description`` is its documentation: docs/configuration.md
is generated from it
(``specsplit config --markdown``, specsplit.configdoc); what a role would run with,
``specsplit config ROLE``: specsplit.effective.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

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
    """Read by workers and orchestrators with one meaning: the per-session KV limit (workers hold
    it, orchestrators refuse before it starts a request that could never fit), the speculator
    (orchestrators draft with it; workers size their threads by it) and the draft's grammar masks
    (orchestrators send the grammar, draft workers apply it)."""

    speculator: Literal["draft", "lookup"] = Field(default="draft", description=(
        "Where a round's candidates come from: `draft` (the draft worker's tree plus prompt lookup) or "
        "`lookup` (prompt lookup alone, like vLLM's ngram speculator; sampled sessions decode plainly). "
        "`lookup` needs no draft worker (`honcho start -c draft=0`): for targets whose forward of a few tokens "
        "costs about one token's (GPUs), or when no draft model fits. Workers read it too: with `lookup` a CPU target takes every core "
        "by default (no draft worker shares them)."))

    draft_grammar: bool = Field(default=False, description=(
        "A session held to a grammar (JSON output, structured outputs, required tool calls): true makes the "
        "orchestrators send the draft the session's grammar and the draft mask its proposals to what it allows, "
        "as the target masks its verification, with a matcher of its own per session. Rounds then accept more (2-12% fewer rounds on the real pair), but the draft, "
        "surer of itself, drafts deeper trees: on a 2-core CPU 0.96-0.995x the tok/s of false, so false is the "
        "default; turn it on where draft forwards are cheap beside verification. Never changes the output "
        "(docs/results.md)."))
    max_session_tokens: int = Field(default=4096, ge=16, description=(
        "Tokens one session may hold (prompt + answer + a tree): a worker's per-session KV limit; the "
        "orchestrator refuses with BAD_REQUEST, before it starts, a request that could never fit."))


# a KV pool's size: GB, or "auto" (sized to a CUDA device's free memory; specsplit.engine.kvpool)
PoolGB = Annotated[float, Field(ge=0, le=65536)] | Literal["auto"]


class WorkerSettings(SessionLimitSettings):
    """A draft or target worker: threads, session caches, batching and the kernels its model runs on."""

    worker_id: str | None = Field(default=None, description=(
        "This worker's identity at its router, stable so that a restarted worker takes its place again. "
        "Unset: the role and honcho's process name (`target-target.2`), or the process id outside honcho."))
    threads: int | None = Field(default=None, description=(
        "Torch threads of this worker's tree-sized forwards on CPU. Unset: the draft takes a quarter of the "
        "cores (at least one) and the target the rest, so the two never oversubscribe them."))
    draft_threads: int | None = Field(default=None, description="SPECSPLIT_THREADS for draft workers only.")
    target_threads: int | None = Field(default=None, description="SPECSPLIT_THREADS for target workers only.")
    prefill_threads: int | None = Field(default=None, ge=1, description=(
        "Torch threads of forwards of more than 64 new tokens (prompt prefills). Unset: every core."))
    draft_prefill_threads: int | None = Field(default=None, ge=1, description=(
        "SPECSPLIT_PREFILL_THREADS for draft workers only."))
    target_prefill_threads: int | None = Field(default=None, ge=1, description=(
        "SPECSPLIT_PREFILL_THREADS for target workers only."))
    worker_max_sessions: int = Field(default=256, ge=1, description=(
        "Sessions whose KV caches a worker keeps; beyond it, the least recently used is dropped."))
    session_ttl_s: float = Field(default=900.0, gt=0, description=(
        "Seconds a session may go unused before the worker drops its KV cache."))
    max_tree_nodes: int = Field(default=64, ge=1, le=256, description=(
        "Largest tree a worker drafts or verifies, in nodes; a target refuses a larger one."))
    max_tree_depth: int = Field(default=16, ge=1, le=64, description=(
        "Deepest tree a worker drafts or verifies; a target refuses a deeper one."))
    max_queue: int = Field(default=1024, ge=1, description=(
        "Requests waiting for the worker's engine at most; beyond it a request is refused at once."))
    target_max_batch_tokens: int = Field(default=256, ge=0, description=(
        "A target worker verifies the requests queued when a forward starts in one forward, up to this many "
        "new tokens (sync tokens + tree nodes). 0: one request per forward."))
    draft_max_batch_tokens: int = Field(default=0, ge=0, description=(
        "The same for a draft worker: greedy sessions' trees built in lockstep, one forward per step (sampled "
        "sessions draft alone, so a seeded output never depends on batching). 0 (off): under load the cost "
        "model decodes plainly, without drafts, so batched drafting has not paid yet."))
    batch_hold: float = Field(default=0.3, ge=0, le=1, description=(
        "A batching worker holds a forward open for up to this fraction of its recent forward time while "
        "sessions it serves are due to send their next request, so sessions in lockstep share one forward."))
    inline: bool | None = Field(default=None, description=(
        "Serve small requests (forwards that recently took under a quarter of SPECSPLIT_HEARTBEAT_S) on the "
        "socket thread while the engine is idle, with no thread hand-off. Unset: only where such a forward "
        "runs on one thread (a multi-thread forward on a second thread makes libgomp stop spinning)."))
    draft_quantize: Literal["none", "int8"] = Field(default="none", description=(
        "Dynamic int8 Linear layers for the draft model (CPU, torch engine)."))
    target_quantize: Literal["none", "int8"] = Field(default="none", description=(
        "Dynamic int8 Linear layers for the target model (CPU, torch engine). A quantized target is its own "
        "reference: its greedy output is that quantized model's greedy decoding (up to the dynamic activation "
        "scale, which depends on how many tokens a forward carries)."))
    draft_kv_pool_gb: PoolGB = Field(default="auto", description=(
        "Torch draft engine: GB (10^9 bytes) of KV cache allocated once at startup on the model's device, one "
        "fixed slot of SPECSPLIT_MAX_SESSION_TOKENS per session (at most SPECSPLIT_WORKER_MAX_SESSIONS slots; "
        "static buffers, what CUDA graphs need). When every slot is held, the least recently used idle "
        "session is dropped; a new session gets OVERLOADED (retryable) while every slot has a request in "
        "flight. A pool smaller than one slot is refused at startup. 0: caches grow per session as needed. "
        "`auto`: on CUDA, SPECSPLIT_WORKER_MAX_SESSIONS slots or as many as the device's free memory holds "
        "after the model loaded, leaving 10 % of its memory (at least 3 GB) free and taking at most half of "
        "it (so a second worker on the card finds room); none if not one fits (logged); elsewhere 0."))
    target_kv_pool_gb: PoolGB = Field(default="auto", description=(
        "The same for a torch target engine (SPECSPLIT_DRAFT_KV_POOL_GB)."))
    draft_prefix_cache_gb: float = Field(default=0.5, ge=0, le=65536, description=(
        "Torch draft engine: GB (10^9 bytes) of K/V kept, on the model's device, of new sessions' contexts once "
        "forwarded and of sessions that ended or were evicted; a new session whose context starts with tokens held there (a conversation's next turn, "
        "a shared system prompt) copies them, in whole blocks of 64 tokens, instead of forwarding them again. "
        "Least recently used first out. 0: off. A hit answers sooner, which tells a client that some earlier "
        "request began the same way (docs/operations.md)."))
    target_prefix_cache_gb: float = Field(default=1.0, ge=0, le=65536, description=(
        "The same for a torch target engine (SPECSPLIT_DRAFT_PREFIX_CACHE_GB). Its output is unchanged: it "
        "reuses only positions its own prefill of the new context would compute the same way."))
    pack_weights: bool = Field(default=True, description=(
        "Reorder bf16/fp16 Linear weights once into oneDNN's layout (CPU): bit-identical, faster target "
        "forwards (specsplit.models.packing)."))
    int8_cache: bool = Field(default=True, description=(
        "int8 target (CPU): keep its Linear layers' int8 codes beside the model "
        "(`int8-<kernel>-<dtype>-v1.safetensors` in the model directory, about half the bf16 weights' size) "
        "and read them at the next start instead of quantizing again (specsplit.models.int8_cache). A "
        "directory that cannot be written only costs the time; `specsplit models pull --int8-codes` writes "
        "them ahead, for a model directory the workers read only."))
    adaptive_threads: bool = Field(default=False, description=(
        "CPU: run each tree-sized forward on the role's threads or on every core, whichever the worker "
        "measures faster for forwards of that size (every core while the other role idles)."))
    trim_every_s: float = Field(default=10.0, ge=0, le=3600, description=(
        "CPU: at most this often, after a forward, give the C heap's free pages back to the system "
        "(malloc_trim), so RSS follows what the worker holds, not its high-water mark. 0: never."))
    cuda_cudnn_attention: bool = Field(default=False, description=(
        "CUDA: let torch's scaled-dot-product attention pick cuDNN's kernel. Off: with a tree's additive mask "
        "cuDNN builds a plan per new key length, and a serving cache grows every round (see docs/results.md)."))
    cuda_grouped_attention: bool = Field(default=True, description=(
        "CUDA: forwards of up to 64 new tokens over 8K+ cached tokens attend through grouped matmuls instead "
        "of sdpa's memory-efficient kernel, which runs few thread blocks for few queries. Off: sdpa always."))
    cuda_graphs: bool = Field(default=True, description=(
        "CUDA, with a KV pool (SPECSPLIT_TARGET_KV_POOL_GB / SPECSPLIT_DRAFT_KV_POOL_GB, `auto` by default): "
        "forwards of up to 64 new tokens per session and 32 sessions replay CUDA graphs, one per shape bucket: "
        "one session's up to 2,048 cached tokens captured at start, the rest on first use "
        "(specsplit.engine.graphs). Off, or without a pool: eager forwards."))
    cuda_graph_body: Literal["triton_gemm", "triton", "fused", "transformers"] = Field(default="fused", description=(
        "What a CUDA graph replays: fused, the decoder with q/k/v and gate/up each in one GEMM, RMSNorm in "
        "one kernel and the rotation as one matmul (specsplit.engine.fused; llama, qwen2 and qwen3 models, "
        "others fall back); triton, the same with the rotation and the K/V writes, attention over the pool "
        "read in place, and SiLU x up as Triton kernels (specsplit.engine.kernels; about half the fused "
        "body's kernels; without Triton the fused body); triton_gemm, triton with its GEMMs of up to 64 rows "
        "in Triton too, RMSNorm and SiLU x up folded into them (specsplit.engine.matmul; six or seven kernels "
        "a layer); transformers, the model's own modules (about twice "
        "the fused body's kernels). At start each body checks one forward against what it replaces (the "
        "modules, the torch operations) on this device and, if they differ or it fails, falls back (logged)."))
    cuda_gemm_tune: bool = Field(default=True, description=(
        "The triton_gemm body: the first product of each kind (q/k/v, o, gate/up, down, the head) times a few "
        "tiles on the GPU, the reduction split over more programs among them where the output columns give "
        "few, and keeps the fastest whose result matches (specsplit.engine.matmul; a few seconds at start). "
        "Off: the default tiles."))
    draft_steps_after_reuse: int | None = Field(default=0, ge=0, le=64, description=(
        "Draft forwards allowed after re-rooting a grown tree (unset: up to the tree's depth, as from scratch). "
        "They delay the round, while growth adds the same nodes during the next verify at no wait; 0 measured "
        "fastest (see docs/results.md)."))
    draft_grow_spares: int = Field(default=2, ge=0, le=16, description=(
        "Greedy growth: tokens past a node's SPECSPLIT_TREE_BRANCH most probable children that the draft may "
        "add as more siblings while the target verifies, ranked with the other nodes by path probability. When "
        "the target rejects every verified child of a node, its token is often the next one down: a forwarded "
        "sibling lets the next round start from the grown tree instead of drafting from scratch "
        "(docs/results.md). 0: children past the branch are never drafted."))
    draft_window_tokens: int = Field(default=2048, ge=0, le=1_048_576, description=(
        "Long contexts: past sink + window cached tokens, draft forwards attend only to the first "
        "SPECSPLIT_DRAFT_SINK_TOKENS and the last this many (0: the whole context). Never changes the output: "
        "the draft only proposes. Not applied where the draft replays CUDA graphs (a KV pool on CUDA): there a "
        "replay over the whole cache costs less than a windowed forward, which runs eagerly."))
    draft_sink_tokens: int = Field(default=64, ge=0, le=65_536, description=(
        "The first context tokens a windowed draft forward still attends to (SPECSPLIT_DRAFT_WINDOW_TOKENS)."))
    draft_engine: Literal["torch", "llamacpp"] = Field(default="torch", description=(
        "Kernels that run the draft model: `torch` (transformers on SPECSPLIT_DRAFT_DEVICE) or `llamacpp` "
        "(its GGUF on llama.cpp's CPU kernels; needs `pip install -e '.[gguf]'`)."))
    target_engine: Literal["torch", "llamacpp"] = Field(default="torch", description=(
        "Kernels that run the target model: `torch` or `llamacpp`, as SPECSPLIT_DRAFT_ENGINE."))
    llamacpp_ctx: int = Field(default=32768, ge=256, le=1_048_576, description=(
        "Cells of a llama.cpp worker's KV cache, shared by all its sessions."))

    def engine_for(self, service: str) -> str:
        return self.draft_engine if service == "draft" else self.target_engine

    def kv_pool_gb_for(self, service: str) -> float | str:
        return self.draft_kv_pool_gb if service == "draft" else self.target_kv_pool_gb

    def prefix_cache_gb_for(self, service: str) -> float:
        return self.draft_prefix_cache_gb if service == "draft" else self.target_prefix_cache_gb

    def quantize_for(self, service: str) -> str:
        return self.draft_quantize if service == "draft" else self.target_quantize

    def threads_for(self, service: str) -> int | None:
        return getattr(self, f"{service}_threads") or self.threads

    def prefill_threads_for(self, service: str) -> int | None:
        return getattr(self, f"{service}_prefill_threads") or self.prefill_threads

    def backend(self, service: str) -> str:
        return self.draft_backend if service == "draft" else self.target_backend

    def identity(self, service: str) -> str:
        # honcho sets HONCHO_PROCESS_NAME ("target.2"), foreman PS: stable across restarts of that slot
        slot = os.environ.get("HONCHO_PROCESS_NAME") or os.environ.get("PS") or str(os.getpid())
        return self.worker_id or f"{service}-{slot}"


class OrchestratorSettings(SessionLimitSettings):
    """The orchestrator: draft trees, prompt lookup, retries, admission and SpecPV.
    SPECSPLIT_HEARTBEAT_S / _LIVENESS keep their one meaning: the orchestrator pings each router
    every heartbeat and declares it lost after liveness missed beats."""

    tree_max_nodes: int = Field(default=16, ge=1, le=256, description=(
        "Nodes of a round's draft tree at most, root included. The tree defaults (deep and narrow, stopping "
        "below unlikely paths) measured fastest on CPU (see docs/results.md)."))
    tree_max_depth: int = Field(default=10, ge=0, le=64, description=(
        "Depth of a round's draft tree at most (0: no speculation, one token a round)."))
    tree_branch: int = Field(default=2, ge=1, le=32, description="Children of a draft tree's node at most.")
    tree_min_path_prob: float = Field(default=0.3, ge=0.0, le=1.0, description=(
        "The draft stops adding levels once its most probable frontier path falls below this probability "
        "(0: always to full depth). With SPECSPLIT_TREE_BUDGET=cost, only the first rounds' value."))
    lookup_max_tokens: int = Field(default=8, ge=0, le=64, description=(
        "Greedy sessions: prompt-lookup tokens (what followed an earlier occurrence of the context's last "
        "tokens) hung under each round's tree, at most. 0: off."))
    lookup_cache_keys: int = Field(default=65536, ge=0, le=16_777_216, description=(
        "Where prompt lookup finds nothing, propose what earlier sessions' answers had after the same 2-4 "
        "tokens, from a cross-session n-gram cache of at most this many n-grams. 0: off (e.g. where clients "
        "must not learn from their speed whether others generated the same text)."))
    tree_budget: Literal["cost", "fixed"] = Field(default="cost", description=(
        "Greedy sessions: `cost` keeps, each round, the tree nodes whose expected acceptance pays for their "
        "measured verify time, and sets the round's path-probability cut from the measured draft cost; "
        "`fixed`: the whole tree as configured."))
    lookup_min_ngram: int = Field(default=3, ge=1, le=16, description=(
        "Shortest run of the context's last tokens that prompt lookup matches earlier in the context."))
    proposers: str = Field(default="", description=(
        "What proposes each round's tokens, in order, comma-separated (specsplit.proposers): `draft` (the "
        "draft model's tree), `lookup` (prompt lookup), `ngrams` (the cross-session n-gram cache, asked where "
        "lookup finds nothing), `repeat_line` (the rest of the previous line; loads the target's tokenizer), "
        "`grammar` (the tokens a session's grammar forces, as its target reports them), `prediction` (a "
        "request's predicted output, OpenAI's `prediction`). "
        "The chain proposers (all but `draft`) add at most SPECSPLIT_LOOKUP_MAX_TOKENS nodes a round together. "
        "Empty: from SPECSPLIT_SPECULATOR, SPECSPLIT_LOOKUP_MAX_TOKENS and SPECSPLIT_LOOKUP_CACHE_KEYS."))
    trace_file: str | None = Field(default=None, description=(
        "Write one JSON line per round to this file (round traces: the proposed tree, the cost model's choice, "
        "the verdict, measured times; `specsplit bench --record-trace`). Unset: off."))
    trace_max_mb: int = Field(default=256, ge=1, le=65536, description=(
        "The round trace file stops growing at this many MiB."))
    grow: bool = Field(default=True, description=(
        "Greedy sessions: the draft worker keeps expanding the tree while the target verifies it, and the next "
        "round re-roots it at the bonus token."))
    grow_fraction: float = Field(default=0.9, gt=0.0, le=4.0, description=(
        "How long a tree grows, as a fraction of the previous verify's time."))
    grow_width: int = Field(default=4, ge=1, le=32, description="Nodes a growing draft adds per forward.")
    grow_chains: bool = Field(default=True, description=(
        "Growth is told the nodes prompt lookup (and the n-gram cache) hung under the round's root, with the "
        "cost model's estimate that each is accepted: the draft adds those its tree lacks and grows them with "
        "its own, so a round after an accepted chain can start from the grown tree (docs/results.md)."))
    grow_reroot: bool = Field(default=True, description=(
        "The draft answers growth with the grown tree and the orchestrator re-roots it at the bonus token itself: "
        "a re-rooted round's tree goes to the target at once, the draft's request beside it, so the round waits "
        "for no draft round trip (needs SPECSPLIT_DRAFT_STEPS_AFTER_REUSE=0, the default; docs/results.md)."))
    overlap_prefill: bool = Field(default=True, description=(
        "A session's first round verifies the prompt's last token alone while the draft forwards the prompt and "
        "drafts beside it, instead of waiting for the draft first: the first token comes after the target's "
        "prefill alone, and the second round re-roots the draft's tree (docs/results.md)."))
    overlap_prefill_max_tokens: int = Field(default=0, ge=0, description=(
        "SPECSPLIT_OVERLAP_PREFILL only for prompts with at most this many tokens for the target to forward "
        "(0: any). Where the draft and the target share cores and both forward a long prompt on all of them, "
        "the two prefills slow each other down (the repository's .env)."))
    rpc_timeout_s: float = Field(default=60.0, gt=0, description=(
        "Seconds one orchestrator -> worker request may take before it is retried."))
    rpc_timeout_per_token_s: float = Field(default=0.05, ge=0, description=(
        "Seconds more a worker request may take per token it brings the session's cache (a prompt's prefill): "
        "the 1.5B int8 target prefilled 21,000 tokens in 340 s on 2 cores (62 a second, fewer the longer the "
        "prompt), which a fixed SPECSPLIT_RPC_TIMEOUT_S timed out and resent again and again; 0.05 serves any "
        "worker prefilling at least 20 tokens a second (docs/results.md)."))
    max_attempts: int = Field(default=8, ge=1, description=(
        "Tries of one worker request (timeouts, retryable errors) before its session fails with NO_WORKER; "
        "resends after a lost cache or router do not count."))
    backoff_s: float = Field(default=0.05, gt=0, description=(
        "First wait before a worker request is retried; it doubles with each retry."))
    backoff_max_s: float = Field(default=2.0, gt=0, description="Longest wait between retries of a worker request.")
    orchestrator_max_sessions: int = Field(default=1024, ge=1, description=(
        "Sessions one orchestrator admits (running + queued); beyond it a request gets OVERLOADED (retryable)."))
    orchestrator_active_sessions: int = Field(default=256, ge=1, description=(
        "Sessions drafting and verifying at once (the rest wait in a fair queue): at most what the workers' "
        "caches hold (SPECSPLIT_WORKER_MAX_SESSIONS each), divided among the orchestrators."))
    orchestrator_client_share: float = Field(default=0.75, gt=0, le=1, description=(
        "Share of SPECSPLIT_ORCHESTRATOR_MAX_SESSIONS one client (a producer) may hold, so that one client's "
        "flood cannot fill the queue ahead of another."))
    orchestrator_bind: str | None = Field(default=None, description=(
        "This instance's address for producers. Unset: SPECSPLIT_ORCHESTRATOR for instance 1 (or outside "
        "honcho), its port + N - 1 for honcho's `orchestrator.N`."))
    specpv: bool | None = Field(default=None, description=(
        "SpecPV partial verification for sessions whose request carries no SpecPV spec of its own: true turns "
        "it on, and so does setting any SPECSPLIT_SPECPV_* parameter; false keeps it off."))
    # Unset SPECSPLIT_SPECPV_* take SpecPVSpec's defaults and bounds (schemas.messages).
    specpv_block_size: int | None = Field(default=None, description="SpecPV: tokens of one KV block.")
    specpv_sink_blocks: int | None = Field(default=None, description=(
        "SpecPV: first blocks of the context, always in the partial view."))
    specpv_retrieval_blocks: int | None = Field(default=None, description=(
        "SpecPV: blocks whose key summaries score highest against the tree's queries (per layer and KV head), "
        "added to the view."))
    specpv_window_blocks: int | None = Field(default=None, description=(
        "SpecPV: last blocks of the context, always in the view."))
    specpv_buffer_tokens: int | None = Field(default=None, description=(
        "SpecPV: tokens accepted since the last full verification that the view holds; a full verification "
        "runs before it would overflow."))
    specpv_threshold: int | None = Field(default=None, description=(
        "SpecPV: context tokens past which the target verifies against the partial view."))
    specpv_refresh_every: int | None = Field(default=None, description="SpecPV: rounds between full verifications.")
    specpv_exact: bool | None = Field(default=None, description=(
        "SpecPV: tokens accepted under the partial view stay provisional until a full verification re-checks "
        "them (greedy only; the output then equals full verification's). false: SpecPV's approximate semantics."))

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

    def proposer_names(self) -> tuple[str, ...] | None:
        """SPECSPLIT_PROPOSERS as names, or None: derived from the speculator and lookup settings."""
        names = tuple(n.strip() for n in self.proposers.split(",") if n.strip())
        return names or None


class SupervisorSettings(CommonSettings):
    """The supervising parent of a role's command (specsplit.supervise): it runs the role as its
    child and restarts it when it dies."""

    supervise: bool = Field(default=True, description=(
        "Run the role under a supervising parent that restarts it; false: the command does the work itself."))
    supervise_backoff_s: float = Field(default=0.5, gt=0, description=(
        "First wait before a dead role is restarted; it doubles with each quick death."))
    supervise_backoff_max_s: float = Field(default=10.0, gt=0, description="Longest wait between restarts.")
    supervise_stable_s: float = Field(default=30.0, gt=0, description=(
        "Uptime after which the role counts as stable and the back-off starts over."))
    supervise_stop_timeout_s: float = Field(default=90.0, gt=0, description=(
        "Seconds from passing SIGTERM on to the child to killing it."))
    supervise_max_quick_restarts: int = Field(default=20, ge=1, description=(
        "A crash loop (this many deaths in a row, each before SPECSPLIT_SUPERVISE_STABLE_S of uptime: a missing "
        "model, a bad setting) ends the supervisor with the child's exit code, so the operator sees it."))


class ProducerSettings(FleetAddresses):
    """A producer of the orchestrators: `specsplit produce`, and the HTTP API, which is one."""

    produce_timeout_s: float = Field(default=600.0, gt=0, description="Seconds one whole generation may take.")
    produce_chunk_timeout_s: float = Field(default=300.0, gt=0, description=(
        "Seconds allowed between two streamed chunks of an answer."))
    produce_timeout_per_prompt_token_s: float = Field(default=0.05, ge=0, description=(
        "Seconds more a generation, and the wait for its first chunk, may take per prompt token (its prefill: "
        "minutes for a long prompt on a CPU; SPECSPLIT_RPC_TIMEOUT_PER_TOKEN_S)."))
    orchestrator_count: int = Field(default=1, ge=1, le=64, description=(
        "Orchestrators serving side by side (`honcho start -c orchestrator=N`): SPECSPLIT_ORCHESTRATOR and the "
        "next N - 1 ports. Producers spread requests over the live ones and resume on another when one dies."))
    produce_heartbeat_s: float = Field(default=1.0, gt=0, le=60, description=(
        "Seconds between a producer's pings to each orchestrator."))
    produce_liveness: int = Field(default=3, ge=1, le=100, description=(
        "Pings missed in a row before a producer declares an orchestrator dead."))
    produce_max_resumes: int = Field(default=16, ge=0, description=(
        "Resumes of one prompt on another orchestrator, after losing one, at most."))

    def orchestrator_addresses(self) -> list[str]:
        return [orchestrator_address(self.orchestrator, i) for i in range(self.orchestrator_count)]

    @staticmethod
    def sampling(temperature: float, top_p: float, top_k: int, seed: int) -> SamplingSpec:
        return SamplingSpec(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
