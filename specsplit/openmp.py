"""OpenMP's wait policy for processes that run torch's CPU kernels, set before torch loads.

libgomp reads ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` once, as torch loads it, so these only
take effect in a process that has not imported torch yet; a value from the environment (.env,
the shell) always wins. Stdlib only: ``specsplit.cli`` imports it before anything else.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY = "PASSIVE"  # idle OpenMP threads sleep instead of spinning on the other process's cores

# How long a worker's idle OpenMP thread spins before it sleeps (libgomp reads GOMP_SPINCOUNT once,
# as torch loads it; under PASSIVE alone it is 0). With 0, every parallel region of a multi-thread
# forward (a prompt prefill on both cores) wakes a sleeping thread, which on these VMs costs more
# than the region. Measured on the 2-core box, 250-token prefills on 2 threads:
# - alone, the 1.5B int8 target: 0.95 s at 0 spins, 0.91 at 1000, 0.70 at 3000, 0.62 at 10000+;
# - beside a 1-thread verify in another process (the verify unchanged): the 0.5B draft 589 ms at
#   0, 587 at 3000, 710 at 10000, 958 at 30000; the 1.5B target 1.25 s at 0, 1.33 at 1000, 1.45-1.52
#   at 3000, 13 s at 300000 (libgomp's default: threads spin through the other process's slices).
# A prompt's prefill usually has the cores to itself (a lone session's draft and target prefill
# one after the other; plain decoding under load leaves the draft idle), so ~3000 spins (tens of
# microseconds) keep most of the first gain for at most a fifth more where prefills contend.
WORKER_SPINCOUNT = "3000"


def set_wait_policy() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)


def set_worker_openmp() -> None:
    """A worker's OpenMP environment (the wait policy and ``WORKER_SPINCOUNT``), unless the
    environment sets them; the spin count only while torch is not loaded yet (libgomp has read it)."""
    set_wait_policy()
    if "torch" not in sys.modules:
        os.environ.setdefault("GOMP_SPINCOUNT", WORKER_SPINCOUNT)
