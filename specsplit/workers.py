"""An engine behind a worker loop: ``specsplit draft`` and ``specsplit target``.

Loads the role's model strictly offline, builds the engine, announces a WorkerHello (model id,
vocab size, tokenizer fingerprint) to the service's router and serves until SIGTERM, which
finishes the request in hand and exits 0.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections import Counter

from schemas import WorkerHello
from specsplit.config import WorkerSettings
from specsplit.errors import DeviceFailure
from specsplit.logs import get_logger


def model_dtype(service: str, model_settings) -> str:
    """The role's dtype: explicit settings win; the tiny preset runs in fp32 (exactness tests)."""
    explicit = os.environ.get(f"SPECSPLIT_{service.upper()}_DTYPE")
    if explicit:
        return explicit
    if model_settings.preset in ("tiny", "smollm2") and not getattr(model_settings, f"{service}_model"):
        return "float32"
    return getattr(model_settings, f"{service}_dtype")


def build_engine(service: str, settings: WorkerSettings, model_settings):
    """(engine, hello) for ``service`` from settings; loads the model onto the role's device and
    applies the device's backend policy (CPU: int8 / packed weights / threads)."""
    from specsplit.backends import build_backend
    from specsplit.engine.base import EngineLimits, model_vocab_size
    from specsplit.engine.draft import DraftEngine
    from specsplit.engine.target import TargetEngine
    from specsplit.models import load_model, resolve_model_paths, tokenizer_fingerprint

    device = getattr(model_settings, f"{service}_device")
    backend = build_backend(service, device, settings)
    paths = resolve_model_paths(model_settings)
    path = getattr(paths, service)
    model, tokenizer = load_model(path, dtype=backend.load_dtype(model_dtype(service, model_settings)), device=device)
    model = backend.prepare(model)
    limits = EngineLimits(
        max_sessions=settings.worker_max_sessions, session_ttl_s=settings.session_ttl_s,
        max_session_tokens=settings.max_session_tokens, max_tree_nodes=settings.max_tree_nodes,
        max_tree_depth=settings.max_tree_depth,
    )
    if service == "draft":
        engine = DraftEngine(model, limits, steps_after_reuse=settings.draft_steps_after_reuse, backend=backend)
    else:
        engine = TargetEngine(model, limits, backend=backend)
    hello = WorkerHello(
        service=service, model_id=str(path), vocab_size=model_vocab_size(model),
        tokenizer_hash=tokenizer_fingerprint(tokenizer), pid=os.getpid(),
    )
    return engine, hello


DEVICE_FAILURE_EXIT = 3  # a worker whose device failed exits with this code


def run_worker(service: str, settings: WorkerSettings, model_settings) -> int:
    from functools import partial

    from specsplit.engine.base import PREFILL_TOKENS
    from specsplit.transport.worker_loop import WorkerLoop, small_request

    log = get_logger("specsplit.worker", service=service)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    secret = settings.secret()  # before the model loads: a fleet secret that cannot be read is fatal at once
    engine, hello = build_engine(service, settings, model_settings)
    identity = settings.identity(service)
    log.info("worker_loaded", identity=identity, model=hello.model_id, vocab=hello.vocab_size,
             device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."), **engine.backend.describe())
    served: Counter[str] = Counter()

    def handle(msg):
        served[type(msg).__name__] += 1
        try:
            return engine.handle(msg)
        except DeviceFailure as exc:  # never a reply: end, so the router fails the sessions over
            log.critical("device_failed", error=str(exc), exit_code=DEVICE_FAILURE_EXIT)
            sys.stderr.flush()
            os._exit(DEVICE_FAILURE_EXIT)

    loop = WorkerLoop(settings.backend(service), identity.encode(), hello, handle,
                      heartbeat_s=settings.heartbeat_s, liveness=settings.liveness, max_queue=settings.max_queue,
                      # socket-thread fast path: tree-sized forwards only, never prefills or growth
                      may_inline=partial(small_request, max_tokens=PREFILL_TOKENS) if settings.inline else None,
                      secret=secret)
    if hasattr(engine, "others_waiting"):
        engine.others_waiting = loop.requests_waiting  # background growth yields to real requests
    rc = loop.run(stop)
    log.info("worker_exit", rc=rc, served=dict(served), sessions=len(engine.store),
             kv_bytes=engine.store.bytes_held())
    return rc
