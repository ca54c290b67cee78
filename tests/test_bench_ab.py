"""`specsplit bench` as an A/B of a change against a commit (issue 44): the specsplit_ref system's
report fields, its options, and the check that its fleet imports the other checkout's code
(no fleet starts, no model loads)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from specsplit.bench import quality as Q
from specsplit.bench import report as R
from specsplit.bench.systems import Answer, checkout_env, require_checkout

REPO = Path(__file__).resolve().parents[1]


def fake_checkout(root: Path, packages=("specsplit", "schemas", "brokers")) -> Path:
    for name in packages:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text("")
    return root


def test_speedup_and_identity_against_the_ref():
    rows = [R.make_row(i, "def f():", 3, {
        "target": Answer([1, 2, 3, 4], 2.0),
        "specsplit": Answer([1, 2, 3, 4], 0.5, rounds=2, accepted=2, drafted=8),
        "specsplit_ref": Answer([1, 2, 3, 4] if i == 0 else [1, 2, 7, 4], 1.0, rounds=4, accepted=0, drafted=8)})
        for i in range(2)]
    assert rows[0]["identical_to_ref"] is True and rows[0]["first_divergence_from_ref"] is None
    assert rows[1]["identical_to_ref"] is False and rows[1]["first_divergence_from_ref"] == 2
    assert rows[1]["ref_identical_to_target"] is False and rows[1]["identical_to_target"] is True
    assert rows[1]["specsplit_ref"]["mean_accepted"] == 1.0 and rows[1]["specsplit_ref"]["acceptance_rate"] == 0.0
    s = R.summarize(rows)
    assert s["totals"]["specsplit_ref"] == {"tokens": 8, "seconds": 2.0, "tok_s": 4.0}
    assert s["speedup_vs_ref"] == 2.0 and s["speedup_vs_target"] == 4.0  # 8 tok/s against 4 and 2
    assert (s["identical_to_ref"], s["ref_identical_to_target"], s["identical_to_target"]) == ("1/2", "1/2", "2/2")
    assert (s["mean_accepted"], s["ref_mean_accepted"]) == (2.0, 1.0)
    table = R.markdown(rows, s)
    assert "specsplit_ref tok/s" in table and "identical to ref" in table and "speedup_vs_ref = 2.0x" in table
    assert table.splitlines()[-3].endswith("| 2.0 | 1.0 | 2/2 | 1/2 | 1/2 |")


def test_sampled_outputs_are_not_compared_token_for_token():
    answers = {"specsplit": Answer([1], 1.0, rounds=1), "specsplit_ref": Answer([2], 1.0, rounds=1)}
    row = R.make_row(0, "p", 1, answers, greedy=False)
    assert "identical_to_ref" not in row and "identical_to_ref" not in R.summarize([row])


def test_options_are_absolute_and_go_together(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = Q.parse(["--systems", "target,specsplit,specsplit_ref", "--ref-source", "before",
                    "--record-trace", "runs/trace.jsonl"])
    assert args.ref_source == str(tmp_path / "before") and args.record_trace == str(tmp_path / "runs/trace.jsonl")
    assert Q.check_systems(args) == ["target", "specsplit", "specsplit_ref"]
    assert Q.fleet_env(args, None)[Q.TRACE_ENV] == str(tmp_path / "runs/trace.jsonl")
    assert Q.TRACE_ENV not in Q.fleet_env(Q.parse([]), None)
    for argv in (["--systems", "specsplit_ref"], ["--systems", "specsplit", "--ref-source", "before"]):
        with pytest.raises(SystemExit, match="go together"):
            Q.check_systems(Q.parse(argv))


def test_the_ref_fleet_runs_the_checkout_and_records_no_trace(tmp_path, monkeypatch):
    """Both fleets built (not started): the same settings; the ref's imports come from the
    checkout, and neither --record-trace nor a trace file the shell sets reaches it."""
    monkeypatch.setenv(Q.TRACE_ENV, "/tmp/from-the-shell.jsonl")
    ref = fake_checkout(tmp_path / "before")
    args = Q.parse(["--systems", "specsplit,specsplit_ref", "--ref-source", str(ref),
                    "--record-trace", str(tmp_path / "t" / "trace.jsonl")])
    fleets = Q.create_fleets(args, SimpleNamespace(preset="tiny"), Q.check_systems(args), tmp_path / "logs")
    new, old = fleets["specsplit"], fleets["specsplit_ref"]
    assert not new.procs and not old.procs
    assert new.env[Q.TRACE_ENV] == str(tmp_path / "t" / "trace.jsonl") and (tmp_path / "t").is_dir()
    assert Q.TRACE_ENV not in old.env and old.env["PYTHONPATH"].split(os.pathsep)[0] == str(ref)
    assert "PYTHONPATH" not in Q.fleet_env(args, None)
    same = {k for k in Q.fleet_env(args, None) if k != Q.TRACE_ENV}
    assert {k: new.env[k] for k in same} == {k: old.env[k] for k in same}
    assert new.tmp != old.tmp and not set(new.ports.values()) & set(old.ports.values())


def test_the_import_check_catches_a_checkout_the_fleet_would_not_run(tmp_path):
    # a directory holding specsplit only: schemas and brokers would come from this repository
    partial = fake_checkout(tmp_path / "partial", ("specsplit",))
    with pytest.raises(SystemExit, match=r"schemas from .*(?s:.*)brokers from"):
        require_checkout(partial, os.environ | checkout_env(partial))
    # a whole checkout, but started in this repository without PYTHONSAFEPATH: `python -m` puts
    # the current directory first, so this repository's code would run
    ref = fake_checkout(tmp_path / "ref")
    with pytest.raises(SystemExit, match="specsplit from " + str(REPO)):
        require_checkout(ref, os.environ | {"PYTHONPATH": str(ref)}, cwd=str(REPO))
    found = require_checkout(ref, os.environ | checkout_env(ref), cwd=str(REPO))
    assert found == {p: str(ref / p / "__init__.py") for p in ("specsplit", "schemas", "brokers")}
