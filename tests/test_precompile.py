"""specsplit.precompile, run by ops/setup.sh: in the venv setup leaves, a process that loads a model
as a worker does, with PYTHONDONTWRITEBYTECODE=1 (set on this project's machines), finds a
current .pyc for every module it imports from the venv, so no process compiles torch or
transformers again. (The project's own modules are left out: editing one makes its .pyc stale.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# a process that loads a tiny model as a worker does, then lists the modules it imported from the
# venv without a current .pyc beside them
PROBE = """
import importlib.util, json, os, sys, tempfile
from specsplit.cli import main  # noqa: F401 - the entry point every role starts from
import brokers.__main__, specsplit.workers, specsplit.orchestrator.server, specsplit.api.server  # noqa: F401
from specsplit.models.loading import load_model
from specsplit.models.tiny import build_tiny_pair
with tempfile.TemporaryDirectory() as tmp:
    load_model(build_tiny_pair(tmp).target)
root = os.path.realpath(sys.prefix)
stale = []
for name, mod in list(sys.modules.items()):
    src = getattr(mod, "__file__", None) or ""
    # the editable install's finder: pip rewrites it on every install, a file of a few lines
    if not src.endswith(".py") or not os.path.realpath(src).startswith(root) or name.startswith("__editable__"):
        continue
    pyc = importlib.util.cache_from_source(src)
    if not os.path.isfile(pyc) or os.path.getmtime(pyc) < os.path.getmtime(src):
        stale.append(name)
print(json.dumps({"stale": sorted(stale), "modules": len(sys.modules)}))
"""


def test_a_worker_in_the_venv_setup_made_compiles_nothing():
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the tests' (conftest): a worker runs without, importing less of Triton
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=REPO,
                           timeout=600, check=False)
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    assert got["modules"] > 1000  # torch and transformers were imported: the check covered them
    assert got["stale"] == [], (f"{len(got['stale'])} modules without a current .pyc (./ops/setup.sh runs "
                                f"python -m specsplit.precompile): {got['stale'][:20]}")
