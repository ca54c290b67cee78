"""What draft and target engines share: the model, the session store, request checks, and the
one forward over [sync tokens + new tokens] with an explicit 4D mask on a session's cache.

Engines contain no transport; a worker puts ``handle`` behind a socket. Every method takes a
request object and returns a reply object or raises SpecError; on any error the session's
cache is unchanged (validation happens before anything moves), except an unexpected forward
failure, which drops the session so the next request gets CACHE_MISS and resends its context.
A failure of the device itself (CUDA error, out of memory) raises ``DeviceFailure``, never a
reply: the worker ends, and the router fails its sessions over.

Engines run on any device: the model's device is the engine's, and every index, mask, position
and generator is created there. Device-specific tuning (CPU threads per forward size, weight
packing, int8) is not here: it is a ``Backend`` policy the worker builds (``specsplit.backends``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from schemas import Ack, CacheSync, EndSession, ErrorCode, Message
from specsplit.engine.batch import PLAN_KWARG, Segment, flatten, segment_attention_name, using_attention
from specsplit.engine.graphs import GraphRunner
from specsplit.engine.infill import InfillVocab
from specsplit.engine.kvcache import SessionKV
from specsplit.engine.kvpool import AUTO, GB, KVPool, auto_slots, pool_shape, pool_slots
from specsplit.engine.masks import (
    SlidingWindows,
    TreeInputs,
    causal,
    forward_dependent_rope,
    forward_mask,
    sliding_windows,
)
from specsplit.engine.prefix import PrefixCache, keep_prefix, take_prefix
from specsplit.engine.store import Session, SessionStore, StoreFull
from specsplit.errors import DeviceFailure, ModelRefused, SpecError
from specsplit.logs import get_logger
from specsplit.tree import check_token_ids


@dataclass(frozen=True)
class EngineLimits:
    max_sessions: int = 64
    session_ttl_s: float = 600.0
    max_session_tokens: int = 8192  # per-session KV capacity (prompt + generation + tree)
    cache_chunk: int = 64  # KV capacity granularity (tokens); see specsplit.engine.kvcache
    max_tree_nodes: int = 64
    max_tree_depth: int = 16
    # > 0: every session's KV in a pool preallocated at start (specsplit.engine.kvpool); "auto": one
    # sized to the device's free memory on CUDA, none elsewhere
    kv_pool_gb: float | str = 0.0
    graphs: str = "off"  # with a pool: "cuda" replays CUDA graphs, "static" their bodies eagerly (engine.graphs)
    graph_body: str = "fused"  # what the graphs run: "fused" (engine.fused) or "transformers" (the model's modules)
    gemm_tune: bool = True  # the triton_gemm body's tiles timed on the GPU (engine.matmul)
    prefix_cache_gb: float = 0.0  # > 0: K/V of contexts forwarded before, kept for new sessions (engine.prefix)


def model_vocab_size(model) -> int:
    """Rows of the output projection (may exceed the tokenizer's size). Its ``out_features`` where
    it says it (every Linear here: a dynamically quantized one's ``weight()`` unpacks the whole
    int8 matrix, ~0.8 s for a 150K-token vocabulary)."""
    head = model.get_output_embeddings()
    rows = getattr(head, "out_features", None)
    if isinstance(rows, int):
        return rows
    weight = getattr(head, "weight", None)
    weight = weight() if callable(weight) else weight  # dynamically quantized Linear
    if weight is not None:
        return int(weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


def model_num_layers(model) -> int:
    cfg = model.config.get_text_config(decoder=True)
    return int(cfg.num_hidden_layers)


# a request may move a session's round at most this far ahead unless it resends the whole context
# (the orchestrator advances one round at a time; a draft worker skips the rounds SpecPV confirms)
MAX_ROUND_STEP = 64
PREFILL_TOKENS = 64  # a forward of more new tokens than this is compute-bound (a prompt prefill)
CHECK_TOLERANCE = 1e-3  # Engine.check_runs: a float32 tree's logits against its paths', relative
LINEAR_CHUNK = 1024  # a longer linear segment (a long prompt) is forwarded in chunks of this many tokens


class Backend:
    """How an engine's forwards run on its device. This default does nothing device-specific;
    workers pass a policy from ``specsplit.backends`` (CPU: threads per forward size; CUDA:
    device synchronization for timings)."""

    name = "default"

    def before_forward(self, new_tokens: int) -> None:
        """Called before each forward of ``new_tokens`` tokens."""

    def after_forward(self, new_tokens: int, ms: float) -> None:
        """Called after each forward of ``new_tokens`` tokens with its wall time (its logits
        are on the host or were waited for: a CPU forward is synchronous)."""

    def synchronize(self) -> None:
        """Wait for the device's queued work (for honest timings)."""

    @property
    def inline_safe(self) -> bool:
        """Whether a tree-sized forward starts no OpenMP team, so it may run on a thread other
        than the worker's compute thread (its socket thread's fast path; ``specsplit.compute``)."""
        return True


def is_device_failure(exc: BaseException) -> bool:
    """A failure of the device rather than of the request: CUDA/accelerator errors, out of memory."""
    oom = getattr(torch, "OutOfMemoryError", None)
    accel = getattr(torch, "AcceleratorError", None)
    if (oom is not None and isinstance(exc, oom)) or (accel is not None and isinstance(exc, accel)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "CUDA error", "CUBLAS_STATUS", "cuDNN error", "out of memory", "device-side assert",
        "can't allocate memory", "MPS backend"))


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def model_dtype(model) -> torch.dtype:
    """The compute dtype of the model's activations (its embeddings'; quantized Linear layers
    keep no float weight)."""
    return model.get_input_embeddings().weight.dtype


