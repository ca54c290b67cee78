"""``ops/gpu_check.sh run``, dry: with python3, nvidia-smi and timeout stubbed, every step runs
with its defaults. Device time is scarce (a session may be lent one once in many): a step that
fails in the shell (under ``set -u``, arithmetic on an unset budget) costs a whole device call."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("longctx", ["0", "1"])
def test_every_step_runs_with_the_default_budgets(tmp_path, longctx):
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for name in ("python3", "nvidia-smi"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\n')
    (bin_dir / "timeout").write_text('#!/bin/sh\necho "timeout $1" >> "' + str(calls) + '"\nshift\nexec "$@"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_S") and k not in ("LONGCTX", "BODIES")}
    (tmp_path / "out").mkdir()
    env |= {"OUT": str(tmp_path / "out"), "PATH": f"{bin_dir}:{env['PATH']}", "LONGCTX": longctx}
    run = subprocess.run(["bash", str(ROOT / "ops" / "gpu_check.sh"), "run"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "unbound variable" not in run.stdout + run.stderr, run.stderr[-2000:]
    text = calls.read_text()
    steps = ["-m pytest", "--no-cuda-graphs", "--context", "gpu_probe.py", "gpu-replay-pool", "gpu-replay-lookup",
             "gpu-replay-grown", "fleet_cpu.py", "gpu-replay-fleet", "gpu-replay-pair", "gpu-replay-overlap",
             "gpu_summary.py"] + (["gpu_attention.py", "gpu_longctx.py"] if longctx == "1" else [])
    for step in steps:
        assert step in text, f"the step with {step!r} did not run"
    for script in re.findall(r"^python3 (gpu_\w+\.py)", text, re.MULTILINE):  # run from ops/
        assert (ROOT / "ops" / script).exists(), script
    assert all(int(t) > 0 for t in re.findall(r"^timeout (\S+)$", text, re.MULTILINE))
    assert all(float(s) > 0 for s in re.findall(r"--max-seconds (\S+)", text))
    # what each step is given: files that exist here (so they travel), flags its command takes
    from specsplit.bench import gpu, replay

    parsers = {"specsplit bench gpu": gpu.parse, "specsplit bench replay": replay.parse}
    parsed = 0
    for line in text.splitlines():
        for path in re.findall(r"(?:tests|ops)/[\w./-]+\.(?:py|gz)", line):
            assert (ROOT / path).exists(), f"{path}, named by: {line[:120]}"
        for name, parse in parsers.items():
            if f"-m {name} " in line:
                parse(line.split(f"-m {name} ", 1)[1].split())  # SystemExit on a flag it does not take
                parsed += 1
    assert parsed >= 8
