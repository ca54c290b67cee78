"""``specsplit bench growth``: the draft's search and growth replayed against a recorded greedy
output (no target): every round judged by the output, growth limited to its forwards, and the
share of rounds that re-rooted a grown tree counted."""

from __future__ import annotations

import gzip
import json
import random

import pytest
import torch

from schemas import TreeSpec
from specsplit.bench import growth
from specsplit.engine.base import EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.orchestrator.costmodel import CostModel
from tests.conftest import greedy_reference, tiny_model

LIMITS = EngineLimits(max_sessions=4, max_session_tokens=512, max_tree_nodes=16, max_tree_depth=8)


def test_a_draft_judged_by_its_own_greedy_output_reuses_its_grown_tree():
    """The draft's own greedy continuation as the output: every round accepts its top path and
    the bonus is the top child of the path's end, which growth may forward (a random model's flat
    distributions spread it): most rounds re-root; with no growth every round drafts after the
    verdict. The output is committed
    exactly, round by round."""
    model = tiny_model("qwen2", seed=13)
    prompt = [random.Random(3).randrange(128) for _ in range(12)]
    output, _ = greedy_reference(model, prompt, 40)
    spec = TreeSpec(max_nodes=6, max_depth=3, branch=2)
    results = {}
    for grow_forwards in (0, 3):
        engine = DraftEngine(model, LIMITS, steps_after_reuse=0, grow_spares=2)
        counted, tally = growth.Counted(engine), growth.Tally(2)
        growth.replay_session(engine, counted, "s", prompt, output, spec, grow_forwards, 4, tally)
        assert engine.store.get("s") is None  # ended
        assert tally.sessions == 1 and 0 < tally.rounds and tally.tokens <= len(output)
        results[grow_forwards] = tally
    grown, bare = results[3], results[0]
    assert grown.reused >= 0.5 * grown.rounds, grown
    assert bare.reused == 0 and bare.after_verdict >= bare.rounds, bare
    assert grown.after_verdict < bare.after_verdict


