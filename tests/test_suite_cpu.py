"""ops/suite_cpu.py: its recorder records a Python process as it exits, and the summary counts
each process under its role and the test file that started it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("suite_cpu", REPO / "ops" / "suite_cpu.py")
suite_cpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_cpu)


def test_the_recorder_records_a_process_with_its_test_and_cpu(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(suite_cpu.RECORDER)
    record = tmp_path / "procs.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SPECSPLIT_SUITE_CPU_RECORD": str(record),
           "PYTEST_CURRENT_TEST": "tests/test_x.py::test_y (call)"}
    burn = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass"
    subprocess.run([sys.executable, "-c", burn, "specsplit", "target"], env=env, check=True, timeout=60)
    (row,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert row["test"].startswith("tests/test_x.py::test_y") and row["cpu_s"] >= 0.2
    summary = suite_cpu.summarize([row])
    assert summary["by_role"] == {"target": {"processes": 1, "cpu_s": round(row["cpu_s"], 1)}}
    assert list(summary["started_by_test_file"]) == ["tests/test_x.py"]


def test_roles_and_totals():
    rows = [
        {"argv": ["/x/specsplit/__main__.py", "router", "draft"], "test": "tests/a.py::t (call)", "cpu_s": 1.0},
        {"argv": ["/x/bin/specsplit", "draft"], "test": "tests/a.py::t (setup)", "cpu_s": 8.0},
        {"argv": ["/x/specsplit/__main__.py", "orchestrator"], "test": "", "cpu_s": 1.5},
        {"argv": ["-c"], "test": "", "cpu_s": 300.0},  # an xdist worker
        {"argv": ["/x/pytest", "-n", "2", "tests/test_api.py"], "test": "", "cpu_s": 2.0},
        {"argv": ["/x/pip", "install"], "test": "", "cpu_s": 5.0},
    ]
    s = suite_cpu.summarize(rows)
    assert s["processes"] == 6 and s["cpu_s"] == 317.5
    assert s["by_role"]["tests in-process"] == {"processes": 2, "cpu_s": 302.0}
    assert [s["by_role"][r]["processes"] for r in ("router", "draft", "orchestrator", "other")] == [1, 1, 1, 1]
    assert s["started_by_test_file"]["tests/a.py"] == {"processes": 2, "cpu_s": 9.0}
    assert s["started_by_test_file"]["(no test)"]["processes"] == 2
    assert "| draft | 1 | 8.0 |" in suite_cpu.table("role", s["by_role"])
