"""Device backends: the device-specific policy a worker wraps around its engine, built from
settings, so the engines stay device-neutral.

- ``CpuBackend``: torch threads per forward size (tree-sized forwards on the role's share of the
  cores, prompt prefills on every core) and, at load, dynamic int8 Linear layers and oneDNN weight
  packing (why each default: ``default_threads``).
- ``CudaBackend`` / ``MpsBackend``: never touch thread counts; timings wait for the device
  (``synchronize``). int8-dynamic and oneDNN packing are CPU kernels and are not applied there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from functools import cache
from pathlib import Path

import torch

from specsplit.engine.base import LINEAR_CHUNK, PREFILL_TOKENS, Backend
from specsplit.models.int8 import quantize_int8, row_buckets, warm_gemms


def default_prefill_threads() -> int:
    """Forwards of many new tokens (a prompt) are compute-bound: every core."""
    return max(1, os.cpu_count() or 1)


def default_threads(service: str, speculator: str = "draft") -> int:
    """Torch threads of a role's tree-sized forwards on CPU. Draft: a quarter of the cores (one
    on a 2-core box): it grows its tree while the target verifies, and a batch-1 int8 draft
    forward gains nothing from a second thread. Target: the rest, so the two never oversubscribe
    the cores (a 2-thread target slowed whenever the draft grew beside it; with packed bf16
    weights one thread verifies 16 tokens about as fast). OMP_WAIT_POLICY=PASSIVE keeps idle
    OpenMP threads from spinning. Figures: docs/results.md, commits 7bc8064 and 939cbbb. With
    the ``lookup`` speculator no draft worker runs, so the target takes every core."""
    cores = default_prefill_threads()
    if service == "target" and speculator == "lookup":
        return cores
    draft = max(1, cores // 4)
    return draft if service == "draft" else max(1, cores - draft)


class ThreadChooser:
    """Per forward size, the torch thread count whose forwards measurably run faster: the role's
    share of the cores or every core.

    A worker's share (``default_threads``) keeps a verifying target and a growing draft off each
    other's cores. When the other role is idle (plain decoding under load, a lookup-only fleet,
    a draft on another host) that share leaves cores unused; when it is busy, more threads than
    free cores make every parallel region wait for a descheduled thread. Neither process knows
    what the other is doing, so each measures: forwards are bucketed by new tokens (powers of
    two, up to ``PREFILL_TOKENS``: larger forwards are prompts and take every core), each option
    keeps an exponential average of its ms per forward per bucket, the faster one runs, and the
    other is tried every ``explore_every`` forwards of the bucket so that a change of regime (the
    other role starts or stops) is noticed. Bounded: a handful of buckets times two options."""

    def __init__(self, options: tuple[int, ...], *, min_observations: int = 2, explore_every: int = 8,
                 decay: float = 0.6):
        self.options = tuple(dict.fromkeys(options))  # distinct, in order
        self.min_observations, self.explore_every, self.decay = min_observations, explore_every, decay
        self._ms: dict[tuple[int, int], float] = {}  # (bucket, threads) -> average ms
        self._seen: dict[tuple[int, int], int] = {}
        self._forwards: dict[int, int] = {}  # bucket -> forwards chosen

    @staticmethod
    def bucket(new_tokens: int) -> int:
        return max(1, new_tokens).bit_length()  # 1: 1 token, 2: 2-3, 3: 4-7, ... 7: 64

    def choose(self, new_tokens: int) -> int:
        b = self.bucket(new_tokens)
        n = self._forwards[b] = self._forwards.get(b, 0) + 1
        for threads in self.options:  # every option measured first
            if self._seen.get((b, threads), 0) < self.min_observations:
                return threads
        ranked = sorted(self.options, key=lambda th: self._ms[(b, th)])
        return ranked[1] if n % self.explore_every == 0 and len(ranked) > 1 else ranked[0]

    def observe(self, new_tokens: int, threads: int, ms: float) -> None:
        key = (self.bucket(new_tokens), threads)
        if threads not in self.options or ms <= 0:
            return
        old = self._ms.get(key)
        self._ms[key] = ms if old is None else self.decay * old + (1.0 - self.decay) * ms
        self._seen[key] = self._seen.get(key, 0) + 1

    def table(self) -> dict[str, float]:
        """'bucket/threads' -> average ms (for logs and tests)."""
        return {f"{b}/{th}": round(ms, 2) for (b, th), ms in sorted(self._ms.items())}


@cache
def malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class CpuBackend(Backend):
    """Threads follow the forward: ``threads`` for tree-sized forwards, ``prefill_threads`` for
    forwards of more than ``PREFILL_TOKENS`` new tokens."""

    name = "cpu"

    def __init__(self, threads: int, prefill_threads: int, *, quantize: str = "none", pack_weights: bool = True,
                 batch_invariant: bool = True, adaptive_threads: bool = False, trim_every_s: float = 0.0,
                 int8_cache: bool = False):
        self.threads, self.prefill_threads = threads, prefill_threads
        self.int8_cache = int8_cache  # a target's int8 codes kept beside its model (specsplit.models.int8_cache)
        self.int8_report: dict = {}
        # tree-sized forwards on the role's share or on every core, whichever measures faster
        self.chooser = (ThreadChooser((threads, prefill_threads))
                        if adaptive_threads and prefill_threads != threads else None)
        self._running = threads
        self.quantize, self.pack_weights = quantize, pack_weights
        self.batch_invariant = batch_invariant  # int8: a token's logits independent of the forward's shape
        self.packed_layers = 0
        self.gqa_attention = False
        self.attention: str | None = None  # the registered attention function the prepared model runs
        self.warmed_gemms, self.warm_s = 0, 0.0
        self.trim_every_s = trim_every_s if malloc_trim() is not None else 0.0
        self._trimmed_at = time.monotonic()
        self.trims, self.trim_s, self.trim_max_s = 0, 0.0, 0.0

    def load_dtype(self, requested: str) -> str:
        """The dtype to load in: as requested (``prepare`` makes an int8 model float32 layer by
        layer, so a 1.5B model never holds a whole float32 copy beside its bf16 one)."""
        return requested

    def before_forward(self, new_tokens: int) -> None:
        if new_tokens > PREFILL_TOKENS:
            want = self.prefill_threads
        else:
            want = self.chooser.choose(new_tokens) if self.chooser is not None else self.threads
        self._running = want
        if want != torch.get_num_threads():
            torch.set_num_threads(want)

    @property
    def inline_safe(self) -> bool:  # tree-sized forwards on one thread: no OpenMP team
        return self.threads == 1 and self.chooser is None

    def after_forward(self, new_tokens: int, ms: float) -> None:
        if self.chooser is not None and new_tokens <= PREFILL_TOKENS:
            self.chooser.observe(new_tokens, self._running, ms)
        if self.trim_every_s and time.monotonic() - self._trimmed_at >= self.trim_every_s:
            self.trim()

    def trim(self) -> None:
        """Give the C heap's free pages back to the system (glibc ``malloc_trim``), at most every
        ``trim_every_s`` seconds, after a forward. A serving worker allocates and frees session KV
        buffers and batch activations of every size among each other; glibc serves blocks up to
        its (self-raising) mmap threshold from its heaps, and a free block below a live one is
        never returned, so without this the target's RSS kept growing through a long soak while
        its held KV stayed flat (ops/results/soak-qwen-coder-1000x256-cpu2-avx512-xeon.json).
        malloc_trim releases every whole free page inside the heaps (MADV_DONTNEED), and pages
        come back on first touch, so between trims the heap is reused as before; a fixed low mmap
        threshold, the other cure, mapped and faulted every activation anew and slowed prefills
        (docs/results.md, Memory under a long run)."""
        t0 = time.perf_counter()
        malloc_trim()(0)
        took = time.perf_counter() - t0
        self.trims, self.trim_s, self.trim_max_s = self.trims + 1, self.trim_s + took, max(self.trim_max_s, took)
        self._trimmed_at = time.monotonic()

    def prepare(self, model):
        """The model as this backend runs it: int8 Linear layers (``specsplit.models.int8``; with a
        batch-invariant attention where ``batch_invariant``: ``specsplit.models.blocked``, or float64
        where this machine fails its check) and/or packed weights; a draft (not
        ``batch_invariant``) on sdpa gets ``specsplit.models.attention.gqa_attention``."""
        torch.set_num_threads(self.threads)
        if self.quantize == "int8":
            t0 = time.perf_counter()
            source = Path(getattr(model, "name_or_path", "") or "")
            cache_dir = source if self.int8_cache and self.batch_invariant and source.is_dir() else None
            torch.set_num_threads(self.prefill_threads)  # a start (or restart) has every core to itself
            try:
                model = quantize_int8(model, batch_invariant=self.batch_invariant, cache_dir=cache_dir,
                                      report=self.int8_report)
            finally:
                torch.set_num_threads(self.threads)
            self.int8_report["quantize_s"] = round(time.perf_counter() - t0, 2)
            self.warm(model)
        if self.pack_weights:
            from specsplit.models.packing import pack_linear_weights

            self.packed_layers = pack_linear_weights(model)
        if not self.batch_invariant:  # a draft: grouped-query attention without repeat_kv's copies
            from specsplit.models.attention import use_gqa_attention

            self.gqa_attention = use_gqa_attention(model)
        self.attention = model.config._attn_implementation
        return model

    def warm(self, model) -> None:
        """Create oneDNN's int8 GEMM primitives now, at every row bucket and thread count the
        forwards will run them at (``specsplit.models.int8.warm_gemms``), so a serving worker's
        memory stays flat instead of growing as rarer batch sizes first appear, and no request
        waits for a kernel's JIT. Tree-sized forwards (up to PREFILL_TOKENS tokens) on the role's
        threads (and every core, where the threads adapt), larger ones (prompt chunks, batches)
        on the prefill threads; the lm_head runs only at the rows whose logits a forward keeps:
        tree-sized, or a prompt's last. Not warmed: the lm_head at 80-256 kept rows (batched
        verification past 64 tokens): they would take most of the warm-up's time, for a dozen
        primitives created when first met. Warm-up time and RSS: docs/results.md, c790546."""
        head = model.get_output_embeddings()
        body = [m for m in model.modules() if m is not head]
        small, large = row_buckets(1, PREFILL_TOKENS), row_buckets(PREFILL_TOKENS + 1, LINEAR_CHUNK)
        small_threads = {self.threads, self.prefill_threads} if self.chooser is not None else {self.threads}
        plan = [(n, body, small) for n in sorted(small_threads)] + [(n, [head], small) for n in sorted(small_threads)]
        plan += [(self.prefill_threads, body, large), (self.prefill_threads, [head], [1])]
        t0 = time.perf_counter()
        try:
            for threads, layers, rows in plan:
                torch.set_num_threads(threads)
                self.warmed_gemms += warm_gemms(layers, rows)
        finally:
            torch.set_num_threads(self.threads)
        self.warm_s = time.perf_counter() - t0

    def int8_kernel(self) -> str | None:
        """The int8 GEMM a target's Linear layers run on (a draft's: torch.ao's fbgemm)."""
        if self.quantize != "int8":
            return None
        from specsplit.models.int8 import default_kernel

        return default_kernel() if self.batch_invariant else "fbgemm"

    def describe(self) -> dict:
        return {"backend": self.name, "threads": self.threads, "prefill_threads": self.prefill_threads,
                "quantize": self.quantize, "batch_invariant": self.batch_invariant,
                "int8_kernel": self.int8_kernel(), **self.int8_report,
                "pack_weights": self.pack_weights, "packed_layers": self.packed_layers,
                "gqa_attention": self.gqa_attention, "attention": self.attention, "adaptive_threads": self.chooser is not None,
                "warmed_gemms": self.warmed_gemms, "warm_s": round(self.warm_s, 2),
                "trim_every_s": self.trim_every_s, "trims": self.trims, "trim_s": round(self.trim_s, 3),
                "trim_max_ms": round(self.trim_max_s * 1e3, 1),
                "omp": {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}}


