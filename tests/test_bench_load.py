"""``specsplit bench load`` on the tiny preset, end to end through the ``specsplit`` command: a
real fleet and the in-process batched target on the same HumanEval prompts at two
concurrencies; the JSON holds the rows the issue names, every fleet output equals the batched
target's (greedy, int8 target), and the table and the plot are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specsplit.bench import load
from specsplit.bench.fleetenv import fleet_defaults, read_env_file

ROW_KEYS = {"concurrency", "fleet_tok_s", "target_batched_tok_s", "fleet_p50_latency_s", "fleet_p99_latency_s",
            "mean_tree_nodes", "mean_accepted"}


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_load_tiny_end_to_end(tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "-m", "specsplit", "bench", "load", "--preset", "tiny",
                           "--concurrency", "1,2", "--prompts", "4", "--max-new-tokens", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert r["fleet_tok_s"] > 0 and r["target_batched_tok_s"] > 0
        assert 0 < r["fleet_p50_latency_s"] <= r["fleet_p99_latency_s"]
        assert r["mean_tree_nodes"] >= 1 and r["mean_accepted"] >= 1
        assert r["sessions"] == 4 and len(r["requests"]) == 4
        # the same prompts at each level; greedy on the int8 target: exact under batching
        assert r["identical_to_target_batched"] == 4
        assert r["fleet_new_tokens"] == r["target_batched_new_tokens"] == sum(q["new_tokens"] for q in r["requests"])
    assert data["summary"]["identical_to_target_batched"] == "8/8"
    # A B A per level, the first system alternating: fleet twice at 1, the target twice at 2
    assert [(len(r["fleet_passes_tok_s"]), len(r["target_batched_passes_tok_s"])) for r in rows] == [(2, 1), (1, 2)]
    # the fleet's default kernels (the repository's .env) on both sides
    quantize = os.environ.get("SPECSPLIT_TARGET_QUANTIZE") or fleet_defaults(environ={}).get(
        "SPECSPLIT_TARGET_QUANTIZE", "none")
    assert data["config"]["target_backend"]["quantize"] == quantize
    assert data["config"]["distinct_prompts"] == 4
    # every fleet pass on a fresh orchestrator (nothing memorized from earlier passes): 1 + 3 passes
    assert data["config"]["orchestrators_started"] == 4
    assert "| concurrency | fleet tok/s | target batched tok/s |" in proc.stdout
    assert out.with_suffix(".png").stat().st_size > 1000


def test_batched_target_decodes_greedily_and_recovers_evicted_sessions():
    """The baseline is plain greedy decoding of the target (oracle: full re-forwards, fp32), at
    any concurrency, also when the engine keeps fewer sessions than are decoding (CACHE_MISS:
    the context is resent, as the orchestrator does)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specsplit.config import WorkerSettings
    from specsplit.models import ModelSettings, resolve_model_paths
    from tests.conftest import MARGIN_DEFAULT, greedy_reference

    settings = WorkerSettings(target_quantize="none", worker_max_sessions=2, threads=1, prefill_threads=1)
    tiny = ModelSettings(preset="tiny")
    target = load.BatchedTarget(settings, tiny)
    prompts = [[5 + i, 17, 3 * i + 1, 40, 2] * (i + 1) for i in range(5)]
    one = target.level(prompts, 1, 10, [])
    assert target.resends == 0 and one.forwards == 5 * 10
    four = target.level(prompts, 4, 10, [])
    assert target.resends > 0 and four.forwards < one.forwards
    model = AutoModelForCausalLM.from_pretrained(resolve_model_paths(tiny).target, dtype=torch.float32).eval()
    checked = 0
    for p, a, b in zip(prompts, one.done, four.done):
        ref, gap = greedy_reference(model, p, 10)
        if gap > MARGIN_DEFAULT:  # fp32 batched forwards agree with the oracle up to near-ties
            assert a.token_ids == ref and b.token_ids == ref
            checked += 1
    assert checked >= 3


def test_percentile_and_summary():
    assert load.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert load.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert load.percentile([5.0], 99) == 5.0
    a = load.Level([load.Done(0, [1, 2, 3, 4], 2.0, rounds=2, drafted=10, accepted=2)], wall_s=2.0)
    b = load.Level([load.Done(0, [1, 2, 3, 4], 1.0, rounds=4)], wall_s=1.0)
    row = load.make_row(1, a, b)
    assert row["fleet_tok_s"] == 2.0 and row["target_batched_tok_s"] == 4.0
    assert row["mean_tree_nodes"] == 6.0 and row["mean_accepted"] == 2.0
    assert row["identical_to_target_batched"] == 1 and row["fleet_vs_target_batched"] == 0.5
    assert load.summarize([row])["fleet_at_least_target_batched_everywhere"] is False


def test_env_file_defaults_yield_to_the_shell(tmp_path):
    f = tmp_path / ".env"
    # honcho's parser: quotes hold spaces, an `export` line is skipped
    f.write_text("# comment\nSPECSPLIT_TARGET_QUANTIZE=int8\nSPECSPLIT_X='a b'\nexport SPECSPLIT_Z=1\nSPECSPLIT_Y=1\n")
    assert read_env_file(f) == {"SPECSPLIT_TARGET_QUANTIZE": "int8", "SPECSPLIT_X": "a b", "SPECSPLIT_Y": "1"}
    shell = {"SPECSPLIT_Y": "2"}
    assert fleet_defaults(f, environ=shell) == {"SPECSPLIT_TARGET_QUANTIZE": "int8", "SPECSPLIT_X": "a b"}
    assert fleet_defaults("none", environ={}) == {}


def test_passes_of_a_level_merge_to_their_mean_wall_and_mark_what_was_not_reproduced():
    from specsplit.bench.load import Done, Level, make_row

    def level(wall, tokens, latency):
        return Level([Done(i, t, lat, rounds=4, drafted=6, accepted=3) for i, (t, lat) in enumerate(zip(tokens, latency))],
                     wall, forwards=10)

    a = level(10.0, [[1, 2], [3, 4]], [4.0, 6.0])
    b = level(30.0, [[1, 2], [3, 4]], [8.0, 10.0])
    drifted = level(20.0, [[1, 2], [3, 5]], [6.0, 8.0])  # the second request differs in this pass
    target = level(16.0, [[1, 2], [3, 4]], [5.0, 5.0])
    row = make_row(2, [a, b], target)
    assert row["fleet_tok_s"] == 4 / 20.0 and row["fleet_passes_tok_s"] == [0.4, round(4 / 30.0, 3)]
    assert row["target_batched_passes_tok_s"] == [0.25] and row["fleet_vs_target_batched"] == 0.8
    assert row["fleet_p50_latency_s"] == 7.0 and row["identical_to_target_batched"] == 2
    assert row["fleet_rounds"] == 8  # the first pass's counts, not the passes' sum
    mixed = make_row(2, [a, drifted], target)
    assert mixed["identical_to_target_batched"] == 1
    assert mixed["fleet_tok_s"] == round(4 / 15.0, 3)  # a request not reproduced still produced its tokens
    assert [r["identical"] for r in mixed["requests"]] == [True, False]
    assert make_row(2, a, target)["fleet_tok_s"] == 0.4  # one pass: as before
