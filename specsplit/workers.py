"""An engine behind a worker loop: ``specsplit draft``, ``specsplit target``, and both in one
process, ``specsplit pair`` (``run_pair``).

Loads the role's model strictly offline, builds the engine, announces a WorkerHello (model id,
vocab size, tokenizer fingerprint) to the service's router and serves until SIGTERM, which
finishes the request in hand and exits 0.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from functools import cache, partial

from brokers.curve import CurveError
from brokers.settings import MetricsSettings
from brokers.signals import set_event, set_on_stop_signals, sleep_unless
from schemas import WorkerHello
from specsplit.compute import ComputeThread
from specsplit.config import WorkerSettings
from specsplit.errors import DeviceFailure, ModelRefused
from specsplit.logs import get_logger
from specsplit.metrics import WorkerMetrics, count_restarts, serve_metrics
from specsplit.models import load_model, resolve_model_paths, tokenizer_fingerprint
from specsplit.models.loading import fingerprint_memo_dir, resolve_gguf
from specsplit.models.settings import model_dtype as model_dtype  # re-exported: its home was here
from specsplit.transport.batching import draft_tokens, verify_tokens
from specsplit.transport.worker_loop import WorkerLoop, small_request


def build_engine(service: str, settings: WorkerSettings, model_settings):
    """(engine, hello) for ``service`` from settings; loads the model onto the role's device and
    applies the device's backend policy (CPU: int8 / packed weights / threads)."""
    # torch loads with the model, never at import: an importer may still set OpenMP's environment
    from specsplit.backends import build_backend
    from specsplit.engine.base import model_vocab_size
    from specsplit.engine.draft import DraftEngine
    from specsplit.engine.target import TargetEngine

    if settings.engine_for(service) == "llamacpp":
        return build_llamacpp_engine(service, settings, model_settings)
    device = getattr(model_settings, f"{service}_device")
    backend = build_backend(service, device, settings)
    paths = resolve_model_paths(model_settings)
    path = getattr(paths, service)
    model, tokenizer = load_model(path, dtype=backend.load_dtype(model_dtype(service, model_settings)), device=device)
    model = backend.prepare(model)
    engine = role_engine(service, settings, model, backend, DraftEngine, TargetEngine)
    take_grammars(engine, tokenizer, path, settings.draft_grammar)
    engine.check_runs()  # a model the engines cannot run is refused here, naming why
    if engine.graphs is not None:  # one session's first forwards, captured before any request
        engine.graphs.warm(compact=service == "target")
    hello = WorkerHello(
        service=service, model_id=str(path), vocab_size=model_vocab_size(model),
        tokenizer_hash=tokenizer_fingerprint(tokenizer, fingerprint_memo_dir(model_settings)), pid=os.getpid(),
    )
    return engine, hello


def log_loaded(log, engine, **fields) -> None:
    """The ``worker_loaded`` line: ``fields``, the engine's device and dtype, and its backend's
    description (whose keys win: a GPU backend names its device too)."""
    log.info("worker_loaded", **{**fields, "device": str(engine.device),
                                 "dtype": str(engine.dtype).removeprefix("torch."), **engine.backend.describe()})


def engine_limits(settings: WorkerSettings, service: str | None = None, backend=None):
    """The engine limits of ``service``'s worker (its KV pool: None, or a llama.cpp engine, none;
    CUDA graphs over the pool where ``backend`` is CUDA's and SPECSPLIT_CUDA_GRAPHS allows)."""
    from specsplit.engine.base import EngineLimits  # torch: never at this module's import (see build_engine)

    torch_engine = bool(service) and settings.engine_for(service) == "torch"
    pool = settings.kv_pool_gb_for(service) if torch_engine else 0.0
    cuda = getattr(backend, "name", None) == "cuda"  # with a pool ("auto": sized on CUDA), graphs replay
    return EngineLimits(
        max_sessions=settings.worker_max_sessions, session_ttl_s=settings.session_ttl_s,
        max_session_tokens=settings.max_session_tokens, max_tree_nodes=settings.max_tree_nodes,
        max_tree_depth=settings.max_tree_depth,
        kv_pool_gb=pool, graphs="cuda" if (pool == "auto" or pool > 0) and cuda and settings.cuda_graphs else "off",
        graph_body=settings.cuda_graph_body, gemm_tune=settings.cuda_gemm_tune,
        prefix_cache_gb=settings.prefix_cache_gb_for(service) if torch_engine else 0.0,
    )


