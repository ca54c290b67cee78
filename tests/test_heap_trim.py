"""A CPU worker gives its C heap's free pages back (backends.CpuBackend.trim).

The soak of the real pair showed the target's RSS climbing 7.9 -> 9.4 GB while the KV it held
stayed flat: blocks freed below a live one stay resident in glibc's heap. Reproduced here in a
fresh process: tensors large enough to be mapped at first are served from the heap once glibc
has raised its mmap threshold (it does so whenever a mapped block is freed), all but the last
are freed, and the RSS stays up until the backend trims after a forward.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specsplit.backends import malloc_trim

pytestmark = pytest.mark.skipif(malloc_trim() is None or not sys.platform.startswith("linux"),
                                reason="glibc's malloc_trim and /proc are Linux/glibc only")

SCRIPT = r"""
import json, os, sys, time
import torch
from specsplit.backends import CpuBackend

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

every = float(sys.argv[1])
backend = CpuBackend(1, 1, trim_every_s=every)
first = torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # mapped; freeing it raises the threshold
del first
blocks = [torch.empty(4 << 20, dtype=torch.uint8).fill_(1) for _ in range(100)]  # now from the heap
pin = torch.empty(1 << 10, dtype=torch.uint8)  # a live block above them: free() cannot trim the top
last = blocks[-1]
del blocks
before = rss_mib()
time.sleep(2 * every if every else 0.01)
backend.after_forward(1, 1.0)
after = rss_mib()
print(json.dumps({"before": before, "after": after, "trims": backend.trims,
                  "describe": {k: v for k, v in backend.describe().items() if k.startswith("trim")}}))
"""


def run(every: float) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(every)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_heap_blocks_stay_resident_until_the_backend_trims_after_a_forward():
    off = run(0.0)  # the setup reproduces the problem: ~396 MiB freed, still resident
    assert off["trims"] == 0
    assert off["after"] > off["before"] - 50, off
    assert off["before"] > 350, off
    on = run(0.05)
    assert on["trims"] == 1 and on["describe"]["trim_every_s"] == 0.05
    assert on["before"] - on["after"] > 300, on  # the freed 4 MiB blocks left the RSS


def test_the_backend_trims_at_most_once_per_interval():
    from specsplit.backends import CpuBackend

    backend = CpuBackend(1, 1, trim_every_s=3600.0)
    for _ in range(50):
        backend.after_forward(1, 1.0)
    assert backend.trims == 0  # the first interval has not passed
    backend._trimmed_at -= 3600.0
    for _ in range(50):
        backend.after_forward(1, 1.0)
    assert backend.trims == 1
