"""``specsplit bench chat`` on the tiny preset, end to end through the ``specsplit`` command: two
fleets started by ``honcho start``, one without a prefix cache, conversations of three turns
through the HTTP API (openai's client, streaming) to both; the greedy answers agree, the cached
fleet's target copies the earlier turns' K/V (its metrics say how many tokens) and the other's
copies none; both fleets are gone afterwards. The rows' arithmetic is checked on made-up
records."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specsplit.bench.chat import markdown, rows_of
from specsplit.launch import port_is_free


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_chat_tiny_end_to_end(tmp_path):
    out = tmp_path / "chat.json"
    proc = subprocess.run([sys.executable, "-m", "specsplit", "bench", "chat", "--preset", "tiny", "--conversations",
                           "2", "--turns", "3", "--max-new-tokens", "16", "--json", str(out)],
                          capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    records, rows = data["records"], data["rows"]
    assert len(records) == 6 and all(r["identical"] for r in records) and data["summary"]["failed"] == 0
    for r in records:
        assert r["off"]["text"] == r["on"]["text"] and r["off"]["completion_tokens"] == 16
        assert r["off"]["prompt_tokens"] == r["on"]["prompt_tokens"]
        assert r["off"]["prefix_hit_tokens"] == 0  # its workers keep nothing
        # the last turn's context and answer, but its last token, in whole 64-token blocks
        if r["turn"]:
            before = next(q for q in records if q["conversation"] == r["conversation"] and q["turn"] == r["turn"] - 1)
            held = before["on"]["prompt_tokens"] + before["on"]["completion_tokens"] - 1
            assert r["on"]["prefix_hit_tokens"] == held // 64 * 64 > 0
        else:
            assert r["on"]["prefix_hit_tokens"] == 0
        assert 0 < r["on"]["ttft_s"] <= r["on"]["end_s"] and 0 < r["off"]["ttft_s"] <= r["off"]["end_s"]
    assert [r["turn"] for r in rows] == [1, 2, 3] and all(r["identical"] == 2 for r in rows)
    assert rows[0]["prompt_tokens_mean"] < rows[1]["prompt_tokens_mean"] < rows[2]["prompt_tokens_mean"]
    # the first fleet alternates turn by turn, and conversation by conversation
    assert [r["order"][0] for r in records] == ["off", "on", "off", "on", "off", "on"]
    assert "| turn | prompt tokens | TTFT p50 ms, cache off |" in proc.stdout
    config = data["config"]
    off, on = config["fleet_settings"]["off"], config["fleet_settings"]["on"]
    assert off["SPECSPLIT_TARGET_PREFIX_CACHE_GB"] == off["SPECSPLIT_DRAFT_PREFIX_CACHE_GB"] == "0"
    assert "SPECSPLIT_TARGET_PREFIX_CACHE_GB" not in on and config["commit"] and config["model"] == "tiny-v1"
    for settings in (off, on):  # both fleets were stopped
        assert port_is_free(int(settings["SPECSPLIT_API_PORT"]))
        assert port_is_free(int(settings["SPECSPLIT_ORCHESTRATOR"].rsplit(":", 1)[1]))


def _side(ttft: float, hits: int, text: str = "abc") -> dict:
    return {"text": text, "ttft_s": ttft, "end_s": ttft + 1, "prompt_tokens": 100, "completion_tokens": 5,
            "prefix_hit_tokens": hits}


def test_rows_per_turn():
    records = [
        {"conversation": 0, "turn": 0, "identical": True, "off": _side(0.2, 0), "on": _side(0.4, 0)},
        {"conversation": 1, "turn": 0, "identical": True, "off": _side(0.4, 0), "on": _side(0.4, 0)},
        {"conversation": 0, "turn": 1, "identical": True, "off": _side(1.0, 0), "on": _side(0.25, 64)},
        {"conversation": 1, "turn": 1, "identical": False, "off": _side(1.0, 0), "on": _side(0.5, 128, text="x")},
        {"conversation": 2, "turn": 1, "identical": False, "off": {"error": "TimeoutError: x"}, "on": _side(0.5, 0)},
    ]
    rows = rows_of(records)
    assert rows[0]["ttft_off_p50_ms"] == 300.0 and rows[0]["ttft_on_p50_ms"] == 400.0
    assert rows[0]["ttft_ratio_p50"] == 0.75 and rows[0]["reused_tokens_mean"] == 0.0
    assert rows[1]["conversations"] == 3 and rows[1]["identical"] == 1  # the failed one counts against
    assert rows[1]["ttft_ratios"] == [4.0, 2.0] and rows[1]["reused_tokens_mean"] == 96.0
    assert rows[1]["ttft_ratio_p50"] == round(1000.0 / 375.0, 3)
    assert "| 2 | 100.0 | 1000.0 | 375.0 | 2.67x | 96.0 | 1/3 |" in markdown(rows)