def draft_window(settings: WorkerSettings):
    from specsplit.engine.draftview import DraftWindow  # torch: never at this module's import (see build_engine)

    return DraftWindow(sink_tokens=settings.draft_sink_tokens, window_tokens=settings.draft_window_tokens)


def role_engine(service: str, settings: WorkerSettings, model, backend, draft_cls, target_cls):
    """The role's engine class around ``model`` (a torch model or a LlamaCppModel)."""
    limits = engine_limits(settings, service, backend)
    if service == "draft":
        return draft_cls(model, limits, steps_after_reuse=settings.draft_steps_after_reuse, backend=backend,
                         window=draft_window(settings), grow_spares=settings.draft_grow_spares)
    return target_cls(model, limits, backend=backend)


def build_llamacpp_engine(service: str, settings: WorkerSettings, model_settings):
    """(engine, hello) on llama.cpp's kernels: the role's GGUF file; the tokenizer (for the
    hello's fingerprint, the same one producers encode with) from the provisioned model dir."""
    # torch, transformers and llama.cpp load with the model, never at import (see build_engine)
    from transformers import AutoTokenizer

    from specsplit.backends import LlamaCppBackend
    from specsplit.engine.llamacpp import LlamaCppModel, LlamaDraftEngine, LlamaTargetEngine

    backend = LlamaCppBackend.for_role(service, settings)
    gguf = resolve_gguf(service, model_settings)
    tokenizer_dir = getattr(resolve_model_paths(model_settings), service)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    lm = LlamaCppModel(gguf, n_ctx=settings.llamacpp_ctx, threads=backend.threads,
                       prefill_threads=backend.prefill_threads)
    lm.threads_for = backend.threads_for
    engine = role_engine(service, settings, lm, backend, LlamaDraftEngine, LlamaTargetEngine)
    take_grammars(engine, tokenizer, tokenizer_dir, settings.draft_grammar)
    hello = WorkerHello(
        service=service, model_id=str(gguf), vocab_size=lm.vocab_size,
        tokenizer_hash=tokenizer_fingerprint(tokenizer, fingerprint_memo_dir(model_settings)), pid=os.getpid(),
    )
    return engine, hello


def take_grammars(engine, tokenizer, model_dir, draft: bool = False) -> None:
    """A target constrains sessions to grammars (``engine.grammars``) with the served tokenizer; a
    draft masks its proposals to them with its own (``draft``: SPECSPLIT_DRAFT_GRAMMAR).
    llguidance's tokenizer is built at the first grammar, not here; so are the tables of llama.cpp's
    infill sampler (``engine.infill_vocab``), for both roles."""
    from specsplit.engine.grammar import GrammarBook  # torch: never at this module's import

    role = getattr(engine, "role", None)
    if role == "target" or (role == "draft" and draft):
        engine.grammars = GrammarBook.for_model(tokenizer, model_dir, engine.vocab_size)
    if role in ("target", "draft"):  # llama.cpp's infill sampler: its tables at its first request
        from specsplit.engine.infill import InfillVocab

        engine.infill_vocab = cache(
            lambda: InfillVocab.for_tokenizer(tokenizer, model_dir, engine.vocab_size))


DEVICE_FAILURE_EXIT = 3  # a worker whose device failed exits with this code


