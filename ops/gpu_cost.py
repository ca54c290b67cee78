"""Superseded by ``specsplit bench gpu`` (specsplit/bench/gpu.py): the engines' forward costs on a
device, by tokens per forward and sessions per forward, against the floor the weight bytes set.
This script is that command (same arguments); ``build`` stays for ops/gpu_longctx.py.

    python ops/gpu_cost.py --device cuda --target-config DIR --draft-config DIR --json FILE
"""

from __future__ import annotations

import sys

from specsplit.bench.gpu import main
from specsplit.bench.gpu import random_model as build  # noqa: F401 (ops/gpu_longctx.py imports it from here)

if __name__ == "__main__":
    sys.exit(main())
