"""Every SPECSPLIT_* variable has one meaning: no name is read by two settings classes unless
both inherit the one field that defines it; removed names are refused; ``specsplit config``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from specsplit.configdoc import settings_classes

def env_names(cls) -> dict[str, type]:
    """{SPECSPLIT_* name: the class that declares the field} for one settings class."""
    prefix = cls.model_config.get("env_prefix", "")
    out = {}
    for field, info in cls.model_fields.items():
        alias = info.validation_alias if isinstance(info.validation_alias, str) else None
        name = (alias or f"{prefix}{field}").upper()
        owner = next(k for k in cls.__mro__ if field in getattr(k, "__annotations__", {}))
        out[name] = owner
    return out


def test_every_variable_has_one_definition():
    classes = settings_classes()
    assert len(classes) >= 7, [c.__name__ for c in classes]  # routers, workers, orchestrator, producer, models, bases
    owners: dict[str, set[type]] = defaultdict(set)
    readers: dict[str, list[str]] = defaultdict(list)
    for cls in classes:
        for name, owner in env_names(cls).items():
            owners[name].add(owner)
            readers[name].append(cls.__name__)
    assert all(name.startswith("SPECSPLIT_") for name in owners), sorted(owners)
    twice = {name: sorted(o.__qualname__ for o in found) for name, found in owners.items() if len(found) > 1}
    assert not twice, f"variables defined by two settings classes (two meanings or defaults): {twice}"
    # the shared ones really are shared: addresses, heartbeat and logging, read by several roles
    for name in ("SPECSPLIT_TARGET_ROUTER", "SPECSPLIT_ORCHESTRATOR", "SPECSPLIT_HEARTBEAT_S", "SPECSPLIT_LOG_LEVEL"):
        assert len(readers[name]) >= 2, (name, readers[name])


def test_removed_variables_are_not_read_and_are_refused():
    from specsplit.config import REMOVED_SETTINGS, check_removed_settings

    read = {name for cls in settings_classes() for name in env_names(cls)}
    assert not read & set(REMOVED_SETTINGS)
    check_removed_settings({"SPECSPLIT_GROW": "1"})
    with pytest.raises(SystemExit, match="SPECSPLIT_WORKER_MAX_SESSIONS"):
        check_removed_settings({"SPECSPLIT_MAX_SESSIONS": "8"})
    with pytest.raises(SystemExit, match="overlap was removed"):
        check_removed_settings({"SPECSPLIT_OVERLAP": "true"})


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    # no env file: the repository's .env (the real models' int8 kernels) stays out of these checks
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECSPLIT_")} | {"SPECSPLIT_ENV_FILE": ""}
    return subprocess.run([sys.executable, "-m", "specsplit", *args], capture_output=True, text=True, timeout=120,
                          env={**clean, **env})


def test_config_command_prints_each_roles_effective_settings():
    target = json.loads(run_cli("config", "target", SPECSPLIT_TARGET_DEVICE="cpu", SPECSPLIT_THREADS="3").stdout)
    assert target["effective"]["device"] == "cpu" and target["effective"]["threads"] == 3
    assert target["effective"]["router_backend"] == "tcp://127.0.0.1:5561"
    orch = json.loads(run_cli("config", "orchestrator", SPECSPLIT_ORCHESTRATOR_MAX_SESSIONS="7").stdout)
    assert orch["orchestrator"]["orchestrator_max_sessions"] == 7 and orch["effective"]["tree"]["max_nodes"] == 16
    every = json.loads(run_cli("config").stdout)
    assert set(every) == {"router", "draft", "target", "pair", "orchestrator", "produce", "api"}
    assert every["pair"] == {"draft": every["draft"], "target": every["target"]}  # one process, both workers
    assert every["router"]["target"]["backend_addr"] == every["target"]["worker"]["target_backend"]
    bad = run_cli("config", "nope")
    assert bad.returncode == 2 and "unknown role" in bad.stderr
    removed = run_cli("config", "orchestrator", SPECSPLIT_REQUEST_TIMEOUT_S="5")
    assert removed.returncode != 0 and "SPECSPLIT_RPC_TIMEOUT_S" in removed.stderr


def test_device_setting_is_validated():
    from pydantic import ValidationError

    from specsplit.models import ModelSettings

    assert ModelSettings(target_device="CUDA:1").target_device == "cuda:1"
    for bad in ("gpu", "cuda:x", "tpu"):
        with pytest.raises(ValidationError):
            ModelSettings(draft_device=bad)


WORKER_ENV_PROBE = """
import os, sys, types
fake = types.ModuleType("specsplit.workers")
def run_worker(service, *args):
    print(service, os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
    return 0
fake.run_worker = run_worker
sys.modules["specsplit.workers"] = fake
from specsplit import cli
sys.exit(cli._worker(sys.argv[1], []))
"""


@pytest.mark.parametrize("given, expected", [(None, "3000"), ("0", "0")])
def test_a_worker_loads_openmp_with_a_short_spin_unless_the_environment_says_otherwise(given, expected):
    """libgomp reads GOMP_SPINCOUNT once, as torch loads it: the worker sets its default before
    anything imports torch (PASSIVE alone made a 2-thread prompt prefill 1.36x slower), and a
    value from the environment (.env, the shell) wins."""
    from specsplit.cli import WORKER_SPINCOUNT

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    out = subprocess.run([sys.executable, "-c", WORKER_ENV_PROBE, "target"], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out == ["target", "PASSIVE", expected, "False"] and WORKER_SPINCOUNT == "3000"


def test_a_lookup_fleets_target_takes_every_core_unless_told_otherwise():
    """No draft worker shares the cores with SPECSPLIT_SPECULATOR=lookup: the target's default
    threads are every core; with a draft worker, its share; an explicit setting wins."""
    from specsplit.backends import default_prefill_threads, default_threads

    cores = default_prefill_threads()
    assert default_threads("target", "lookup") == cores
    assert default_threads("target") == max(1, cores - max(1, cores // 4))
    lookup = json.loads(run_cli("config", "target", SPECSPLIT_SPECULATOR="lookup").stdout)
    assert lookup["effective"]["threads"] == cores
    told = json.loads(run_cli("config", "target", SPECSPLIT_SPECULATOR="lookup", SPECSPLIT_TARGET_THREADS="1").stdout)
    assert told["effective"]["threads"] == 1
