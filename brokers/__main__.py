"""``python -m brokers draft|target``: run one router until SIGTERM/SIGINT (then exit 0)."""

from __future__ import annotations

import argparse
import sys
import threading

import zmq
from pydantic import ValidationError

from brokers.curve import CurveError
from brokers.metrics import router_registry, serve_metrics
from brokers.auth import SecretError
from brokers.router import Router
from brokers.settings import SERVICES, MetricsSettings, RouterSettings
from brokers.signals import restore, set_on_stop_signals
from brokers.logs import configure_logging, get_logger


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m brokers", description="Run a SpecSplit router.")
    p.add_argument("service", choices=SERVICES)
    p.add_argument("--frontend", dest="frontend_addr", help="bind address for clients")
    p.add_argument("--backend", dest="backend_addr", help="bind address for workers")
    p.add_argument("--heartbeat-s", dest="heartbeat_s", type=float)
    p.add_argument("--liveness", type=int, help="missed heartbeats before a worker is dead")
    p.add_argument("--log-level", dest="log_level")
    p.add_argument("--log-json", dest="log_json", action="store_true", default=None)
    return p.parse_args(argv)


def build_router(settings: RouterSettings) -> Router:
    """Raises brokers.auth.SecretError when the fleet secret cannot be read or made."""
    return Router(
        settings.service,
        settings.frontend_addr,
        settings.backend_addr,
        heartbeat_s=settings.heartbeat_s,
        liveness=settings.liveness,
        max_workers=settings.max_workers,
        max_inflight=settings.max_inflight,
        request_ttl_s=settings.request_ttl_s,
        sndhwm=settings.sndhwm,
        rcvhwm=settings.rcvhwm,
        curve=settings.curve_keys(server=True),
        secret=settings.secret(),
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point (also used by ``specsplit router``). 0 on a clean stop, 2 on bad settings,
    1 when the router cannot bind."""
    args = _parse(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    try:
        settings = RouterSettings(**overrides)
        metrics = MetricsSettings()
    except ValidationError as exc:
        print(f"invalid router settings:\n{exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, json=settings.log_json)
    log = get_logger("brokers", service=settings.service)
    try:  # once: a Router owns a zmq context
        router = build_router(settings)
    except SecretError as exc:
        log.error("fleet_secret_unavailable", error=str(exc))
        return 2
    except CurveError as exc:
        log.error("router_curve_refused", error=str(exc))
        print(f"invalid router settings: {exc}", file=sys.stderr)
        return 2
    # the main thread only ever reads the event (is_set), never waits on it (brokers.signals)
    stop = threading.Event()
    previous = set_on_stop_signals(stop)
    serve_metrics(router_registry(router, metrics), metrics, f"router_{settings.service}", log)
    try:
        router.run(stop)
    except zmq.ZMQError as exc:
        log.error("router_failed", error=str(exc), frontend=settings.frontend_addr, backend=settings.backend_addr)
        return 1
    finally:
        router.close()
        restore(previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
