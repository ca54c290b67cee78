"""Prometheus metrics: the port scheme every SpecSplit process follows, the HTTP server, and the
routers' collector. No ``specsplit`` import (routers must not pull in torch); the workers' and
the orchestrator's metrics (``specsplit.metrics``) use the port scheme from here.

Ports (``MetricsSettings``): a process serves Prometheus text on
``SPECSPLIT_METRICS_PORT + ROLE_OFFSETS[role] + instance - 1`` on ``SPECSPLIT_METRICS_HOST``
(127.0.0.1), where ``instance`` is N of honcho's ``HONCHO_PROCESS_NAME`` "role.N" (1 without
honcho). With the default base 9500: router_draft 9500, router_target 9600, orchestrator.N
9700+N-1, draft.N 9800+N-1, target.N 9900+N-1, so ``honcho start -c draft=2,target=2`` gives
draft 9800/9801 and target 9900/9901. ``SPECSPLIT_METRICS_BIND_PORT`` sets this one process's
port outright; port 0 (either setting) turns metrics off. A port already in use is logged
(``metrics_port_unavailable``) and the process carries on without metrics.

Nothing here runs at import: ``serve_metrics`` is called from a role's main path.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from brokers.settings import MetricsSettings

# 100 ports per role: room for honcho -c role=N up to 100 on one host
ROLE_OFFSETS: dict[str, int] = {"router_draft": 0, "router_target": 100, "orchestrator": 200, "draft": 300,
                                "target": 400}
ROLE_SLOTS = 100


def instance_slot(environ=None) -> int:
    """This process's instance number: N of honcho's HONCHO_PROCESS_NAME "role.N" (foreman: PS);
    1 without one. (Mirrors ``specsplit.config.honcho_slot``; brokers cannot import specsplit.)"""
    environ = os.environ if environ is None else environ
    name = environ.get("HONCHO_PROCESS_NAME") or environ.get("PS") or ""
    tail = name.rsplit(".", 1)[-1]
    return int(tail) if "." in name and tail.isdigit() and int(tail) >= 1 else 1


def metrics_port(settings: MetricsSettings, role: str, slot: int) -> int:
    """The port ``role``'s instance ``slot`` serves metrics on; 0: off."""
    if role not in ROLE_OFFSETS:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLE_OFFSETS)}")
    if settings.metrics_bind_port is not None:
        return settings.metrics_bind_port
    if settings.metrics_port == 0:
        return 0
    if not 1 <= slot <= ROLE_SLOTS:
        raise ValueError(f"instance {slot} of {role}: the port scheme has {ROLE_SLOTS} per role "
                         "(set SPECSPLIT_METRICS_BIND_PORT)")
    port = settings.metrics_port + ROLE_OFFSETS[role] + slot - 1
    if port > 65535:
        raise ValueError(f"SPECSPLIT_METRICS_PORT={settings.metrics_port}: {role}.{slot} would serve on {port}")
    return port


def serve_metrics(registry: CollectorRegistry, settings: MetricsSettings, role: str, log,
                  environ=None) -> int | None:
    """Serve ``registry`` over HTTP (a daemon thread) on this process's port; the port, or None
    when metrics are off or the port cannot be bound (logged; the process carries on)."""
    try:
        port = metrics_port(settings, role, instance_slot(environ))
    except ValueError as exc:  # outside the scheme (a 101st instance, a base too high): no metrics
        log.warning("metrics_port_invalid", error=str(exc))
        return None
    if port == 0:
        log.info("metrics_off")
        return None
    disable_created_metrics()  # no *_created series beside every counter (process-wide; main path only)
    try:
        start_http_server(port, addr=settings.metrics_host, registry=registry)
    except OSError as exc:  # in use, or not ours to bind: metrics are not worth the process
        log.warning("metrics_port_unavailable", port=port, host=settings.metrics_host, error=str(exc))
        return None
    log.info("metrics_serving", url=f"http://{settings.metrics_host}:{port}/metrics")
    return port


def count_restarts(registry: CollectorRegistry, settings: MetricsSettings) -> Counter:
    """``specsplit:process_restarts_total``: times this process's supervisor restarted the role
    (the supervisor passes the count to each child it starts; 0 unsupervised). A counter: it
    only grows while the supervisor lives, and a new supervisor starts it over (a reset)."""
    c = Counter("specsplit:process_restarts", "Restarts of this role by its supervisor (specsplit.supervise)",
                registry=registry)
    c.inc(settings.supervised_restarts)
    return c


# RouterStats field -> (metric name without "specsplit:router_", help)
_ROUTER_COUNTERS = {
    "routed": ("routed", "Requests forwarded to a worker"),
    "replies": ("replies", "Worker replies forwarded to a client"),
    "no_worker": ("no_worker", "Requests answered NO_WORKER (no live worker)"),
    "overloaded": ("overloaded", "Requests answered OVERLOADED (in-flight table or worker queue full)"),
    "bad_frames": ("bad_frames", "Malformed frames from clients or workers"),
    "workers_admitted": ("workers_admitted", "WORKER_HELLOs admitted"),
    "workers_refused": ("workers_refused", "WORKER_HELLOs refused"),
    "workers_expired": ("workers_expired", "Workers expired after liveness x heartbeat_s of silence"),
    "workers_lost": ("workers_lost", "Workers dropped because a send to them failed"),
    "inflight_failed": ("inflight_failed", "In-flight requests answered NO_WORKER because their worker was lost"),
    "ends_copied": ("end_session_copies", "END_SESSION copies sent to workers other than the session's own"),
}


class RouterCollector(Collector):
    """Reads a router's ``RouterStats`` and registry at scrape time (plain int reads, safe from
    the HTTP thread). Labels: ``service`` (draft | target) only."""

    def __init__(self, router) -> None:
        self.router = router

    def collect(self):
        service, stats = self.router.service, self.router.stats
        for field, (name, doc) in _ROUTER_COUNTERS.items():
            fam = CounterMetricFamily(f"specsplit:router_{name}", doc, labels=["service"])
            fam.add_metric([service], getattr(stats, field))
            yield fam
        live = GaugeMetricFamily("specsplit:router_workers_live", "Admitted, live workers", labels=["service"])
        live.add_metric([service], len(self.router.live_workers()))
        yield live
        inflight = GaugeMetricFamily("specsplit:router_inflight", "Requests in flight on workers", labels=["service"])
        inflight.add_metric([service], len(self.router.inflight))
        yield inflight


def router_registry(router, settings: MetricsSettings) -> CollectorRegistry:
    """A registry with the router's counters and the process's restart count."""
    registry = CollectorRegistry()
    registry.register(RouterCollector(router))
    count_restarts(registry, settings)
    return registry