class AcceleratorBackend(Backend):
    """An accelerator's queue: timings wait for it (``synchronize``); weights load as requested."""

    name = "accelerator"

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def load_dtype(self, requested: str) -> str:
        return requested

    def prepare(self, model):
        return model

    def describe(self) -> dict:
        return {"backend": self.name, "device": str(self.device)}


class CudaBackend(AcceleratorBackend):
    """CUDA. Unless ``cudnn_attention``, the process's scaled-dot-product attention never picks
    cuDNN's kernel (a process-wide switch: a worker process serves one role on one device): with
    the additive masks of tree forwards it builds an execution plan for every new key length,
    and a session's cache has a new length every round, so the memory-efficient kernel (no
    per-shape cost) serves instead. Figures: ops/results/sdpa-fresh-length-h200.json and
    ops/results/gpu-longctx-h200-qwen2.5-coder-random-bf16-no-cudnn.json."""

    name = "cuda"

    def __init__(self, device: torch.device, cudnn_attention: bool = False, grouped_attention: bool = True):
        super().__init__(device)
        self.cudnn_attention = cudnn_attention
        if not cudnn_attention:
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.grouped_attention = grouped_attention
        self.attention: str | None = None  # the registered attention function the prepared model runs

    def prepare(self, model):
        """Unless told otherwise, a model on sdpa runs ``specsplit.models.attention.gqa_attention``:
        decode steps and trees over long caches as grouped matmuls (sdpa's masked kernel runs a
        few blocks of threads for a few queries; figures: docs/results.md, GPU), everything else
        through transformers' sdpa."""
        if self.grouped_attention:
            from specsplit.models.attention import use_gqa_attention

            use_gqa_attention(model, grouped_only=False)
        self.attention = model.config._attn_implementation
        return model

    def synchronize(self) -> None:
        # this thread's stream only: an engine on its own thread and stream (``bench replay
        # --overlap``) must not wait for another's work on the same device
        torch.cuda.current_stream(self.device).synchronize()

    def describe(self) -> dict:
        return super().describe() | {"cudnn_attention": self.cudnn_attention, "attention": self.attention}


