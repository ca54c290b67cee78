"""Prometheus metrics of the orchestrator and the workers (the routers': ``brokers.metrics``,
which also holds the port scheme and the HTTP server every role uses).

Each process builds its metrics on its own ``CollectorRegistry`` (so tests can run many in one
interpreter) and serves it from its main path (``serve_metrics``); importing this module does
nothing. Labels are bounded: ``service`` (draft | target), a request kind (a schema message
class), an error code, a finish reason, an accepted ``position`` (< MAX_TREE_DEPTH). Never a
session.

Counting (the one rule, ``orchestrator.state.RoundCount``; the orchestrator counts, once per
verified round, so a resent request is not counted twice):

- ``specsplit:spec_decode_num_drafts_total``: rounds that proposed at least one token to the
  target (vLLM's "drafts"; a root-only round, e.g. a generation's last token, is not one);
- ``specsplit:spec_decode_num_draft_tokens_total``: tree nodes proposed to the target, the root
  excluded (draft and prompt-lookup nodes);
- ``specsplit:spec_decode_num_accepted_tokens_total``: accepted tokens, the bonus excluded;
- ``specsplit:spec_decode_num_accepted_tokens_per_pos_total{position="i"}``: accepted tokens at
  depth i + 1 of the tree (sums to the accepted total);
- ``specsplit:rounds_total``: every verified round (each commits accepted + 1 tokens, so
  accepted + rounds = tokens committed);
- ``specsplit:lookup_cache_draft_tokens_total`` / ``_accepted_tokens_total``: of those proposed
  and accepted tokens, the ones the cross-session n-gram cache proposed.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from brokers.metrics import count_restarts, serve_metrics
from schemas import MAX_TREE_DEPTH, DraftReply, ErrorReply, GenerateDone, Message, VerifyReply
from specsplit.orchestrator.state import RoundCount

__all__ = ["OrchestratorMetrics", "WorkerMetrics", "count_restarts", "serve_metrics"]

# seconds: from a tiny model's sub-millisecond RPC to a big model's prefill on a CPU
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class OrchestratorMetrics:
    """The orchestrator's counters (see the module docstring), histograms of round time,
    orchestrator -> worker round trips and time to first token, and the admission gauges."""

    def __init__(self, registry: CollectorRegistry | None = None, *, positions: int = 0) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.num_drafts = Counter("specsplit:spec_decode_num_drafts",
                                  "Verified rounds that proposed at least one token", registry=r)
        self.num_draft_tokens = Counter("specsplit:spec_decode_num_draft_tokens",
                                        "Tokens proposed to the target (tree nodes, root excluded)", registry=r)
        self.num_accepted_tokens = Counter("specsplit:spec_decode_num_accepted_tokens",
                                           "Accepted tokens (bonus excluded)", registry=r)
        self.accepted_per_pos = Counter("specsplit:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens by position (0: depth 1 of the tree)", ["position"],
                                        registry=r)
        self._pos = [self.accepted_per_pos.labels(position=str(i)) for i in range(min(positions, MAX_TREE_DEPTH))]
        self.rolled_back = Counter("specsplit:spec_decode_rolled_back_tokens",
                                   "Provisional tokens a full verification dropped (exact SpecPV)", registry=r)
        self.rounds = Counter("specsplit:rounds", "Verified rounds (each commits accepted + 1 tokens)", registry=r)
        self.rerooted = Counter("specsplit:rounds_rerooted", "Rounds whose tree was the one grown during the verify "
                                "before, by where it was re-rooted: the orchestrator (no draft call on the round's path, "
                                "SPECSPLIT_GROW_REROOT) or the draft worker", ["where"], registry=r)
        self.generated = Counter("specsplit:generation_tokens", "Tokens streamed to producers", registry=r)
        self.round_seconds = Histogram("specsplit:round_seconds", "Wall time of one draft -> verify round",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.rpc_seconds = Histogram("specsplit:rpc_seconds", "Orchestrator -> worker round trip of one answered "
                                     "request (an error reply included)", ["service"], buckets=_LATENCY_BUCKETS,
                                     registry=r)
        self.rpc_failures = Counter("specsplit:rpc_failures", "Requests not answered (timeout, router_lost) "
                                    "or answered with an error (its code), by reason",
                                    ["service", "reason"], registry=r)
        self.ttft = Histogram("specsplit:time_to_first_token_seconds", "From a request's arrival (queueing "
                              "included) to its first streamed token", buckets=_TTFT_BUCKETS, registry=r)
        self.queue_wait = Histogram("specsplit:queue_wait_seconds", "Time a session waited for admission",
                                    buckets=_TTFT_BUCKETS, registry=r)
        self.finished = Counter("specsplit:sessions_finished", "Sessions ended, by finish reason",
                                ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(finish_reason=reason)
        self.running = Gauge("specsplit:num_sessions_running", "Sessions drafting/verifying", registry=r)
        self.waiting = Gauge("specsplit:num_sessions_waiting", "Sessions in the admission queue", registry=r)
        self.cache_draft_tokens = Counter("specsplit:lookup_cache_draft_tokens", "Tokens the cross-session n-gram "
                                          "cache proposed to the target (verified tree nodes)", registry=r)
        self.cache_accepted_tokens = Counter("specsplit:lookup_cache_accepted_tokens",
                                             "Accepted tokens the cross-session n-gram cache proposed", registry=r)
        self.cache_ngrams = Gauge("specsplit:lookup_cache_ngrams", "N-grams the cross-session cache holds", registry=r)

    def watch(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        """Gauges read at scrape time (the orchestrator's maps; single-threaded reads of a len)."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)

    def observe_cache(self, proposed: int, accepted: int) -> None:
        """A round's n-gram cache candidates: verified, and accepted of those."""
        self.cache_draft_tokens.inc(proposed)
        self.cache_accepted_tokens.inc(accepted)

    def observe_reroot(self, here: bool) -> None:
        self.rerooted.labels(where="orchestrator" if here else "draft").inc()

    def observe_round(self, count: RoundCount, rolled_back: int, wall_s: float) -> None:
        self.rounds.inc()
        self.round_seconds.observe(wall_s)
        if rolled_back:
            self.rolled_back.inc(rolled_back)
        if count.drafted == 0:
            return  # a root-only round proposed nothing: not a draft (and accepted nothing)
        self.num_drafts.inc()
        self.num_draft_tokens.inc(count.drafted)
        self.num_accepted_tokens.inc(count.accepted)
        for pos in count.positions:
            self._position(pos).inc()

    def _position(self, pos: int):
        pos = min(pos, MAX_TREE_DEPTH - 1)  # a tree is at most MAX_TREE_DEPTH deep: never clipped
        while len(self._pos) <= pos:
            self._pos.append(self.accepted_per_pos.labels(position=str(len(self._pos))))
        return self._pos[pos]

    def observe_rpc(self, service: str, seconds: float) -> None:
        self.rpc_seconds.labels(service=service).observe(seconds)

    def rpc_failed(self, service: str, reason: str) -> None:
        """``reason``: timeout, router_lost, or an ErrorCode value (bounded)."""
        self.rpc_failures.labels(service=service, reason=reason).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def session_done(self, done: GenerateDone) -> None:
        reason = done.finish_reason if done.finish_reason in FINISH_REASONS else "error"
        self.finished.labels(finish_reason=reason).inc()


class WorkerMetrics:
    """A draft or target worker: requests by kind, errors by code, handling time, rounds served,
    tokens per forward, requests per engine call (batch size), and gauges of its queue, sessions
    and KV bytes."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self._requests = Counter("specsplit:worker_requests", "Requests handled, by kind", ["service", "kind"],
                                 registry=r)
        self._errors = Counter("specsplit:worker_errors", "Requests answered with an ErrorReply, by code",
                               ["service", "code"], registry=r)
        self._seconds = Histogram("specsplit:worker_request_seconds", "Time in the engine per request, by kind",
                                  ["service", "kind"], buckets=_LATENCY_BUCKETS, registry=r)
        self.rounds = Counter("specsplit:worker_rounds", "Rounds served (DraftReply or VerifyReply sent)",
                              ["service"], registry=r).labels(service=service)
        self.forward_tokens = Histogram("specsplit:worker_forward_tokens", "New tokens per model forward",
                                        ["service"], buckets=_TOKEN_BUCKETS, registry=r).labels(service=service)
        self.batch_size = Histogram("specsplit:worker_batch_size", "Requests per engine call", ["service"],
                                    buckets=_BATCH_BUCKETS, registry=r).labels(service=service)
        self.queue_depth = Gauge("specsplit:worker_queue_depth", "Requests queued for the engine thread",
                                 ["service"], registry=r).labels(service=service)
        self.sessions = Gauge("specsplit:worker_sessions", "Sessions whose KV cache the worker holds", ["service"],
                              registry=r).labels(service=service)
        self.kv_bytes = Gauge("specsplit:worker_kv_bytes", "Bytes of KV cache held (SpecPV views included)",
                              ["service"], registry=r).labels(service=service)

    def watch(self, store, queue_depth: Callable[[], int]) -> None:
        """Gauges read at scrape time: ``store`` (a SessionStore: len, bytes_held; thread-safe)
        and the worker loop's queue depth."""
        self.sessions.set_function(lambda: len(store))
        self.kv_bytes.set_function(store.bytes_held)
        self.queue_depth.set_function(queue_depth)

    def watch_prefix(self, cache) -> None:
        """A prefix cache's lookups (``specsplit.engine.prefix``): tokens looked up and tokens
        reused (vLLM's prefix_cache_queries / _hits), and the bytes it holds."""
        labels = {"service": self.service}
        queries = Counter("specsplit:worker_prefix_cache_queries", "Tokens of new sessions' contexts looked up in "
                          "the prefix cache", ["service"], registry=self.registry).labels(**labels)
        hits = Counter("specsplit:worker_prefix_cache_hits", "Tokens copied from the prefix cache instead of "
                       "forwarded", ["service"], registry=self.registry).labels(**labels)
        Gauge("specsplit:worker_prefix_cache_bytes", "Bytes of K/V the prefix cache holds", ["service"],
              registry=self.registry).labels(**labels).set_function(lambda: cache.bytes)

        def on_lookup(queried: int, reused: int) -> None:
            queries.inc(queried)
            hits.inc(reused)

        cache.on_lookup = on_lookup

    def watch_forwards(self, backend) -> None:
        """Count the new tokens of each forward: wraps ``backend.before_forward`` (the one call
        every engine forward makes, ``engine.base.Engine.forward``) on this instance."""
        inner = backend.before_forward
        observe = self.forward_tokens.observe

        def before_forward(new_tokens: int) -> None:
            observe(new_tokens)
            inner(new_tokens)

        backend.before_forward = before_forward

    def observe(self, msg: Message, reply: Message, seconds: float, batch: int = 1) -> None:
        """One engine call of ``batch`` requests (1: the worker loop hands the engine one)."""
        kind = type(msg).__name__
        self._requests.labels(service=self.service, kind=kind).inc()
        self._seconds.labels(service=self.service, kind=kind).observe(seconds)
        self.batch_size.observe(batch)
        if isinstance(reply, ErrorReply):
            self._errors.labels(service=self.service, code=reply.code.value).inc()
        elif isinstance(reply, (DraftReply, VerifyReply)):
            self.rounds.inc()
