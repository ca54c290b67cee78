"""``specsplit bench api`` on the tiny preset, end to end through the ``specsplit`` command: a fleet
started by ``honcho start`` (the API included), the same HumanEval prompts through the HTTP API
(openai's client, streaming) and the producer client at two concurrencies; the JSON holds every
figure the table shows, the greedy answers agree, the fleet is gone afterwards. The rows' arithmetic
is checked on made-up answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specsplit.bench.api_report import Answer, Pass, make_row, markdown, merge, summarize
from specsplit.launch import port_is_free

DOOR_KEYS = {"tok_s", "new_tokens", "wall_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
             "e2e_p50_s", "e2e_p99_s", "failed", "passes_tok_s"}
ROW_KEYS = {"concurrency", "sessions", "order", "api", "producer", "tpot_ratio_p50", "tpot_ratio_p99",
            "ttft_ratio_p50", "tok_s_ratio", "identical", "same_token_counts", "same_prompt_tokens", "requests"}


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_api_tiny_end_to_end(tmp_path):
    out = tmp_path / "api.json"
    proc = subprocess.run([sys.executable, "-m", "specsplit", "bench", "api", "--preset", "tiny",
                           "--concurrency", "1,2", "--prompts", "4", "--max-new-tokens", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert ROW_KEYS <= set(r) and r["sessions"] == 4 and len(r["requests"]) == 4
        for door in ("api", "producer"):
            d = r[door]
            assert DOOR_KEYS <= set(d) and d["failed"] == 0
            assert d["tok_s"] > 0 and d["new_tokens"] == 4 * 8  # random weights never reach the end token early
            assert 0 < d["ttft_p50_ms"] <= d["ttft_p99_ms"] and 0 < d["tpot_p50_ms"] <= d["tpot_p99_ms"]
        assert r["producer"]["first_token_p50_ms"] > 0
        assert r["tpot_ratio_p50"] == round(r["api"]["tpot_p50_ms"] / r["producer"]["tpot_p50_ms"], 3)
        # greedy: the same answers through both doors, from the same prompt ids
        assert r["identical"] == r["same_token_counts"] == r["same_prompt_tokens"] == 4
        assert all(q["api_tokens"] == q["producer_tokens"] == 8 and q["identical"] for q in r["requests"])
    assert data["summary"]["identical"] == "8/8" and data["summary"]["all_identical"] and data["summary"]["failed"] == 0
    # A B A per level, the first door alternating; each pass on a fresh orchestrator
    assert [r["order"] for r in rows] == [["api", "producer", "api"], ["producer", "api", "producer"]]
    assert [(len(r["api"]["passes_tok_s"]), len(r["producer"]["passes_tok_s"])) for r in rows] == [(2, 1), (1, 2)]
    config = data["config"]
    assert config["orchestrator_restarts"] == 6 and config["endpoint"] == "chat" and config["model"] == "tiny-v1"
    assert config["preset"] == "tiny" and config["distinct_prompts"] == 4 and len(config["prompt_tokens"]) == 4
    assert config["cpu_count"] >= 1 and config["cpu_model"] is not None and config["commit"] is not None
    assert {"machine", "python", "date", "load_avg_before", "load_avg_after"} <= set(config)
    assert "| concurrency | TTFT p50 / p99 ms, API |" in proc.stdout
    assert out.with_suffix(".png").stat().st_size > 1000
    # the fleet was stopped: nothing listens on its API port or its orchestrator's any more
    settings = config["fleet_settings"]
    assert port_is_free(int(settings["SPECSPLIT_API_PORT"]))
    assert port_is_free(int(settings["SPECSPLIT_ORCHESTRATOR"].rsplit(":", 1)[1]))


def _answer(i: int, first: float, end: float, tokens: int = 5, text: str = "abc", **kw) -> Answer:
    return Answer(i, text, tokens, first, end, chunks=2, finish_reason="length", prompt_tokens=7, **kw)


def test_time_per_output_token_counts_the_tokens_after_the_first():
    assert _answer(0, 0.1, 0.5).tpot_s == pytest.approx(0.1)  # 4 tokens after the first in 0.4 s
    assert _answer(0, 0.1, 0.1, tokens=1).tpot_s is None and _answer(0, None, 0.5).tpot_s is None


def test_passes_merge_to_mean_times_and_mark_what_was_not_reproduced():
    a = Pass([_answer(0, 0.1, 0.5), _answer(1, 0.2, 0.6)], wall_s=1.0)
    b = Pass([_answer(0, 0.3, 0.9), _answer(1, 0.2, 0.6, text="abd")], wall_s=3.0)
    m = merge([a, b])
    assert m[0].first_s == pytest.approx(0.2) and m[0].end_s == pytest.approx(0.7) and m[0].reproduced
    assert not m[1].reproduced
    failed = merge([a, Pass([Answer(0, error="TimeoutError: x"), _answer(1, 0.2, 0.6)], 2.0)])
    assert failed[0].error == "TimeoutError: x" and failed[1].reproduced


def test_row_ratios_identity_and_table():
    api = [Pass([_answer(0, 0.2, 0.6), _answer(1, 0.2, 1.0)], wall_s=2.0)]
    producer = [Pass([_answer(0, 0.1, 0.3), _answer(1, 0.1, 0.5, text="xyz")], wall_s=1.0)]
    row = make_row(4, ["api", "producer"], api, producer)
    assert row["api"]["tok_s"] == 5.0 and row["producer"]["tok_s"] == 10.0 and row["tok_s_ratio"] == 0.5
    assert row["api"]["tpot_p50_ms"] == 150.0 and row["producer"]["tpot_p50_ms"] == 75.0  # medians of 100/200, 50/100
    assert row["tpot_ratio_p50"] == 2.0 and row["ttft_ratio_p50"] == 2.0
    assert row["identical"] == 1 and row["same_token_counts"] == 2 and row["same_prompt_tokens"] == 2
    assert [q["identical"] for q in row["requests"]] == [True, False]
    summary = summarize([row])
    assert summary["identical"] == "1/2" and not summary["all_identical"] and summary["tpot_ratio_p50"] == {"4": 2.0}
    table = markdown([row])
    assert "| 4 | 200.0 / 200.0 | 100.0 / 100.0 | 150.0 / 199.0 | 75.0 / 99.5 | 5.00 | 10.00 | 2.00x (2.00x) | 1/2 |" \
        in table