class _Role:
    """One role of a worker process: its engine on its own compute thread (loading from the
    start; ``wait_loaded``), its WorkerLoop to its router and its metrics (``prepare``), served
    until ``stop`` (``serve``). ``keys``: the process's (CURVE keys, fleet secret)."""

    def __init__(self, service: str, settings: WorkerSettings, model_settings, metrics_settings, build,
                 stop: threading.Event, log, keys: tuple) -> None:
        self.service, self.settings, self.log, self.stop = service, settings, log, stop
        self.curve, self.secret = keys
        self.metrics_settings = metrics_settings
        self.metrics = WorkerMetrics(service)
        self.served: Counter[str] = Counter()
        # the model loads, and every forward runs, on one thread (specsplit.compute: libgomp stops
        # spinning once two threads of a process have started OpenMP teams on a small machine)
        self.compute = ComputeThread(f"specsplit-{service}")
        self.loading = self.compute.submit(lambda: build(service, settings, model_settings))
        self.engine = self.loop = self.stream = None

    def wait_loaded(self) -> bool:
        """Whether the model loaded (False: a stop came first; a failure raises)."""
        # a stop while the model loads ends the process now (daemon thread). Only the flag is read
        # here: the SIGTERM handler sets ``stop`` on this (main) thread, and one that ran while
        # ``stop.wait`` held the event's lock would block on that lock for good (brokers.signals)
        while self.loading.is_alive():
            if sleep_unless(self.stop, 0.1):
                self.log.info("worker_stopped_while_loading")
                return False
        self.engine, self.hello = self.loading.result()
        return True

    def own_stream(self) -> None:
        """This role's forwards on a CUDA stream of their own (a process hosting both roles,
        ``run_pair``): set on its compute thread here and on its socket thread by ``serve``."""
        import torch  # loaded with the model (see build_engine)

        if self.engine.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.engine.device)
            self.compute.call(torch.cuda.set_stream, self.stream)

    def prepare(self) -> None:
        """The WorkerLoop, and the metrics served on the service's port of this instance, after
        ``wait_loaded``."""
        from specsplit.engine.base import PREFILL_TOKENS  # torch: never at this module's import (see build_engine)

        settings, service, engine, log = self.settings, self.service, self.engine, self.log
        self.metrics.watch_forwards(engine.backend)
        if getattr(engine, "prefix_cache", None) is not None:
            self.metrics.watch_prefix(engine.prefix_cache)
        count_restarts(self.metrics.registry, self.metrics_settings)
        identity = settings.identity(service)
        # the socket thread's fast path, where a small forward starts no OpenMP team (specsplit.compute)
        inline = settings.inline if settings.inline is not None else engine.backend.inline_safe
        log_loaded(log, engine, identity=identity, inline=inline, model=self.hello.model_id, vocab=self.hello.vocab_size)
        metrics, served = self.metrics, self.served

        def device_failed(exc: DeviceFailure):  # never a reply: end, so the router fails the sessions over
            log.critical("device_failed", error=str(exc), exit_code=DEVICE_FAILURE_EXIT)
            sys.stderr.flush()
            os._exit(DEVICE_FAILURE_EXIT)

        def handle(msg):
            served[type(msg).__name__] += 1
            t0 = time.perf_counter()
            try:
                reply = engine.handle(msg)
                metrics.observe(msg, reply, time.perf_counter() - t0)
                return reply
            except DeviceFailure as exc:
                device_failed(exc)

        batch = engine.verify_batch if service == "target" else engine.draft_batch

        def handle_batch(msgs):
            served.update(type(m).__name__ for m in msgs)
            t0 = time.perf_counter()
            try:
                replies = batch(msgs)
            except DeviceFailure as exc:
                device_failed(exc)
            for m, r in zip(msgs, replies):
                metrics.observe(m, r, time.perf_counter() - t0, batch=len(msgs))
            return replies

        max_batch_tokens = getattr(settings, f"{service}_max_batch_tokens")
        self.loop = loop = WorkerLoop(
            settings.backend(service), identity.encode(), self.hello, handle,
            heartbeat_s=settings.heartbeat_s, liveness=settings.liveness, max_queue=settings.max_queue,
            # socket-thread fast path: tree-sized forwards only, never prefills or growth
            may_inline=partial(small_request, max_tokens=PREFILL_TOKENS) if inline else None,
            curve=self.curve, secret=self.secret, compute=self.compute,
            # the requests queued when a forward starts share its forwards
            batch_handler=handle_batch if max_batch_tokens else None, max_batch_tokens=max_batch_tokens,
            batch_cost=verify_tokens if service == "target" else draft_tokens,
            batch_hold=settings.batch_hold)
        if hasattr(engine, "others_waiting"):
            engine.others_waiting = loop.requests_waiting  # background growth yields to real requests
        metrics.watch(engine.store, loop.queue_depth)
        serve_metrics(metrics.registry, self.metrics_settings, service, log)

    def serve(self) -> int:
        """Serve until the stop event; the loop's return code (logged with what it served)."""
        if self.stream is not None:
            import torch

            torch.cuda.set_stream(self.stream)  # the socket thread's inline forwards too
        loop, engine = self.loop, self.engine
        rc = loop.run(self.stop)
        self.log.info("worker_exit", rc=rc, served=dict(self.served), sessions=len(engine.store),
                      kv_bytes=engine.store.bytes_held(), batches=loop.batches, batched_requests=loop.batched_requests,
                      holds=loop.gather.holds if loop.gather else 0,
                      held_s=round(loop.gather.held_s, 3) if loop.gather else 0.0,
                      **{k: v for k, v in engine.backend.describe().items() if k.startswith("trim")})
        return rc