def test_the_command_reads_prompts_from_session_records_and_writes_its_table(tmp_path, capsys):
    """On the tiny preset: a trace of two greedy sessions (one repeated, as a warm-up repeats a
    prompt; one sampled, which has no single output) replayed for two spare settings."""
    rng = random.Random(5)
    p1, p2 = [rng.randrange(100) for _ in range(9)], [rng.randrange(100) for _ in range(14)]
    lines = [{"kind": "header", "version": 1},
             {"kind": "session", "session": "w", "prompt": p1, "prompt_len": 9, "greedy": True, "output": [5, 6]},
             {"kind": "session", "session": "a", "prompt": p1, "prompt_len": 9, "greedy": True,
              "output": [rng.randrange(100) for _ in range(30)]},
             {"kind": "session", "session": "b", "prompt": p2, "prompt_len": 14, "greedy": True,
              "output": [rng.randrange(100) for _ in range(25)]},
             {"kind": "session", "session": "c", "prompt": p2, "prompt_len": 14, "greedy": False, "output": [1, 2, 3]}]
    trace = tmp_path / "t.jsonl.gz"
    with gzip.open(trace, "wt") as f:
        f.write("\n".join(json.dumps(x) for x in lines) + "\n")
    assert [len(o) for _, o in growth.sessions_of(lines, 8, 20)] == [20, 20]
    out = tmp_path / "g.json"
    assert growth.main(["--trace", str(trace), "--preset", "tiny", "--spares", "0,2", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| spares | chains | rounds |") and sum(ln.startswith("| ") for ln in table.splitlines()) == 3
    data = json.loads(out.read_text())
    assert data["sessions"] == 2 and [r["spares"] for r in data["rows"]] == [0, 2]
    for row in data["rows"]:
        assert row["sessions"] == 2 and row["rounds"] > 0 and 1.0 <= row["tokens_per_round"]
        assert 0.0 <= row["reuse"] <= 1.0 and row["modelled_vs_alone"] > 0


def test_growth_told_the_lookup_chain_re_roots_after_the_target_accepts_it():
    """A prompt that ends with the start of an earlier phrase, an output that goes on with the
    phrase (prompt lookup's chain, which the random draft never drafts) and then with the draft's
    own greedy tokens: the round after the chain is accepted re-roots a grown tree only when
    growth was told the chain (its bonus a forwarded child of the chain's end)."""
    model = tiny_model("llama", seed=21)
    rng = random.Random(8)
    phrase = [rng.randrange(128) for _ in range(12)]
    prompt = [rng.randrange(128) for _ in range(5)] + phrase + [rng.randrange(128) for _ in range(4)] + phrase[:4]
    chain = phrase[4:7]
    rest, _ = greedy_reference(model, prompt + chain, 12)
    output = chain + rest
    spec = TreeSpec(max_nodes=4, max_depth=3, branch=2)
    results = {}
    for chains in (False, True):
        engine = DraftEngine(model, LIMITS, steps_after_reuse=0, grow_spares=2)
        counted, tally = growth.Counted(engine), growth.Tally(2, chains)
        growth.replay_session(engine, counted, "s", prompt, output, spec, 3, 4, tally, lookup=3,
                              cost=CostModel())
        results[chains] = tally
    told, untold = results[True], results[False]
    assert untold.after_chain >= 1 and untold.after_chain_reused == 0, untold
    assert told.after_chain >= 1 and told.after_chain_reused >= 1, told


def test_the_recorded_rounds_are_a_trace_the_device_replay_runs(tmp_path, monkeypatch):
    """``--record-trace``: the replayed rounds as an orchestrator's trace lines (every node
    verified, the accepted path and bonus the output's, the re-rooted rounds marked), which
    ``specsplit bench replay`` reads and runs, draft included, committing what they committed."""
    from specsplit.bench import replay
    from specsplit.orchestrator.replay import read_trace

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    rng = random.Random(6)
    prompt = [rng.randrange(100) for _ in range(10)]
    lines = [{"kind": "header", "version": 1},
             {"kind": "session", "session": "a", "prompt": prompt, "prompt_len": 10, "greedy": True,
              "output": [rng.randrange(100) for _ in range(20)]}]
    src, rec = tmp_path / "fleet.jsonl", tmp_path / "grown.jsonl.gz"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["--trace", str(src), "--preset", "tiny", "--spares", "2", "--chains", "1", "--lookup", "4"]
    with pytest.raises(SystemExit):  # one setting a trace
        growth.main([*args, "--chains", "0,1", "--record-trace", str(rec)])
    assert growth.main([*args, "--record-trace", str(rec)]) == 0
    records = read_trace(rec)
    header, rounds = records[0], [r for r in records if r.get("kind") == "round"]
    assert header["source"] == "specsplit bench growth" and header["tree"]["branch"] == 2
    assert rounds and rounds[0]["context_len"] == 10 and rounds[0]["sync_tokens"] == 9
    for a, b in zip(rounds, rounds[1:]):
        assert b["context_len"] == a["context_len"] + len(a["accepted_nodes"]) + 1 and b["sync_tokens"] == 0
    session = next(r for r in records if r.get("kind") == "session")
    committed = [t for r in rounds for t in [*r["accepted_token_ids"], r["bonus_token_id"]]]
    assert committed == session["output"][: len(committed)]
    out = tmp_path / "replay.json"
    assert replay.main(["--trace", str(rec), "--preset", "tiny", "--device", "cpu", "--threads", "1", "--draft",
                        "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["rounds"]) == len(rounds)
    assert [r["context_len"] for r in data["rounds"]] == [r["context_len"] for r in rounds]


def test_a_trace_without_prompts_is_refused(tmp_path, capsys):
    trace = tmp_path / "old.jsonl"
    trace.write_text(json.dumps({"kind": "session", "session": "a", "greedy": True, "output": [1, 2, 3]}) + "\n")
    assert growth.main(["--trace", str(trace), "--preset", "tiny"]) == 2
    assert "no greedy session with its prompt" in capsys.readouterr().err
    torch.manual_seed(0)  # (nothing loaded: the refusal comes before any model)


def test_a_trace_is_read_by_its_bytes_not_its_name(tmp_path):
    """A fleet writes its trace as plain lines even where ``--record-trace`` names it .gz; a
    compressed copy reads the same."""
    from specsplit.orchestrator.replay import read_trace

    lines = [{"kind": "header", "version": 1}, {"kind": "session", "session": "a", "output": [1, 2]}]
    text = "".join(json.dumps(x) + "\n" for x in lines)
    plain, packed = tmp_path / "fleet.jsonl.gz", tmp_path / "kept.jsonl.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    assert read_trace(plain) == read_trace(packed) == lines
