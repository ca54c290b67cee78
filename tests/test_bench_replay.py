"""``specsplit bench replay`` on the tiny preset: synthetic traces replay through the real target
engine at the recorded context lengths and tree shapes, following the recorded acceptance
whatever the engine's own verdict; malformed traces fail with a clear message."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from schemas import VerifyRequest
from specsplit.bench import replay, replay_report, replayer
from specsplit.orchestrator.replay import TraceError

BRANCHY = [-1, 0, 0, 1, 1, 2, 3]  # merged: root -> {1, 2}, 1 -> {3, 4}, 2 -> 5, 3 -> 6


def round_line(sid: str, rnd: int, context_len: int, accepted: list[int], *, parents=BRANCHY, chosen=None,
               prompt_len: int = 20, sync: int = 0, clean: bool = True) -> dict:
    n = len(parents)
    verified = n if chosen is None else len(chosen)
    return {"kind": "round", "session": sid, "round": rnd, "prompt_len": prompt_len, "context_len": context_len,
            "sync_tokens": sync, "greedy": True, "plain": False, "confirm": False, "partial": False,
            "merged": {"token_ids": list(range(5, 5 + n)), "parents": parents, "draft_logprobs": [], "sources": []},
            "drafted_nodes": n, "chosen": chosen, "verified_nodes": verified, "accepted_nodes": accepted,
            "accepted_token_ids": [0] * len(accepted), "bonus_token_id": 1, "draft_ms": 10.0, "verify_ms": 20.0,
            "wall_ms": 35.0, "batch_size": 1, "batch_tokens": sync + verified, "clean": clean}


def session_lines(sid: str, prompt_len: int, plan: list[tuple[list[int], list[int] | None]]) -> list[dict]:
    """Round 0 (the prompt's prefill round) then one round per (accepted_nodes, chosen) of ``plan``."""
    lines, ctx = [round_line(sid, 0, prompt_len, [], prompt_len=prompt_len, sync=prompt_len - 1, clean=False,
                             parents=[-1, 0], chosen=None)], prompt_len + 1
    for rnd, (accepted, chosen) in enumerate(plan, 1):
        lines.append(round_line(sid, rnd, ctx, accepted, chosen=chosen, prompt_len=prompt_len))
        ctx += len(accepted) + 1
    return lines + [{"kind": "session", "session": sid, "prompt_len": prompt_len, "greedy": True, "output": []}]


def write_trace(path, lines: list[dict]) -> str:
    header = {"kind": "header", "version": 1}
    path.write_text("".join(json.dumps(x) + "\n" for x in [header, *lines]))
    return str(path)


PLAN_A = [([1, 3, 6], None), ([], None), ([2, 5], None), ([1], [0, 1, 2, 3])]
PLAN_B = [([2], None), ([1, 4], None), ([], [0, 1])]


@pytest.fixture
def trace(tmp_path) -> str:
    return write_trace(tmp_path / "trace.jsonl", session_lines("a", 20, PLAN_A) + session_lines("b", 33, PLAN_B))


@pytest.fixture(scope="module")
def engine():
    args = argparse.Namespace(preset="tiny", device="cpu", dtype=None, threads=1, target_config=None,
                              random_weights=False)
    engine, described = replay.build_target(args)
    assert described["weights"] == "real"  # the tiny preset's own (seeded) weights
    return engine


class Spy:
    """The engine, with every verify request and its reply's cache length kept."""

    def __init__(self, engine) -> None:
        self.engine, self.sent = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def handle(self, msg):
        reply = self.engine.handle(msg)
        if isinstance(msg, VerifyRequest):
            self.sent.append((msg, reply))
        return reply


def timed_requests(spy: Spy, sid: str) -> list[VerifyRequest]:
    """The session's requests whose tree is not a lone root (the replayed rounds with a tree)."""
    return [m for m, _ in spy.sent if m.session_id == sid and m.tree.num_nodes > 1]


@pytest.mark.parametrize("agreeing", [False, True], ids=["engine-accepts-less", "engine-accepts-more"])
def test_replay_follows_the_recorded_progression(trace, engine, monkeypatch, agreeing):
    sessions = replay.traced_sessions(trace, replay.read_trace(trace))
    assert [(s.session, s.prompt_len, len(s.rounds)) for s in sessions] == [("a", 20, 5), ("b", 33, 4)]
    spy = Spy(engine)
    player = replay.Replayer(spy, seed=1)
    head = engine.model.get_output_embeddings()
    if agreeing:  # every logit 0: the target's argmax is token 0, so trees of zeros are accepted whole
        monkeypatch.setattr(head.weight, "data", head.weight.data.clone().zero_())
        monkeypatch.setattr(player, "tokens", lambda n: [0] * n)
    rounds, alone = replay.run(player, sessions, warmup_rounds=2)
    for s in sessions:
        got = [r for r in rounds if r.session == s.session]
        assert [(r.round, r.context_len, r.nodes, r.accepted) for r in got] == \
            [(t.round, t.context_len, len(t.parents), t.accepted) for t in s.rounds]
        # each timed tree's root sat at the recorded context: the sync left context_len - 1 tokens
        timed = timed_requests(spy, s.session)
        assert [m.sync.base_len + len(m.sync.append_token_ids) for m in timed] == \
            [t.context_len - 1 for t in s.rounds if len(t.parents) > 1]
        clean = [t for t in s.rounds if t.clean]
        assert sorted(a.context_len for a in alone if a.session == s.session) == \
            [c for t in clean for c in range(t.context_len, t.context_len + t.committed)]
    if agreeing:
        assert any(r.engine_accepted > r.accepted for r in rounds) and not any(r.catchup_tokens for r in rounds)
    else:
        assert any(r.catchup_tokens for r in rounds)
    summary = replay_report.summarize(rounds, alone)
    assert summary["tokens"] == summary["alone_tokens"] == sum(len(a) + 1 for plan in (PLAN_A, PLAN_B)
                                                                for a, _ in plan)
    assert summary["other_rounds"] == 2 and summary["verify_only_tok_s"] > summary["with_draft_tok_s"] > 0


def test_a_branching_shape_is_verified_as_recorded(trace, engine):
    sessions = replay.traced_sessions(trace, replay.read_trace(trace))
    spy = Spy(engine)
    replay.run(replay.Replayer(spy), sessions[:1], warmup_rounds=0)
    trees = [m.tree.parents for m in timed_requests(spy, "a")]
    assert trees[1] == BRANCHY  # a tree, not a chain: the root has two children
    assert trees[-1] == [-1, 0, 0, 1]  # merged's chosen nodes 0..3, re-indexed


def test_main_writes_the_json(trace, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # main sets the worker's default; keep it test-local
    out = tmp_path / "replay.json"
    assert replay.main(["--trace", trace, "--preset", "tiny", "--device", "cpu", "--threads", "1",
                        "--max-rounds", "7", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["weights"] == "real" and data["config"]["backend"]["backend"] == "cpu"
    s = data["summary"][trace]
    for key in ("rounds", "tokens", "verify_only_tok_s", "with_draft_tok_s", "alone_tok_s", "verify_only_vs_alone",
                "with_draft_vs_alone", "paired_median_vs_alone", "recorded_tok_s", "recorded_draft_ms",
                "catchup_rounds"):
        assert key in s
    assert s["rounds"] == 5 and len(data["rounds"]) == 7  # 5 + 2 of b: the first 7 rounds in file order
    assert {row["nodes"] for row in data["by_nodes"]} == {7, 4, 1}
    assert "verify-only tok/s" in capsys.readouterr().out


def test_the_draft_replays_each_clean_round_at_its_context(trace, tmp_path, monkeypatch):
    """``--draft``: the draft engine serves one timed request per clean round, at the round's
    context, for a tree of the recorded merged tree's size and depth (the trace header's branch);
    its ms join the summary as "with replayed draft"."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    sent, real = [], replay.Replayer._draft

    def spy(self, sid, base, append, spec):
        sent.append((sid, base + append + 1, spec))
        return real(self, sid, base, append, spec)

    monkeypatch.setattr(replay.Replayer, "_draft", spy)
    out = tmp_path / "replay.json"
    assert replay.main(["--trace", trace, "--preset", "tiny", "--device", "cpu", "--threads", "1", "--draft",
                        "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    timed = [(sid, ctx, spec) for sid, ctx, spec in sent if spec.max_nodes > 1 and sid != "warmup"]
    clean = [r for r in data["rounds"] if r["clean"]]
    assert len(timed) == len(clean) == 7 and all(r["draft_ms"] > 0 for r in clean)
    assert [ctx for _, ctx, _ in timed] == [r["context_len"] for r in clean]  # the draft's cache then holds it
    assert all((spec.max_nodes, spec.max_depth, spec.branch, spec.min_path_prob) == (7, 3, 2, 0.0)
               for _, _, spec in timed)
    s = data["summary"][trace]
    assert s["replayed_draft_ms"] == pytest.approx(sum(r["draft_ms"] for r in clean), abs=0.01)
    assert 0 < s["with_replayed_draft_tok_s"] < s["verify_only_tok_s"]
    # growth after every draft (0.9 of the verify); a round's draft waits for what outlasts it
    assert all(r["grow_ms"] is not None and r["grow_ms"] >= 0 for r in clean)
    want, before = 0.0, None
    for r in data["rounds"]:
        if r["clean"]:
            follows = before is not None and (before["session"], before["round"]) == (r["session"], r["round"] - 1)
            want += r["draft_ms"] + (max(0.0, before["grow_ms"] - before["verify_ms"])
                                     if follows and before["grow_ms"] is not None else 0.0)
        before = r
    assert s["grown_draft_ms"] == pytest.approx(want, abs=0.01)
    assert s["rerooted_rounds"] == s["recorded_reused_rounds"] == 0  # no round of this trace re-rooted
    assert data["config"]["draft"]["weights"] == "real"


def test_a_round_the_trace_re_rooted_re_roots_the_replayed_growth(tmp_path, monkeypatch):
    """A round recorded as re-rooting a grown tree: the replayed draft grows its tree after the
    round before (as the fleet does while the target verifies) and the timed request follows a
    forwarded path of it, so the draft engine re-roots (no draft from scratch); the rounds the
    trace drafted from scratch draft from scratch."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    # a tiny draft's forward costs what a tiny target's verify does: a budget of 0.9 verify may
    # not fit one forward, and then there is nothing to re-root at (which the replay reports)
    monkeypatch.setattr(replayer, "GROW_FRACTION", 50.0)
    lines = session_lines("a", 20, PLAN_A)
    for line in lines[2:5]:  # rounds 2-4 re-rooted in the trace
        line["reused"] = 3
    path = write_trace(tmp_path / "grown.jsonl", lines)
    out = tmp_path / "replay.json"
    assert replay.main(["--trace", path, "--preset", "tiny", "--device", "cpu", "--threads", "1", "--draft",
                        "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    by_round = {r["round"]: r for r in data["rounds"]}
    assert not by_round[1]["rerooted"] and all(by_round[k]["rerooted"] for k in (2, 3, 4))
    s = data["summary"][path]
    assert s["rerooted_rounds"] == s["recorded_reused_rounds"] == 3 and s["rerooted"] == "3 (3)"


def test_max_seconds_stops_starting_rounds_and_still_reports(trace, tmp_path, monkeypatch):
    """``--max-seconds``: past it no round starts (after the first few), and the figures of the
    rounds replayed are written, as a run under an outer time limit needs."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    out = tmp_path / "replay.json"
    assert replay.main(["--trace", trace, "--preset", "tiny", "--device", "cpu", "--threads", "1",
                        "--max-seconds", "0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["rounds"]) == replay.MIN_ROUNDS  # of the trace's 9
    assert data["summary"][trace]["rounds"] == replay.MIN_ROUNDS - 1  # the prefill round is not clean


def test_a_grown_tree_s_draft_overlaps_the_verify_before_it():
    """"Grown during verify": a round whose tree was grown during the previous round's verify
    adds only the draft ms that outlast that verify; other rounds, and a reused round whose
    previous round is not the one replayed before it, add their whole draft."""
    def made(rnd, verify, draft, reused, clean=True, session="a"):
        return replay.ReplayedRound("t", session, rnd, 10, 3, 0, 1, 1, 0, verify, verify, 0.0, 0.0, 0.0, clean, 1,
                                    draft, reused)

    rounds = [made(0, 50.0, None, 0, clean=False), made(1, 20.0, 30.0, 0), made(2, 20.0, 30.0, 2),
              made(3, 25.0, 10.0, 1), made(1, 20.0, 5.0, 3, session="b"), made(3, 20.0, 7.0, 1, session="b")]
    assert replay_report.grown_draft_ms(rounds) == 30 + 10 + 0 + 5 + 7
    s = replay_report.summarize(rounds, [])
    assert s["replayed_draft_ms"] == 82 and s["grown_draft_ms"] == 52
    assert s["grown_during_verify_tok_s"] == pytest.approx(1e3 * 10 / (105 + 52), abs=1e-3)
    # replayed growth (grow_ms): the next round's draft waits for what of it outlasts the verify
    grown = [replay.ReplayedRound("t", "a", k, 10, 3, 0, 1, 1, 0, 20.0, 20.0, 0.0, 0.0, 0.0, True, 1, draft, 0,
                                  grow, False) for k, draft, grow in ((1, 30.0, 25.0), (2, 2.0, 10.0), (3, 3.0, None))]
    assert replay_report.grown_draft_ms(grown) == 30 + (5 + 2) + (0 + 3)
    # a round that re-rooted growth that ended within the verify before it: the orchestrator
    # re-roots the tree itself (the draft's request beside the verify); after an overrun it waits
    rerooted = [dataclasses.replace(r, rerooted=True) if r.round > 1 else r for r in grown]
    assert replay_report.grown_draft_ms(rerooted) == 30 + (5 + 2) + 0
    assert replay_report.grown_draft_ms(rerooted, local=False) == 30 + (5 + 2) + (0 + 3)


@pytest.mark.parametrize("corrupt, message", [
    (lambda lines: lines[1].pop("merged"), "missing field 'merged'"),
    (lambda lines: lines[2].update(context_len=lines[2]["context_len"] + 1), "expected 25"),
    (lambda lines: lines[1].update(chosen=[0, 3], verified_nodes=2), "without its parent"),
    (lambda lines: lines[1].update(accepted_nodes=[2, 3]), "no root-side path"),
])
def test_a_malformed_trace_is_a_clear_error(tmp_path, capsys, corrupt, message):
    lines = session_lines("a", 20, PLAN_A)
    corrupt(lines)
    path = write_trace(tmp_path / "bad.jsonl", lines)
    with pytest.raises(TraceError, match=message):
        replay.traced_sessions(path, replay.read_trace(path))
    assert replay.main(["--trace", path, "--preset", "tiny", "--device", "cpu"]) == 1
    assert message in capsys.readouterr().err


def test_a_line_that_is_not_json_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"kind": "header"}\n{"kind": "round", oops\n{"kind": "session"}\n')
    assert replay.main(["--trace", str(path)]) == 1
    assert "bad.jsonl:2" in capsys.readouterr().err
