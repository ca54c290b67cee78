"""``ops/gpu_summary.py``: one device run's bars in one table, read from the JSON files that
``ops/gpu_check.sh run`` writes (here the H200 runs kept in ops/results, under the names the
check gives them)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "ops" / "results"


def test_the_summary_judges_each_bar(tmp_path):
    for src, name in (("gpu-cost-h200-qwen2.5-coder-1.5b-random-bf16-eager-same-call.json", "gpu-cost-eager.json"),
                      ("gpu-cost-h200-qwen2.5-coder-1.5b-random-bf16-graphs-host-verdict.json", "gpu-cost-fused.json"),
                      ("replay-humaneval0-9-qwen-coder-draft-grown-cpu2-amx.json", "gpu-replay-pool8-fused.json"),
                      ("gpu-replay-h200-humaneval-qwen-coder-random-bf16-graphs.json", "gpu-replay-lookup.json"),
                      ("replay-fleet-humaneval0-9-spares-cpu2-amx.json", "gpu-replay-fleet.json"),
                      ("fleet-cpu-tiny-cpu2-amx.json", "fleet-cpu.json")):
        shutil.copy(RESULTS / src, tmp_path / name)
    done = subprocess.run([sys.executable, str(ROOT / "ops" / "gpu_summary.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=60, check=True)
    rows = {tuple(c.strip() for c in line.strip("|").split("|")) for line in done.stdout.splitlines()
            if line.startswith("| gpu-")}
    assert ("gpu-cost-eager.json", "eager", "512", "1-token forward / floor", "29.34", "2.0", "FAIL") in rows
    assert ("gpu-cost-fused.json", "default", "512", "16-node verify / 1-token forward", "1.2", "1.3", "PASS") in rows
    assert ("gpu-cost-fused.json", "default", "512", "1-token ms", "4.695", "", "") in rows
    replay = {(r[0], r[3]): r[6] for r in rows if r[0].startswith("gpu-replay")}
    # with a replayed draft the fleet is "grown during verify" and the rest bound it; without, verify only
    assert replay[("gpu-replay-pool8-fused.json", "grown during verify / alone")] == "FAIL"
    assert replay[("gpu-replay-pool8-fused.json", "verify only / alone")] == "(bound)"
    assert replay[("gpu-replay-lookup.json", "verify only / alone")] == "PASS"
    # through the fleet's processes (--fleet) the measured rounds are the fleet; the model bounds them
    assert replay[("gpu-replay-fleet.json", "fleet processes / alone")] == "FAIL"  # 1.47x on a 2-core CPU
    assert replay[("gpu-replay-fleet.json", "grown during verify / alone")] == "(bound)"
    assert replay[("gpu-replay-fleet.json", "fleet processes, alone's round trips / alone")] == "(bound)"
    assert "| CPU of orchestrator | 1.42 |" in done.stdout and "| wall: verify round trip | 1.495 |" in done.stdout


def test_the_summary_lists_the_tiles_tuning_chose(tmp_path):
    data = json.loads((RESULTS / "gpu-cost-h200-qwen2.5-coder-1.5b-random-bf16-graphs-host-verdict.json").read_text())
    data["command"] += " --graph-body triton_gemm"
    data["models"]["target"].setdefault("graphs", {})["gemm_tiles"] = {"1536x8960 silures": "n16 k256 split4 w4 (x1.62)"}
    (tmp_path / "gpu-cost-triton_gemm.json").write_text(json.dumps(data))
    done = subprocess.run([sys.executable, str(ROOT / "ops" / "gpu_summary.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=60, check=True)
    assert "| gpu-cost-triton_gemm.json | triton_gemm | 512 | tile 1536x8960 silures | n16 k256 split4 w4 (x1.62) | | |" \
        in done.stdout.splitlines()
