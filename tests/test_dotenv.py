"""Every ``specsplit`` command applies ``.env`` as ``honcho start`` does (specsplit.envfile): the
same file, honcho's own parsing, the file's values over the shell's, and read once per process
tree, so a process honcho (or a fleet launcher) started keeps what it was given."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from specsplit.envfile import ENV_FILE_VAR, apply_env_file
from specsplit.launch import Fleet

# a shell without our variables: no SPECSPLIT_*, not inside honcho
SHELL = {k: v for k, v in os.environ.items() if not k.startswith("SPECSPLIT_") and k != "HONCHO_PROCESS_NAME"}


def tree(cwd: Path, **env: str) -> dict:
    """``specsplit config orchestrator`` run in ``cwd``: its tree settings, and what it said on stderr."""
    out = subprocess.run([sys.executable, "-m", "specsplit", "config", "orchestrator"], cwd=cwd, env={**SHELL, **env},
                         capture_output=True, text=True, timeout=60, check=True)
    s = json.loads(out.stdout)["orchestrator"]
    return {"nodes": s["tree_max_nodes"], "depth": s["tree_max_depth"], "stderr": out.stderr}


def honcho_start(cwd: Path, procfile: str, *args: str, **env: str) -> str:
    """``honcho start ARGS`` of a one-process ``procfile`` in ``cwd``; its output."""
    (cwd / "Procfile").write_text(procfile)
    out = subprocess.run([sys.executable, "-m", "honcho", "start", *args], cwd=cwd, env={**SHELL, **env},
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_a_command_reads_the_env_file_of_its_working_directory(tmp_path):
    (tmp_path / ".env").write_text("# the loopback fleet\nSPECSPLIT_TREE_MAX_NODES=5\n")
    (tmp_path / "other.env").write_text("SPECSPLIT_TREE_MAX_NODES=6\n")
    got = tree(tmp_path)
    assert got["nodes"] == 5
    assert f"env file: {tmp_path / '.env'} set SPECSPLIT_TREE_MAX_NODES" in got["stderr"]
    assert tree(tmp_path, SPECSPLIT_ENV_FILE="other.env")["nodes"] == 6
    none = tree(tmp_path, SPECSPLIT_ENV_FILE="")
    assert none["nodes"] == 16 and "none read" in none["stderr"]
    both = apply_env_file({ENV_FILE_VAR: ".env, other.env"}, cwd=tmp_path)
    assert both.values == {"SPECSPLIT_TREE_MAX_NODES": "6"}  # later files win, as with honcho's -e a,b
    (tmp_path / "elsewhere").mkdir()
    assert apply_env_file({}, cwd=tmp_path / "elsewhere").files == ()  # another directory: its own .env


def test_the_files_values_win_over_the_shells_as_under_honcho_start(tmp_path):
    (tmp_path / ".env").write_text("SPECSPLIT_TREE_MAX_NODES=5\n")
    shell = {"SPECSPLIT_TREE_MAX_NODES": "7", "SPECSPLIT_TREE_MAX_DEPTH": "3"}
    got = tree(tmp_path, **shell)
    assert (got["nodes"], got["depth"]) == (5, 3)  # the file's over the shell's; the shell's where it is silent
    assert "over the shell's SPECSPLIT_TREE_MAX_NODES" in got["stderr"]
    dump = f"{shlex.quote(sys.executable)} -c 'import os; print(\"nodes\", os.environ[\"SPECSPLIT_TREE_MAX_NODES\"])'"
    assert "nodes 5" in honcho_start(tmp_path, f"p: {dump}\n", **shell)  # what honcho gives its processes


def test_a_process_honcho_started_keeps_honchos_env_file_and_its_own_overrides(tmp_path):
    """``honcho start -e other.env``: the command must not put the directory's .env back over
    other.env, nor over a Procfile line's own assignment."""
    (tmp_path / ".env").write_text("SPECSPLIT_TREE_MAX_NODES=5\nSPECSPLIT_TREE_MAX_DEPTH=5\n")
    (tmp_path / "other.env").write_text("SPECSPLIT_TREE_MAX_NODES=6\nSPECSPLIT_TREE_MAX_DEPTH=4\n")
    config = f"{shlex.quote(sys.executable)} -m specsplit config orchestrator"
    # one process (honcho stops the others when one exits): plain, then with its own assignment
    honcho_start(tmp_path, f"p: {config} > a.json; SPECSPLIT_TREE_MAX_DEPTH=9 {config} > b.json\n", "-e", "other.env")
    a = json.loads((tmp_path / "a.json").read_text())["orchestrator"]
    b = json.loads((tmp_path / "b.json").read_text())["orchestrator"]
    assert (a["tree_max_nodes"], a["tree_max_depth"]) == (6, 4)
    assert (b["tree_max_nodes"], b["tree_max_depth"]) == (6, 9)


