"""Prometheus metrics of the HTTP API, named as vLLM's OpenAI server names them (``vllm:`` ->
``specsplit:``), on the process's own registry, served at ``GET /metrics``.

A request here is one choice: one orchestrator session (a request with ``n: 2`` counts two, as
vLLM v1 fans ``n`` out into child requests). ``num_requests_waiting``: accepted, no token yet
(the orchestrator's admission queue and the prompt's prefill); ``num_requests_running``:
streaming tokens. Inter-token latency: a round commits several tokens at once, so the time since
the previous round's tokens is divided among the round's tokens (each observed once): its sum
over a request is the time from its first token to its last, its count the tokens after the
first, which is time per output token as a client reads it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
FINISHED_REASONS = ("stop", "length", "abort")
ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
          "/v1/messages/count_tokens", "/completion", "/infill",
          "/tokenize", "/detokenize", "/health", "/metrics")


class ApiMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.running = Gauge("specsplit:num_requests_running", "Requests streaming tokens", registry=r)
        self.waiting = Gauge("specsplit:num_requests_waiting", "Requests accepted with no token yet", registry=r)
        self.success = Counter("specsplit:request_success", "Finished requests by finish reason",
                               ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("specsplit:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("specsplit:generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("specsplit:time_to_first_token_seconds", "From request arrival to its first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specsplit:inter_token_latency_seconds", "Time per output token after the first",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("specsplit:e2e_request_latency_seconds", "From request arrival to its end",
                             buckets=_E2E_BUCKETS, registry=r)
        self.http = Counter("specsplit:http_responses", "HTTP responses by route and status",
                            ["route", "status"], registry=r)
        self.prompt_routes = Counter(
            "specsplit:prompt_routes", "Requests routed without a prompt_cache_key: continuing a remembered prompt "
            "(its workers) or not (spread)", ["route"], registry=r)
        for reason in FINISHED_REASONS:
            self.success.labels(finished_reason=reason)
        for route in ("continued", "new"):
            self.prompt_routes.labels(route=route)

    def routed(self, continued: bool) -> None:
        self.prompt_routes.labels(route="continued" if continued else "new").inc()

    def response(self, path: str, status: int) -> None:
        self.http.labels(route=path if path in ROUTES else "other", status=str(status)).inc()
