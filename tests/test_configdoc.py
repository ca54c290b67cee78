"""docs/configuration.md is generated from the settings classes and kept current: every field has a
description, every SPECSPLIT_* variable appears in the committed file, and that file is exactly
what ``specsplit config --markdown`` makes now."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specsplit import configdoc

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / configdoc.DOC_PATH


def test_every_field_of_every_settings_class_has_a_description():
    classes = configdoc.settings_classes()
    assert len(classes) >= 13, [c.__name__ for c in classes]
    assert configdoc.undocumented() == []
    for cls in classes:
        for field, info in cls.model_fields.items():
            assert (info.description or "").strip(), f"{cls.__qualname__}.{field}"


def test_every_variable_appears_in_the_committed_file_with_its_default():
    text = DOC.read_text()
    names = configdoc.documented_names()
    assert len(names) >= 100, len(names)
    rows = {line.split("|")[1].strip(" `"): line for line in text.splitlines() if line.startswith("| `SPECSPLIT_")}
    missing = [name for name in names if name not in rows]
    assert not missing, f"not in {configdoc.DOC_PATH}: {missing}; run `{configdoc.COMMAND}`"
    assert "`tcp://127.0.0.1:5570`" in rows["SPECSPLIT_ORCHESTRATOR"]
    assert "`true`" in rows["SPECSPLIT_PACK_WEIGHTS"] and "| unset |" in rows["SPECSPLIT_WORKER_ID"]


def test_the_intro_states_how_the_env_file_is_read():
    intro = " ".join(configdoc.render().split("## Contents")[0].split())
    assert "every `specsplit` command also read `.env` in the working directory" in intro
    assert "its values win over the shell's" in intro and "`SPECSPLIT_ENV_FILE`" in intro
    assert "| `SPECSPLIT_ENV_FILE` |" in configdoc.render()


def test_committed_file_is_current():
    assert DOC.read_text() == configdoc.render(), (
        f"{configdoc.DOC_PATH} is stale: regenerate it with `{configdoc.COMMAND}` and commit it")


def test_config_markdown_command_prints_and_writes_it_without_torch(tmp_path):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECSPLIT_")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "specsplit", "config", *args], capture_output=True, text=True,
                              timeout=120, env=clean, cwd=ROOT, check=False)

    printed = run("--markdown")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == configdoc.render()
    out = tmp_path / "configuration.md"
    wrote = run("--markdown", str(out))
    assert wrote.returncode == 0, wrote.stderr
    assert out.read_text() == printed.stdout
    code = "import sys, specsplit.configdoc as c; c.render(); print('torch' in sys.modules)"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=clean,
                           check=False)
    assert probe.stdout.strip() == "False", probe.stderr
