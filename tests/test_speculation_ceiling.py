"""ops/speculation_ceiling.py: the bound it prints follows from the forward costs it measured, on
the real target engine (tiny preset) through the worker's own engine builder."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "ops" / "speculation_ceiling.py"


def _module():
    spec = importlib.util.spec_from_file_location("speculation_ceiling", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("k", [1, 2, 4, 16])
def test_break_even_solves_expected_chain_tokens(k):
    be = _module().break_even
    assert be(1.0, k) == 0.0 and be(0.7, k) == 0.0  # a chain that costs no more than plain always pays
    assert be(k + 0.01, k) is None  # costs more than k tokens: never pays
    for ratio in [1.2, 1.5, 0.9 * k]:
        if ratio <= 1.0 or ratio > k:
            continue
        a = be(ratio, k)
        assert 0.0 < a <= 1.0
        assert sum(a ** i for i in range(k)) == pytest.approx(ratio, abs=1e-6)


def test_ceiling_follows_from_measured_costs(tmp_path):
    out = tmp_path / "ceiling.json"
    env = {**os.environ, "SPECSPLIT_PRESET": "tiny", "SPECSPLIT_TARGET_THREADS": "1", "SPECSPLIT_LOG_LEVEL": "WARNING",
           "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--context", "40", "--sessions", "1,3", "--tokens", "2,4",
                           "--repeat", "2", "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["sessions"], r["tokens_per_session"]) for r in rows} == {(b, k) for b in (1, 3) for k in (1, 2, 4)}
    for b in (1, 3):
        plain = next(r for r in rows if r["sessions"] == b and r["tokens_per_session"] == 1)
        assert plain["ceiling"] == 1.0 and plain["cost_vs_plain"] == 1.0
        for r in (r for r in rows if r["sessions"] == b):
            assert len(r["samples_ms"]) == 2 and all(ms > 0 for ms in r["samples_ms"])
            assert r["forward_tokens"] == b * r["tokens_per_session"]
            # the JSON keeps ms to 3 decimals and ratios to 3: a tiny model's sub-ms forwards
            # make that rounding the tolerance
            ratio = r["forward_ms"] / plain["forward_ms"]
            slack = 1e-3 + 5e-4 * (1 + ratio) / plain["forward_ms"]
            assert r["cost_vs_plain"] == pytest.approx(ratio, abs=slack)
            assert r["ceiling"] == pytest.approx(r["tokens_per_session"] / r["cost_vs_plain"], rel=2e-3, abs=2e-3)
        assert data["ceiling"][str(b)] == max(r["ceiling"] for r in rows if r["sessions"] == b)
    assert "| sessions | tokens each |" in proc.stdout
