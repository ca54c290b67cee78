"""An engine behind a worker loop: ``specsplit draft`` and ``specsplit target``.

Loads the role's model strictly offline, builds the engine, announces a WorkerHello (model id,
vocab size, tokenizer fingerprint) to the service's router and serves until SIGTERM, which
finishes the request in hand and exits 0.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

from schemas import WorkerHello
from specsplit.config import WorkerSettings
from specsplit.logs import get_logger


def default_threads(service: str) -> int:
    """Torch threads of a role's tree-sized forwards. Draft: a quarter of the cores (one on a
    2-core box): it grows its tree while the target verifies, and a batch-1 int8 draft forward
    gains nothing from a second thread here (1 thread ~52 ms, 2 threads ~60 ms). Target: the
    rest, so the two never oversubscribe the cores (a 2-thread target slowed ~45% whenever the
    draft grew beside it; with packed bf16 weights one thread verifies 16 tokens about as fast).
    Prefills use every core (``default_prefill_threads``). OMP_WAIT_POLICY=PASSIVE keeps idle
    OpenMP threads from spinning. Measured on 2 cores (qwen-coder, 3 HumanEval prompts x 128):
    packed target 1 thread + draft 1 thread 8.6 tok/s, target 2 + draft 1 8.3."""
    cores = default_prefill_threads()
    draft = max(1, cores // 4)
    return draft if service == "draft" else max(1, cores - draft)


def default_prefill_threads() -> int:
    """Forwards of many new tokens (a prompt) are compute-bound: every core."""
    return max(1, os.cpu_count() or 1)


def model_dtype(service: str, model_settings) -> str:
    """The role's dtype: explicit settings win; the tiny preset runs in fp32 (exactness tests)."""
    explicit = os.environ.get(f"SPECSPLIT_{service.upper()}_DTYPE")
    if explicit:
        return explicit
    if model_settings.preset in ("tiny", "smollm2") and not getattr(model_settings, f"{service}_model"):
        return "float32"
    return getattr(model_settings, f"{service}_dtype")


def build_engine(service: str, settings: WorkerSettings, model_settings):
    """(engine, hello) for ``service`` from settings; loads the model."""
    import torch

    from specsplit.models import load_model, resolve_model_paths, tokenizer_fingerprint
    from specsplit.engine.draft import DraftEngine
    from specsplit.engine.base import EngineLimits, model_vocab_size
    from specsplit.engine.target import TargetEngine

    threads = settings.threads_for(service) or default_threads(service)
    prefill_threads = settings.prefill_threads or default_prefill_threads()
    torch.set_num_threads(threads)
    paths = resolve_model_paths(model_settings)
    path = getattr(paths, service)
    model, tokenizer = load_model(path, dtype=model_dtype(service, model_settings), threads=threads)
    if service == "draft" and settings.draft_quantize == "int8":
        import warnings

        with warnings.catch_warnings():  # torch.ao dynamic quantization is deprecated but still the fastest here
            warnings.simplefilter("ignore")
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    if settings.pack_weights:
        from specsplit.models.packing import pack_linear_weights

        packed = pack_linear_weights(model)
        get_logger("specsplit.worker", service=service).info("weights_packed", linear_layers=packed)
    limits = EngineLimits(
        max_sessions=settings.worker_max_sessions, session_ttl_s=settings.session_ttl_s,
        max_session_tokens=settings.max_session_tokens, max_tree_nodes=settings.max_tree_nodes,
        max_tree_depth=settings.max_tree_depth,
    )
    if service == "draft":
        engine = DraftEngine(model, limits, steps_after_reuse=settings.draft_steps_after_reuse)
    else:
        engine = TargetEngine(model, limits)
    engine.threads, engine.prefill_threads = threads, prefill_threads
    hello = WorkerHello(
        service=service, model_id=str(path), vocab_size=model_vocab_size(model),
        tokenizer_hash=tokenizer_fingerprint(tokenizer), pid=os.getpid(),
    )
    return engine, hello


def run_worker(service: str, settings: WorkerSettings, model_settings) -> int:
    from functools import partial

    from specsplit.engine.base import PREFILL_TOKENS
    from specsplit.transport.worker_loop import WorkerLoop, small_request

    log = get_logger("specsplit.worker", service=service)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    engine, hello = build_engine(service, settings, model_settings)
    identity = settings.identity(service)
    log.info("worker_loaded", identity=identity, model=hello.model_id, vocab=hello.vocab_size,
             threads=engine.threads, prefill_threads=engine.prefill_threads)
    served: Counter[str] = Counter()

    def handle(msg):
        served[type(msg).__name__] += 1
        return engine.handle(msg)

    loop = WorkerLoop(settings.backend(service), identity.encode(), hello, handle,
                      heartbeat_s=settings.heartbeat_s, liveness=settings.liveness, max_queue=settings.max_queue,
                      # socket-thread fast path: tree-sized forwards only, never prefills or growth
                      may_inline=partial(small_request, max_tokens=PREFILL_TOKENS) if settings.inline else None)
    if hasattr(engine, "others_waiting"):
        engine.others_waiting = loop.requests_waiting  # background growth yields to real requests
    rc = loop.run(stop)
    log.info("worker_exit", rc=rc, served=dict(served), sessions=len(engine.store),
             kv_bytes=engine.store.bytes_held())
    return rc
