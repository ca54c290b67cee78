"""ops/pip_sources.py: ops/setup.sh hands uv the package sources and constraints pip is configured
with (uv reads none of pip's configuration), read from pip itself, a PIP_* variable winning over a
file as it does for pip."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("pip_sources", REPO / "ops" / "pip_sources.py")
pip_sources = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pip_sources)


def _run(tmp_path: Path, config: str, **env: str) -> list[str]:
    (tmp_path / "pip.conf").write_text(config)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    # pip reads its global and user files too (this machine has one): none here
    clean.update({"PIP_CONFIG_FILE": str(tmp_path / "pip.conf"), "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
                  "XDG_CONFIG_DIRS": str(tmp_path / "xdg-dirs"), "HOME": str(tmp_path), **env})
    out = subprocess.run([sys.executable, str(REPO / "ops" / "pip_sources.py")], env=clean, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return out.splitlines()


def test_sources_and_constraints_from_pips_files_and_variables(tmp_path):
    got = _run(tmp_path, "[global]\nextra-index-url = file:///a/simple file:///b/simple\nfind-links = /files\n"
               "constraint = /c.txt\ncert = /ca.crt\n[install]\nfind-links = /install-files\n",
               PIP_INDEX_URL="https://mirror.example/simple")
    assert got == ["--index-url", "https://mirror.example/simple",
                   "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
                   "--find-links", "/install-files", "--constraint", "/c.txt"]  # no cert: not a source


def test_a_variable_wins_over_the_file_and_no_index_passes_on(tmp_path):
    got = _run(tmp_path, "[global]\nfind-links = /files\n", PIP_FIND_LINKS="/env-files", PIP_NO_INDEX="1")
    assert got == ["--find-links", "/env-files", "--no-index"]


def test_nothing_configured_prints_nothing(tmp_path):
    assert _run(tmp_path, "", PIP_CONFIG_FILE=os.devnull) == []  # devnull: pip reads no file at all


def test_lines_it_does_not_know_are_left_out():
    listing = "global.timeout='60'\nglobal.find-links=not a literal\n:env:.constraint='/x.txt'\nnonsense\n"
    assert pip_sources.sources(listing) == ["--constraint", "/x.txt"]
