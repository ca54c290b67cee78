"""A proposer added as one file plus its registration (``repeat_line``) runs end to end through
the fleet's processes: SPECSPLIT_PROPOSERS turns it on, its nodes are verified (round traces
name their source), and the output is still the target's greedy decoding (tiny preset, fp32)."""

from __future__ import annotations

import asyncio
import json

import pytest

from specsplit.launch import Fleet, generate_all
from tests.conftest import greedy_cached
from tests.test_specpv_fleet import target_model, tiny_paths  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.system, pytest.mark.slow]


def test_repeat_line_proposer_through_the_fleet_with_round_traces(tmp_path, tiny_paths, target_model):
    from transformers import AutoTokenizer

    from specsplit.proposers.repeat_line import line_break_ids

    breaks = sorted(line_break_ids(AutoTokenizer.from_pretrained(tiny_paths["target"])))
    assert breaks, "the tiny tokenizer has line-break tokens"
    nl = breaks[0]
    # prompts made of lines that repeat, each ending with a line break: the proposer offers the
    # whole previous line at round 0 (and whatever the target's own lines repeat later)
    prompts = [[11, 12, 13, nl] * 3, [20, 30, 31, 32, nl] * 2 + [20, 30], [40, 41, nl, 40, 41, nl]]
    trace = tmp_path / "trace.jsonl"
    fleet = Fleet.create(tmp_path, SPECSPLIT_PROPOSERS="draft,repeat_line", SPECSPLIT_TRACE_FILE=str(trace),
                         SPECSPLIT_RPC_TIMEOUT_S=20)
    fleet.start(drafts=1, targets=1)
    try:
        fleet.wait_ready(drafts=1, targets=1)
        results = asyncio.run(asyncio.wait_for(generate_all(fleet.orchestrator, prompts, 24), 300))
    finally:
        fleet.stop()
    for p, r in zip(prompts, results):
        assert r.token_ids == greedy_cached(target_model, p, 24)[0]
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    header = lines[0]
    assert header["kind"] == "header" and header["proposers"] == ["draft", "repeat_line"]
    rounds_ = [x for x in lines if x["kind"] == "round"]
    sessions = [x for x in lines if x["kind"] == "session"]
    assert len(sessions) == len(prompts) and sum(s["rounds"] for s in sessions) == len(rounds_)
    assert {tuple(s["output"]) for s in sessions} == {tuple(r.token_ids) for r in results}
    sourced = [(r, node) for r in rounds_ for node in r["merged"]["sources"] if node[1] == "repeat_line"]
    assert sourced, "repeat_line proposed nodes"
    # its round-0 chain is the previous line, hung under the root (after the draft's nodes)
    first = next(r for r in rounds_ if r["round"] == 0 and r["merged"]["sources"])
    merged = first["merged"]
    chain = [merged["token_ids"][i] for i, name, _ in merged["sources"] if name == "repeat_line"]
    assert chain and (chain[-1] == nl or len(chain) == 8)
    for r in rounds_:  # what was verified is what the cost model chose from the merged tree
        if r["chosen"] is not None:
            assert r["verified_nodes"] == len(r["chosen"]) and r["chosen"][0] == 0
    for r in rounds_:  # the wall's parts on the orchestrator's clock hold the engines' own times
        assert r["propose_ms"] >= r["draft_ms"] and r["verify_rpc_ms"] >= r["verify_ms"] > 0
        assert r["wall_ms"] >= r["propose_ms"] + r["verify_rpc_ms"]
