"""``ops/fleet_cpu.py``: the host's CPU per decoding round of each fleet process, on the tiny fleet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_each_process_s_cpu_per_round(tmp_path):
    out = tmp_path / "fleet-cpu.json"
    subprocess.run([sys.executable, str(ROOT / "ops" / "fleet_cpu.py"), "--prompts", "2", "--tokens", "48",
                    "--json", str(out), "SPECSPLIT_GROW=false"], check=True, timeout=240, capture_output=True)
    data = json.loads(out.read_text())
    assert set(data["cpu_ms_per_round"]) == {"router_draft", "router_target", "draft0", "target0", "orchestrator"}
    cpu = data["cpu_ms_per_round"]  # /proc's clock ticks (10 ms): a router's few ms may not reach one
    assert min(cpu["draft0"], cpu["target0"], cpu["orchestrator"]) > 0  # each child's CPU, not its supervisor's only
    assert data["rounds"] >= 2 and data["config"]["settings"] == {"SPECSPLIT_GROW": "false"}
    t = data["trace_median_ms"]
    assert min(t.values()) > 0  # wall, draft, verify, and the rest of a round


def test_a_pair_process_in_place_of_the_two_workers(tmp_path):
    """``--pair``: both workers in one ``specsplit pair`` process, counted as one."""
    out = tmp_path / "fleet-cpu.json"
    subprocess.run([sys.executable, str(ROOT / "ops" / "fleet_cpu.py"), "--prompts", "2", "--tokens", "48", "--pair",
                    "--json", str(out)], check=True, timeout=240, capture_output=True)
    data = json.loads(out.read_text())
    assert set(data["cpu_ms_per_round"]) == {"router_draft", "router_target", "pair", "orchestrator"}
    assert data["cpu_ms_per_round"]["pair"] > 0 and data["config"]["pair"] is True
    assert data["drafted_rounds"] > 0  # the pair's draft role drafted
