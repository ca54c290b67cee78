"""specsplit bench's rows and summary ratios (pure functions, no models)."""

from __future__ import annotations

from specsplit.bench import report as R
from specsplit.bench.systems import Answer


def test_summary_ratios_cover_every_baseline_present():
    rows = []
    for i in range(2):
        answers = {"target": Answer([1, 2, 3, 4], 2.0), "target_packed": Answer([1, 2, 3, 4], 1.0),
                   "assisted": Answer([1, 2, 3, 4], 1.6), "specsplit": Answer([1, 2, 3, 5], 0.5, rounds=2, accepted=2, drafted=8)}
        rows.append(R.make_row(i, "def f():", 3, answers))
    s = R.summarize(rows)
    assert s["totals"]["specsplit"] == {"tokens": 8, "seconds": 1.0, "tok_s": 8.0}
    assert (s["speedup_vs_target"], s["speedup_vs_target_packed"], s["speedup_vs_assisted"]) == (4.0, 2.0, 3.2)
    assert s["mean_accepted"] == 2.0 and s["acceptance_rate"] == 0.25
    assert s["identical_to_target"] == "0/2" and rows[0]["first_divergence"] == 3
    table = R.markdown(rows, s)
    assert "target_packed tok/s" in table and "**8.00**" in table


def test_bench_transport_writes_the_issue_json_keys(tmp_path, capsys):
    """`specsplit bench transport --json FILE` (short run, no fleet): RTT through the router next to
    raw pyzmq over one and two hops, every child process stopped."""
    import json
    import multiprocessing as mp
    import signal

    from specsplit.cli import main

    out = tmp_path / "transport.json"
    handler = signal.getsignal(signal.SIGTERM)
    assert main(["bench", "transport", "--n", "60", "--warmup", "10", "--no-fleet", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("rtt_us", "raw_zmq_rtt_us", "raw_zmq_2hop_rtt_us"):
        assert 0 < result[key]["p50"] <= result[key]["p99"]
    assert result["n"] == 60 and result["body_bytes"] > 0
    assert "rpc client->router->worker" in capsys.readouterr().out
    assert not mp.active_children() and signal.getsignal(signal.SIGTERM) is handler


def test_cost_model_prediction_is_reported_next_to_the_measurement():
    from specsplit.bench import report as R
    from specsplit.bench.systems import Answer

    rows = [R.make_row(i, "p", 5, {"target": Answer([1] * 10, 2.0),
                                   "specsplit": Answer([1] * 10, 1.0, 3, 6, 9, extra={"predicted_tok_s": pred})})
            for i, pred in enumerate((11.0, 20.0))]
    summary = R.summarize(rows)
    assert summary["predicted_within_20pct"] == "1/2"  # 11 vs 10 measured: within; 20 vs 10: not
    assert abs(summary["predicted_tok_s"] - 20 / (10 / 11 + 10 / 20)) < 1e-3
    assert "specsplit predicted" in R.markdown(rows, summary) and rows[0]["specsplit"]["predicted_tok_s"] == 11.0


def test_baselines_load_torch_with_the_default_openmp_wait_and_the_fleet_does_not_inherit_it():
    """The in-process baselines load torch (libgomp reads its environment then) with libgomp's
    default spin; the environment the fleet is started from afterwards is as it was."""
    import os
    import subprocess
    import sys

    code = ("import os, sys; from specsplit.bench import import_torch_as_users_run_it as f; "
            "assert 'torch' not in sys.modules; f(); "
            "print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | {"OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "None", "PASSIVE"]
    # a GOMP_SPINCOUNT the caller chose is theirs: untouched (torch loads later, with it), and the fleet gets it
    out = subprocess.run([sys.executable, "-c", code], env=env | {"GOMP_SPINCOUNT": "7"}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "7", "PASSIVE"]