TRICKY = """\
# a comment
A=plain
B="two words" # a trailing comment
C='single quoted'
export D=exported
E=
F=""
G=un quoted
H=x#y
I="new\\nline"
J=$HOME
K = spaced
L=x\\ny
1BAD=x
M=first
M=second
"""


def test_lines_parse_as_honcho_parses_them(tmp_path):
    """Differential: what a real ``honcho start`` gives its process, key by key, equals what
    apply_env_file puts in an environment holding the same shell values."""
    (tmp_path / ".env").write_text(TRICKY)
    keys = ["A", "B", "C", "D", "E", "F", "G", "H", "I", "J", "K", "L", "M"]
    shell = {"E": "from the shell", "D": "shell D"}
    dump = f"import json, os; print('DUMP' + json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"
    out = honcho_start(tmp_path, f"p: {shlex.quote(sys.executable)} -c {shlex.quote(dump)}\n", **shell)
    honcho = json.loads(out.split("DUMP", 1)[1].splitlines()[0])
    ours = dict(shell)
    apply_env_file(ours, cwd=tmp_path)
    assert {k: ours.get(k) for k in keys} == honcho
    # spelled out, so that a change of honcho's rules shows here too
    assert ours["B"] == "two words" and ours["G"] == "unquoted" and ours["H"] == "x" and ours["I"] == "new\nline"
    assert ours["D"] == "shell D" and ours["E"] == "from the shell" and ours["F"] == "" and ours["J"] == "$HOME"
    assert ours["K"] == "spaced" and ours["L"] == "xny" and ours["M"] == "second"


def test_the_file_is_read_once_per_process_tree(tmp_path):
    (tmp_path / ".env").write_text("SPECSPLIT_X=file\n")
    env = {"SPECSPLIT_X": "shell"}
    first = apply_env_file(env, cwd=tmp_path)
    assert env == {"SPECSPLIT_X": "file", ENV_FILE_VAR: ""} and first.replaced == ("SPECSPLIT_X",)
    child = {**env, "SPECSPLIT_X": "launcher's override"}  # what a process it starts is given
    again = apply_env_file(child, cwd=tmp_path)
    assert child["SPECSPLIT_X"] == "launcher's override" and again.files == () and again.values == {}
    under_honcho = {"HONCHO_PROCESS_NAME": "target.1"}
    assert apply_env_file(under_honcho, cwd=tmp_path).files == () and "SPECSPLIT_X" not in under_honcho
    named = {"HONCHO_PROCESS_NAME": "target.1", ENV_FILE_VAR: ".env"}
    assert apply_env_file(named, cwd=tmp_path).values == {"SPECSPLIT_X": "file"}  # asked for by name: read
    (tmp_path / "bad.env").write_bytes(b"SPECSPLIT_X=\xff\xfe\n")
    with pytest.raises(SystemExit, match="bad.env: not text"):
        apply_env_file({ENV_FILE_VAR: "bad.env"}, cwd=tmp_path)


def test_fleet_processes_read_no_env_file_over_the_fleets_pins(tmp_path):
    """A test fleet launched from the repository root (whose .env asks for int8 kernels) runs
    what Fleet.create pins, not the directory's .env."""
    (tmp_path / ".env").write_text("SPECSPLIT_TREE_MAX_NODES=5\nSPECSPLIT_PRESET=qwen-coder\n")
    fleet = Fleet.create(tmp_path / "fleet", SPECSPLIT_TREE_MAX_NODES="7")
    out = subprocess.run([sys.executable, "-m", "specsplit", "config", "orchestrator"], cwd=tmp_path, env=fleet.env,
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout)["orchestrator"]["tree_max_nodes"] == 7
    assert fleet.env["SPECSPLIT_PRESET"] == "tiny" and "none read" in out.stderr


def test_main_called_in_process_leaves_the_environment_alone(tmp_path, monkeypatch, capsys):
    from specsplit.cli import main

    (tmp_path / ".env").write_text("SPECSPLIT_TREE_MAX_NODES=5\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV_FILE_VAR, raising=False)
    monkeypatch.delenv("SPECSPLIT_TREE_MAX_NODES", raising=False)
    assert main(["config", "orchestrator"]) == 0
    assert json.loads(capsys.readouterr().out)["orchestrator"]["tree_max_nodes"] == 16
    assert "SPECSPLIT_TREE_MAX_NODES" not in os.environ and ENV_FILE_VAR not in os.environ