class Engine:
    """Base of DraftEngine and TargetEngine."""

    role = "engine"
    linear_chunk = LINEAR_CHUNK  # tokens per forward of a long linear segment (``forward_linear``)
    # set by __init__ where a KV pool is; engines that build their own state (llama.cpp's) have neither
    kv_pool: KVPool | None = None
    graphs: GraphRunner | None = None
    prefix_cache: PrefixCache | None = None
    # llama.cpp's infill sampler's tables (``specsplit.engine.infill``), built at their first use:
    # set by the worker, which has the tokenizer; None: requests for that sampler are refused
    infill_vocab: Callable[[], InfillVocab] | None = None

    def __init__(self, model, limits: EngineLimits = EngineLimits(), *, vocab_size: int | None = None,
                 backend: Backend | None = None):
        self.model = model.eval()
        self.limits = limits
        self.vocab_size = vocab_size or model_vocab_size(model)
        self.device = model_device(model)
        self.dtype = model_dtype(model)
        self.backend = backend or Backend()
        self._segment_attention: str | None | bool = False  # False: not looked up yet
        self.log = get_logger(f"specsplit.{self.role}")
        layers = model_num_layers(model)
        self.kv_pool: KVPool | None = None
        self.graphs: GraphRunner | None = None
        # sliding windows go into the masks (``forward``), keys placed at their cache slots: a
        # target's slots are its positions; a draft's kept tree sits past its prefix, each node at
        # a slot no earlier than its position, which hides nothing more once the window is wider
        # than the kept tree (every real model's is), and a draft only proposes anyway
        self.windows: SlidingWindows | None = sliding_windows(getattr(model, "config", None),
                                                              limits.max_session_tokens)
        # a rotary type recomputed per forward: sessions are never forwarded together
        self.dynamic_rope = forward_dependent_rope(getattr(model, "config", None))
        make_kv, on_evict = lambda: SessionKV(layers, limits.max_session_tokens, limits.cache_chunk), None
        if limits.kv_pool_gb == AUTO or limits.kv_pool_gb > 0:
            self.kv_pool = self._allocate_pool(limits)
        if self.kv_pool is not None:
            make_kv, on_evict = self.kv_pool.make_kv, self.kv_pool.release
            self.log.info("kv_pool_allocated", slots=self.kv_pool.slots, gb=round(self.kv_pool.nbytes / GB, 3),
                          tokens_per_slot=limits.max_session_tokens, auto=limits.kv_pool_gb == AUTO)
            if self.kv_pool.scratch is not None:
                self.graphs = GraphRunner(self.model, self.kv_pool, self.vocab_size, limits.graphs, log=self.log,
                                          body=limits.graph_body, gemm_tune=limits.gemm_tune, windows=self.windows,
                                          one_session=self.dynamic_rope is not None)
        if limits.prefix_cache_gb > 0:
            self.prefix_cache = PrefixCache(round(limits.prefix_cache_gb * GB), block=limits.cache_chunk)
        release = on_evict

        def session_left(session: Session) -> None:
            self.keep_prefix(session)
            if release is not None:
                release(session)

        self.store = SessionStore(
            make_kv,
            max_sessions=limits.max_sessions,
            ttl_s=limits.session_ttl_s,
            on_evict=session_left if self.prefix_cache is not None else on_evict,
        )

    AUTO_POOL_TRIES = 3  # an automatic pool re-measures free memory after an allocation fails
    CHECK_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8)  # the start-up check's prompt, then its tree's tokens

    @torch.no_grad()
    def check_runs(self) -> None:
        """At a worker's start, before any request (``specsplit.workers.build_engine``): a prompt,
        then a tree (a root and two children) in one forward against its paths forwarded on the
        prompt's cache, through this engine's own masks, cache and attention. Raises
        ModelRefused naming the model type when a forward fails, or (a float32 target) the two
        disagree beyond rounding: a model these engines cannot run (ALiBi biases, a
        latent-attention cache) is refused when its worker starts, not at each request."""
        if self.device.type == "meta":  # shapes only (tests)
            return
        cfg = getattr(self.model, "config", None)
        kind = getattr(cfg, "model_type", type(self.model).__name__)
        attn_config = getattr(cfg, "attn_config", None)  # MPT's
        if kind == "bloom" or getattr(cfg, "alibi", False) or getattr(attn_config, "alibi", False):
            raise ModelRefused(f"the {self.role} engine cannot run this {kind} model: its ALiBi position biases "
                               "follow cache slots, which a tree's nodes do not hold in position order")
        layers = model_num_layers(self.model)
        ids = [t % self.vocab_size for t in self.CHECK_TOKENS]
        prompt, (a, b, c) = ids[:5], ids[5:]
        dev = self.device
        try:
            kv = SessionKV(layers, 16)
            self.forward(kv, prompt, torch.arange(5, device=dev), causal(5, 0, dev), keep=1)
            vis = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=dev)
            tree = self.forward(kv, [a, b, c], torch.tensor([5, 6, 6], device=dev),
                                torch.cat([torch.ones(3, 5, dtype=torch.bool, device=dev), vis], dim=1), keep=3)
            kv.crop_to(5)  # the paths on the prompt's cache: [a, b] in a row, then c after a
            ab = self.forward(kv, [a, b], torch.tensor([5, 6], device=dev), causal(2, 5, dev), keep=2)
            kv.crop_to(6)
            ac = self.forward(kv, [c], torch.tensor([6], device=dev), causal(1, 6, dev), keep=1)
            paths = [ab[0], ab[1], ac[0]]
        except Exception as exc:
            if is_device_failure(exc):  # out of memory, a lost device: not the model's doing, a restart may serve
                raise
            raise ModelRefused(f"the {self.role} engine cannot run this {kind} model: its start-up forward failed "
                               f"({type(exc).__name__}: {exc})") from exc
        seq = torch.stack(paths)  # [3, V]
        scale = float(seq.abs().max().clamp_min(1.0))
        diff = float((tree - seq).abs().max())
        self.check_diff = diff / scale
        # a target's float32 rounding keeps tree and paths within ~1e-5 of the logits' size (tiny
        # models of 30 families, docs/results.md); half precision's rounding is not told from a
        # model's so easily, and a draft (int8 with one activation scale a forward) only proposes:
        # there only a forward that fails is refused
        exact = self.role == "target" and self.dtype in (torch.float32, torch.float64)
        if exact and not diff <= CHECK_TOLERANCE * scale:
            raise ModelRefused(f"the {self.role} engine cannot run this {kind} model: a tree's logits differ from its "
                               f"paths' by {diff:.3g} (logits up to {scale:.3g}); its attention needs what the "
                               "engines' masks do not carry")

    def _allocate_pool(self, limits: EngineLimits) -> KVPool | None:
        """The KV pool of ``limits.kv_pool_gb``; "auto": on CUDA one of ``max_sessions`` slots or
        what the device's free memory holds beside a reserve (``kvpool.auto_slots``), else None
        (caches grow per session; logged where a CUDA device had no room for one slot)."""
        shape = pool_shape(self.model, limits.max_session_tokens, self.dtype)
        scratch = limits.graphs != "off"  # the graphs' padding sessions take one slot of the budget
        want = limits.max_sessions + scratch
        if limits.kv_pool_gb != AUTO:
            slots = pool_slots(limits.kv_pool_gb, shape, want) - scratch
            if slots < 1:
                raise ValueError(f"a KV pool of {limits.kv_pool_gb} GB holds no session beside the graphs' "
                                 f"scratch slot: each slot needs {shape.slot_bytes / GB:.4f} GB")
            return KVPool(shape, slots, self.device, scratch=scratch)
        if self.device.type != "cuda":
            return None
        for _ in range(self.AUTO_POOL_TRIES):
            free, total = torch.cuda.mem_get_info(self.device)
            slots = auto_slots(shape, want, free, total) - scratch
            if slots < 1:
                self.log.warning("kv_pool_auto_none", free_gb=round(free / GB, 2),
                                 slot_gb=round(shape.slot_bytes / GB, 4),
                                 action="caches grow per session; eager forwards")
                return None
            try:
                return KVPool(shape, slots, self.device, scratch=scratch)
            except torch.OutOfMemoryError:  # another process on the device took memory meanwhile: measure again
                torch.cuda.empty_cache()
        self.log.warning("kv_pool_auto_failed", tries=self.AUTO_POOL_TRIES,
                         action="caches grow per session; eager forwards")
        return None

    # ---- request plumbing -------------------------------------------------------------
    def handle(self, msg: Message) -> Message:
        """Dispatch one request; typed errors become ErrorReply."""
        try:
            return self._dispatch(msg)
        except SpecError as exc:
            return exc.to_reply(getattr(msg, "session_id", None), getattr(msg, "round", None))

    def _dispatch(self, msg: Message) -> Message:
        if isinstance(msg, EndSession):
            return Ack(session_id=msg.session_id, existed=self.store.end_session(msg.session_id))
        raise SpecError(ErrorCode.BAD_REQUEST, f"{self.role} worker does not serve {type(msg).__name__}")

    def open_session(self, session_id: str, round: int, sync: CacheSync, extra_tokens: int) -> Session:
        """Checks that need no lock-free state: token range, capacity; then finds the session."""
        check_token_ids(sync.append_token_ids, self.vocab_size, what="sync token")
        need = sync.base_len + len(sync.append_token_ids) + extra_tokens
        if need > self.limits.max_session_tokens:
            raise SpecError(
                ErrorCode.BAD_REQUEST,
                f"session would hold {need} tokens, limit is {self.limits.max_session_tokens}",
            )
        session = self.store.get(session_id)
        if session is None:
            if sync.base_len != 0:
                raise SpecError(ErrorCode.CACHE_MISS, "unknown session; resend with base_len 0")
            try:
                session = self.store.get_or_create(session_id)
            except StoreFull as exc:
                raise SpecError(ErrorCode.OVERLOADED, f"{exc}; retry later") from None
        return session

    @staticmethod
    def committed_len(session: Session) -> int:
        """Committed tokens the session's cache holds (it may hold draft-tree entries after them)."""
        return session.kv.length

    # ---- prefix cache ------------------------------------------------------------------
    def take_prefix(self, session: Session, sync: CacheSync, root: int, reuse: bool = True) -> CacheSync:
        """Under the session's lock, before a request's forwards: the session's tokens
        (``Session.tokens``) follow its sync; and a sync from an empty cache copies the longest
        prefix of its tokens that the prefix cache holds, and ``reusable`` allows, into the
        session's cache (unless ``reuse`` is False: every token is forwarded). Returns the sync to
        apply: ``sync`` itself, or one that keeps the copied prefix (its ``base_len``) and appends
        the rest."""
        out = take_prefix(self.prefix_cache if reuse else None, session, sync, root, self.reusable)
        if session.reused:
            self.log.debug("prefix_reused", session_id=session.session_id, tokens=session.reused,
                           of=len(sync.append_token_ids))
        return out

    def reusable(self, sync: CacheSync, prompt_path: int, n: int) -> int:
        """How much of an ``n``-token cached prefix a new session with ``sync`` may reuse (its
        first ``prompt_path`` positions were prefilled on a prompt attention): here all of it."""
        return n

    def keep_prefix(self, session: Session, held: bool = False) -> None:
        """The prefix cache keeps the K/V of the session's named tokens: when it left the store
        (unless it was dropped after a failure or a request holds it: its cache may be moving),
        and right after its context was forwarded (``held``: by the request holding it), so that
        sessions starting meanwhile with the same context (``n`` choices, a shared system
        prompt) find it too."""
        if self.prefix_cache is None:
            return
        try:
            keep_prefix(self.prefix_cache, session, self.committed_len, held)
        except Exception as exc:  # a copy that fails costs only the reuse
            if is_device_failure(exc):
                raise
            self.log.warning("prefix_keep_failed", error=f"{type(exc).__name__}: {exc}"[:300])

    def check_locked(self, session: Session, round: int, sync: CacheSync) -> None:
        """Checks made under the session lock, before anything changes."""
        if getattr(session.kv, "released", False):  # its pool slot went to another session after it left the store
            raise SpecError(ErrorCode.CACHE_MISS, "unknown session; resend with base_len 0")
        if round < session.last_round:
            # the texts name nothing about the session (its round, its length): only its owner
            # knows those, and a request from anyone else must learn nothing from a refusal
            raise SpecError(ErrorCode.STALE_ROUND, f"round {round} is older than the session's current round")
        if session.last_round >= 0 and round - session.last_round > MAX_ROUND_STEP and sync.base_len > 0:
            # a round far ahead of the session's: this cache is from long ago (the session was
            # served elsewhere meanwhile), or the request is not the session's. Only a request
            # that carries the whole context (base_len 0) may move a session's round that far.
            raise SpecError(ErrorCode.CACHE_MISS, "the session's cache is out of date; resend with base_len 0")
        held = self.committed_len(session)
        if held < sync.base_len:
            raise SpecError(ErrorCode.CACHE_MISS, f"the session's cache does not hold the {sync.base_len} tokens this "
                                                  "request assumes; resend with base_len 0")

    # ---- compute ---------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self, kv: SessionKV, token_ids: list[int], position_ids: torch.Tensor | None, visible: torch.Tensor | None,
        keep: int, *, tree: TreeInputs | None = None, **model_kwargs,
    ) -> torch.Tensor:
        """One forward of T new tokens on top of the cache. position_ids [T] and visible
        [T, P+T] bool on the engine's device, or None for both and ``tree`` (the host's
        description: a graph replay copies it, an eager forward builds the tensors); returns
        float32 logits of the last ``keep`` tokens [keep, V] (on the device). ``model_kwargs``
        reach the attention functions."""
        t = len(token_ids)
        self.backend.before_forward(t)
        t0 = time.perf_counter()
        if self.graphs is not None:
            out = self.graphs.forward([Segment(kv, token_ids, position_ids, visible, keep, tree)], **model_kwargs)
            if out is not None:
                self.backend.after_forward(t, (time.perf_counter() - t0) * 1e3)
                return out[0]
        if visible is None:
            visible, position_ids = tree.on_device(self.device)
        assert visible.shape == (t, kv.length + t), (visible.shape, t, kv.length)
        out = self.model(
            input_ids=torch.tensor([token_ids], dtype=torch.long, device=self.device),
            position_ids=position_ids[None],
            attention_mask=forward_mask(visible, position_ids, kv.length, self.dtype, self.windows),
            past_key_values=kv,
            use_cache=True,
            logits_to_keep=keep,
            **model_kwargs,
        )
        logits = out.logits[0, -keep:].float()  # [keep, V]
        self.backend.after_forward(t, (time.perf_counter() - t0) * 1e3)
        return logits

    def batched_forward_supported(self) -> bool:
        """Whether ``forward_segments`` can run on this model (its attention takes custom masks,
        and its rotary frequencies do not follow the forward's largest position)."""
        if self.dynamic_rope is not None:
            return False
        if self._segment_attention is False:
            self._segment_attention = segment_attention_name(self.model)
        return self._segment_attention is not None

    @torch.no_grad()
    def forward_segments(self, segments: list[Segment]) -> list[torch.Tensor]:
        """ONE forward over the new tokens of several sessions (``specsplit.engine.batch``): each
        segment's tokens on top of its own cache, under its own positions and mask. Returns per
        segment float32 logits of its last ``keep`` tokens [keep_i, V] (on the device). Every
        cache gains its segment's tokens, as after ``forward`` of that segment alone."""
        t = sum(len(s.token_ids) for s in segments)
        self.backend.before_forward(t)
        t0 = time.perf_counter()
        if self.graphs is not None:
            out = self.graphs.forward(segments)
            if out is not None:
                self.backend.after_forward(t, (time.perf_counter() - t0) * 1e3)
                return out
        if not self.batched_forward_supported():
            raise RuntimeError(f"attention {self.model.config._attn_implementation!r} takes no per-session masks")
        batch = flatten([s.on_device(self.device) for s in segments], self.dtype, self.device, self.windows)
        placeholder = torch.zeros(1, 1, t, 0, dtype=self.dtype, device=self.device)  # passed through, unread
        with using_attention(self.model, self._segment_attention):
            out = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                attention_mask=placeholder,
                use_cache=False,
                logits_to_keep=batch.keep_rows,
                **{PLAN_KWARG: batch.plan},
            )
        logits = out.logits[0].float()  # [K, V]
        self.backend.after_forward(t, (time.perf_counter() - t0) * 1e3)
        return list(logits.split([s.keep for s in segments]))

    def forward_one(self, seg: Segment) -> torch.Tensor:
        """``forward`` of one segment alone: its logits [keep, V]."""
        return self.forward(seg.kv, seg.token_ids, seg.position_ids, seg.visible, seg.keep, tree=seg.tree)

    def forward_linear(self, kv: SessionKV, token_ids: list[int], chunk: int | None = None,
                       attention: str | None = None, on_rows: Callable[[torch.Tensor], None] | None = None,
                       ) -> torch.Tensor:
        """Causal forward of a linear segment on top of the cache, ``chunk`` tokens per forward
        (default ``linear_chunk``: a long prompt's masks stay [chunk, P+chunk]); the last
        token's logits [V]. ``attention``: the registered attention function to run them with
        (None: the model's). ``on_rows``: given every token's logits, each forward's [chunk, V]
        in order (the same forwards: only more rows leave the model)."""
        chunk = chunk or self.linear_chunk
        logits = None
        with using_attention(self.model, attention) if attention else nullcontext():
            for a in range(0, len(token_ids), chunk):
                part = token_ids[a:a + chunk]
                p = kv.length
                pos = torch.arange(p, p + len(part), dtype=torch.long, device=self.device)
                logits = self.forward(kv, part, pos, causal(len(part), p, self.device),
                                      keep=len(part) if on_rows is not None else 1)
                if on_rows is not None:
                    on_rows(logits)
        return logits[-1]

    def guarded(self, session: Session, fn):
        """Run fn() (which mutates the session's cache); drop the session if it fails
        unexpectedly. A device failure is raised as DeviceFailure (the worker must end)."""
        try:
            return fn()
        except SpecError:
            raise
        except Exception as exc:
            self.store.drop(session)
            if is_device_failure(exc):
                raise DeviceFailure(f"{self.role} on {self.device}: {type(exc).__name__}: {exc}") from exc
            raise SpecError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}") from exc

    def elapsed_ms(self, t0: float) -> float:
        """Milliseconds since ``t0``, after the device finished its queued work, less any CUDA
        graph captures since (a one-time cost: the replies' times are what forwards cost)."""
        self.backend.synchronize()
        return self.steady_ms(t0)

    def steady_ms(self, t0: float) -> float:
        """Milliseconds since ``t0`` less the graph captures that started since."""
        ms = elapsed_ms(t0)
        return ms if self.graphs is None else max(0.0, ms - self.graphs.capture_ms_since(t0))


def elapsed_ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3