class MpsBackend(AcceleratorBackend):
    name = "mps"

    def synchronize(self) -> None:
        torch.mps.synchronize()


class LlamaCppBackend(Backend):
    """Threads of a llama.cpp engine's forwards on CPU: the same split as the torch CPU backend
    (tree-sized forwards on the role's share of the cores, prompts on every core)."""

    name = "llamacpp"

    def __init__(self, threads: int, prefill_threads: int):
        self.threads, self.prefill_threads = threads, prefill_threads

    @classmethod
    def for_role(cls, service: str, settings) -> "LlamaCppBackend":
        return cls(settings.threads_for(service) or default_threads(service, settings.speculator),
                   settings.prefill_threads_for(service) or default_prefill_threads())

    @property
    def inline_safe(self) -> bool:  # tree-sized decodes on one thread: no OpenMP team
        return self.threads == 1

    def threads_for(self, new_tokens: int) -> int:
        """Called by the engine's context before each decode of ``new_tokens`` tokens."""
        self.before_forward(new_tokens)  # (metrics count tokens per forward here)
        return self.prefill_threads if new_tokens > PREFILL_TOKENS else self.threads

    def describe(self) -> dict:
        return {"backend": self.name, "threads": self.threads, "prefill_threads": self.prefill_threads}


def build_backend(service: str, device: str, settings) -> Backend:
    """The policy for ``service`` on ``device`` from WorkerSettings-like ``settings``."""
    kind = torch.device(device).type
    if kind == "cuda":
        return CudaBackend(torch.device(device), cudnn_attention=settings.cuda_cudnn_attention,
                           grouped_attention=settings.cuda_grouped_attention)
    if kind == "mps":
        return MpsBackend(torch.device(device))
    return CpuBackend(
        threads=settings.threads_for(service) or default_threads(service, settings.speculator),
        prefill_threads=settings.prefill_threads_for(service) or default_prefill_threads(),
        quantize=settings.quantize_for(service),
        pack_weights=settings.pack_weights,
        # the target's tokens must equal its own greedy decoding whatever the tree's shape; a
        # draft only proposes, so it skips the batch-invariant attention
        batch_invariant=service == "target",
        adaptive_threads=settings.adaptive_threads,
        trim_every_s=settings.trim_every_s,
        int8_cache=settings.int8_cache,
    )
