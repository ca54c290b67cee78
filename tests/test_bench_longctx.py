"""``specsplit bench longctx`` on the tiny preset with small contexts: real stdlib text, every
mode runs, the JSON holds the figures, and exact mode's tokens equal full verification's."""

from __future__ import annotations

import json

import pytest

from specsplit.bench import longctx


def test_stdlib_prompts_end_with_the_task():
    class Chars:  # a tokenizer of one id per character, enough to check the assembly
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    prompts = longctx.long_prompts(Chars(), [300, 900])
    task = [ord(c) for c in longctx.TASK]
    for n, ids in prompts.items():
        assert len(ids) == n and ids[-len(task):] == task
    assert "".join(map(chr, prompts[900])).count("\n") > 10  # real source lines


@pytest.mark.slow
def test_bench_longctx_smoke(tmp_path, capsys):
    out = tmp_path / "longctx.json"
    rc = longctx.main(["--preset", "tiny", "--contexts", "640,1280", "--threshold", "512", "--block-size", "16",
                       "--sink-blocks", "1", "--retrieval-blocks", "8", "--window-blocks", "2",
                       "--buffer-tokens", "64", "--max-new-tokens", "24", "--threads", "1", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {(r["context"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {(c, m) for c in (640, 1280) for m in longctx.MODES}
    for (c, mode), r in rows.items():
        assert r["new_tokens"] == 24 and r["tok_s"] > 0 and r["verify_ms_per_round"] > 0
        if mode == "exact":
            assert r["identical_to_full"] and r["same_as_full"] == 1.0
        if mode == "approx":
            assert 0.0 <= r["same_as_full"] <= 1.0
    assert rows[(1280, "approx")]["partial_rounds"] > 0
    for c in (640, 1280):  # the first mode prefills; the others keep its cache and count its time
        assert not rows[(c, "full")]["prefill_reused"]
        assert rows[(c, "approx")]["prefill_reused"] and rows[(c, "exact")]["prefill_reused"]
        assert rows[(c, "exact")]["prefill_ms"] == rows[(c, "full")]["prefill_ms"]
    assert "full_verify_growth" in data["summary"] and "exact_speedup_at_1280" in data["summary"]
    assert (data["config"]["tree_budget"], data["config"]["lookup_max_tokens"]) == ("fixed", 0)
    assert "| context | mode |" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_longctx_drafts_with_a_cost_model_and_prompt_lookup_on_request(tmp_path):
    """As the fleet's defaults draft: exact mode still equals full verification."""
    out = tmp_path / "longctx.json"
    assert longctx.main(["--preset", "tiny", "--contexts", "1280", "--threshold", "512", "--sink-blocks", "1",
                         "--retrieval-blocks", "8", "--window-blocks", "2", "--buffer-tokens", "64",
                         "--max-new-tokens", "24", "--threads", "1", "--tree-budget", "cost",
                         "--lookup-max-tokens", "8", "--tree", "16,10,2,0.3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert (data["config"]["tree_budget"], data["config"]["lookup_max_tokens"]) == ("cost", 8)
    assert rows["exact"]["identical_to_full"] and rows["approx"]["partial_rounds"] > 0


def test_bench_longctx_leaves_the_environment_alone(tmp_path, monkeypatch):
    """It runs inside pytest: settings it applies must not leak into fleets started later."""
    import os

    def ours():
        return {k: v for k, v in os.environ.items() if k.startswith("SPECSPLIT_")}

    for name in ("SPECSPLIT_DRAFT_QUANTIZE", "SPECSPLIT_TARGET_QUANTIZE"):  # whatever ran before
        monkeypatch.delenv(name, raising=False)
    before = ours()
    assert longctx.main(["--preset", "tiny", "--contexts", "640", "--threshold", "512", "--max-new-tokens", "4",
                         "--modes", "full", "--json", str(tmp_path / "x.json")]) == 0
    assert ours() == before
