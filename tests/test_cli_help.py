"""``specsplit ROLE --help`` prints usage and starts nothing: no model, no socket, no supervisor."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest


@pytest.mark.parametrize("role", [["target"], ["draft"], ["pair"], ["orchestrator"], ["router", "target"], ["api"],
                                  ["produce"]])
def test_role_help_prints_usage_without_starting_the_role(role):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "specsplit", *role, "--help"], capture_output=True, text=True,
                         timeout=60, env={"SPECSPLIT_PRESET": "qwen-coder", "PATH": "/usr/bin:/bin"})
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:"), out.stdout[:200]
    assert "worker_loaded" not in out.stderr and "started" not in out.stderr and "supervise" not in out.stderr
    assert took < 30, took


def test_a_role_refuses_arguments_it_does_not_take():
    out = subprocess.run([sys.executable, "-m", "specsplit", "target", "--threads", "2"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "unrecognized arguments" in out.stderr


def test_a_roles_usage_says_where_its_settings_come_from():
    out = subprocess.run([sys.executable, "-m", "specsplit", "orchestrator", "--help"], capture_output=True,
                         text=True, timeout=60, check=True)
    text = " ".join(out.stdout.split())
    assert ".env in the working directory" in text and "its values over the shell's" in text
    assert "SPECSPLIT_ENV_FILE" in text