def _keys(settings: WorkerSettings, log):
    """(curve, secret) of a worker process, read before any model loads (a bad key or an
    unreadable fleet secret fails in a second); None when the CURVE keys are refused (logged)."""
    try:
        curve = settings.curve_keys(client=True)
    except CurveError as exc:
        log.error("worker_curve_refused", error=str(exc))
        return None
    return curve, settings.secret()


def run_worker(service: str, settings: WorkerSettings, model_settings, metrics_settings=None,
               build=build_engine) -> int:
    """Serve ``service`` until SIGTERM; ``build(service, settings, model_settings)`` gives the
    (engine, hello) (``specsplit bench replay --fleet``'s workers pass one of random weights)."""
    metrics_settings = metrics_settings or MetricsSettings(metrics_port=0)  # None: metrics off
    log = get_logger("specsplit.worker", service=service)
    stop = threading.Event()
    set_on_stop_signals(stop)
    keys = _keys(settings, log)
    if keys is None:
        return 2
    role = _Role(service, settings, model_settings, metrics_settings, build, stop, log, keys)
    try:
        if not role.wait_loaded():
            return 0
    except ModelRefused as exc:
        log.error("model_refused", reason=str(exc))
        return 2  # supervisors do not restart it: another start refuses it again
    role.prepare()
    return role.serve()


PAIR_SERVICES = ("draft", "target")
PAIR_JOIN_S = 70.0  # the other role's drain after a stop (past its loop's own, 60 s)


def run_pair(settings: WorkerSettings, model_settings, metrics_settings=None, build=build_engine,
             stop: threading.Event | None = None) -> int:
    """``specsplit pair``: a draft and a target worker in one process, each with its own compute
    thread, router connection and metrics (on the draft's and the target's ports of this
    instance) and, on CUDA, its own stream. On one GPU, two worker processes' kernels take turns
    (a CUDA context each); one process's streams may run at once, so the draft's growth runs
    beside the target's verify instead of between its kernels (docs/hardware.md). The models load
    one after the other (one set of allocations and graph captures at a time); a role that stops
    stops the other, and the process ends with the larger return code (a device failure ends both
    at once: the supervisor restarts the pair). ``stop`` (default: set by SIGTERM or SIGINT) ends
    both."""
    metrics_settings = metrics_settings or MetricsSettings(metrics_port=0)
    if stop is None:
        stop = threading.Event()
        set_on_stop_signals(stop)
    logs = {s: get_logger("specsplit.worker", service=s, worker="pair") for s in PAIR_SERVICES}
    keys = _keys(settings, logs["draft"])
    if keys is None:
        return 2
    roles = []
    for service in PAIR_SERVICES:
        role = _Role(service, settings, model_settings, metrics_settings, build, stop, logs[service], keys)
        try:
            if not role.wait_loaded():
                return 0
        except ModelRefused as exc:
            logs[service].error("model_refused", reason=str(exc))
            return 2
        role.own_stream()
        roles.append(role)
    for role in roles:
        role.prepare()
    codes: dict[str, int] = {}

    def serve(role: _Role) -> None:
        try:
            codes[role.service] = role.serve()
        finally:
            set_event(stop)  # one role ending (a refusal, a stop) ends the process: the supervisor restarts both

    threads = [threading.Thread(target=serve, args=(r,), name=f"specsplit-{r.service}-socket", daemon=True)
               for r in roles[1:]]
    for t in threads:
        t.start()
    serve(roles[0])
    for t in threads:
        t.join(PAIR_JOIN_S)  # its loop saw the stop too: it drains its request in hand and returns
    return max(codes.values(), default=1) if len(codes) == len(roles) else 1
