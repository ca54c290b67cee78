"""``specsplit bench replay --fleet`` on the tiny preset: a trace replayed through real router and
worker processes on loopback (ZeroMQ, the codec, the worker loop), the draft's growth sent beside
each verify; the figures against the target alone; a worker that dies before it serves is a clear
error, and the processes never outlive the replay."""

from __future__ import annotations

import json

import pytest
from test_bench_replay import PLAN_A, PLAN_B, session_lines, write_trace

from specsplit.bench import replay, replay_fleet, replayer


@pytest.fixture
def fleets(monkeypatch):
    """Every ReplayFleet the replay starts (to check their processes once it returns)."""
    started, init = [], replay_fleet.ReplayFleet.__init__

    def spy(self, *args, **kw):
        started.append(self)
        init(self, *args, **kw)

    monkeypatch.setattr(replay_fleet.ReplayFleet, "__init__", spy)
    return started


def test_the_fleet_replays_the_rounds_through_its_processes(tmp_path, monkeypatch, fleets):
    """Every clean round through the routers: the draft's request, then the verify with the growth
    beside it; the target's cache follows the recorded progression (checked on each reply, else the
    replay fails); rounds the trace re-rooted re-root the grown tree; a round's fleet ms holds its
    verify's and its draft's round trips; the target alone's steps through the same router."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(replayer, "GROW_FRACTION", 50.0)  # tiny models: growth that outlasts a verify
    lines = session_lines("a", 20, PLAN_A)
    for line in lines[2:5]:  # rounds 2-4 re-rooted in the trace
        line["reused"] = 3
    path = write_trace(tmp_path / "grown.jsonl", lines + session_lines("b", 33, PLAN_B))
    out = tmp_path / "replay.json"
    assert replay.main(["--trace", path, "--preset", "tiny", "--device", "cpu", "--fleet", "--draft",
                        "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    clean = [r for r in data["rounds"] if r["clean"]]
    assert len(clean) == 7 and len(data["rounds"]) == 9
    for r in clean:
        assert r["fleet_ms"] >= r["wall_ms"] > r["verify_ms"] > 0  # a round trip holds the forward
        assert r["fleet_ms"] > r["wall_ms"] + r["draft_ms"]  # the draft's round trip and the verify's
        assert r["grow_ms"] is not None or r["round"] == 1  # growth from the second round (a verify's ms known)
    by_round = {(r["session"], r["round"]): r for r in data["rounds"]}
    assert all(by_round["a", k]["rerooted"] for k in (2, 3, 4)) and not by_round["a", 1]["rerooted"]
    assert all(a["wall_ms"] >= a["verify_ms"] > 0 for a in data["alone"])
    s = data["summary"][path]
    assert s["fleet_ms"] == pytest.approx(sum(r["fleet_ms"] for r in clean), abs=0.01)
    assert s["fleet_tok_s"] == pytest.approx(1e3 * s["tokens"] / s["fleet_ms"], rel=1e-3)
    assert s["fleet_vs_alone"] == pytest.approx(s["fleet_tok_s"] / s["alone_tok_s"], rel=1e-2)
    assert s["alone_wall_tok_s"] < s["alone_tok_s"]  # the router's round trips cost something
    assert data["config"]["workers"] == ["target", "draft"] and data["config"]["preset"] == "tiny"
    assert [p.poll() is not None for f in fleets for p in f.fleet.procs.values()] == [True] * 4


def test_pair_replays_through_one_worker_process_hosting_both_roles(tmp_path, monkeypatch, fleets):
    """``--fleet --pair``: the same rounds through both routers to one ``specsplit pair`` process
    (both engines, a thread each): the cache follows the recorded progression, the re-rooted rounds
    re-root, and one worker process ran beside the two routers."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(replayer, "GROW_FRACTION", 50.0)
    _, data = grown_replay(tmp_path, "--fleet", "--pair")
    clean = [r for r in data["rounds"] if r["clean"]]
    assert len(clean) == 4 and all(r["fleet_ms"] >= r["wall_ms"] > r["verify_ms"] > 0 for r in clean)
    by_round = {r["round"]: r for r in data["rounds"]}
    assert all(by_round[k]["rerooted"] for k in (2, 3, 4))
    assert "one worker process hosting both roles" in data["config"]["processes"]
    assert sorted(fleets[0].fleet.procs) == ["pair", "router_draft", "router_target"]
    assert all(p.poll() is not None for p in fleets[0].fleet.procs.values())


def test_pair_needs_the_fleet_and_the_draft(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", session_lines("b", 33, PLAN_B))
    assert replay.main(["--trace", path, "--preset", "tiny", "--device", "cpu", "--fleet", "--pair"]) == 1
    assert "--pair" in capsys.readouterr().err


def test_a_worker_that_dies_before_it_serves_is_a_clear_error(tmp_path, capsys, monkeypatch, fleets):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    path = write_trace(tmp_path / "t.jsonl", session_lines("b", 33, PLAN_B))
    missing = tmp_path / "no-model"
    missing.mkdir()
    assert replay.main(["--trace", path, "--preset", "tiny", "--device", "cpu", "--fleet",
                        "--target-config", str(missing), "--max-seconds", "120"]) == 1
    err = capsys.readouterr().err
    assert "exited before it was ready" in err and "config.json" in err  # the worker's own error, from its log
    assert all(p.poll() is not None for f in fleets for p in f.fleet.procs.values())


def grown_replay(tmp_path, *args: str) -> tuple[str, dict]:
    """(trace path, JSON figures) of a replay with ``args`` and the draft over session a, its
    rounds 2-4 recorded as re-rooting a grown tree."""
    lines = session_lines("a", 20, PLAN_A)
    for line in lines[2:5]:
        line["reused"] = 3
    path = write_trace(tmp_path / "grown.jsonl", lines)
    out = tmp_path / "replay.json"
    assert replay.main(["--trace", path, "--preset", "tiny", "--device", "cpu", *args, "--draft",
                        "--json", str(out)]) == 0
    return path, json.loads(out.read_text())


def overlap_replay(tmp_path, *args: str) -> tuple[str, dict]:
    """``grown_replay`` with ``--overlap`` (and the target on one thread)."""
    return grown_replay(tmp_path, "--threads", "1", "--overlap", *args)


def test_overlap_replays_both_engines_in_this_process_on_their_own_threads(tmp_path, monkeypatch):
    """``--overlap``: the same rounds with the target and the draft of this process each served on
    its own thread (on CUDA its own stream), the growth beside the verify: every request of an
    engine runs on that engine's thread, and the figures are the fleet's."""
    import threading

    from specsplit.engine.draft import DraftEngine
    from specsplit.engine.target import TargetEngine

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(replayer, "GROW_FRACTION", 50.0)
    threads: dict[str, set[str]] = {"target": set(), "draft": set()}
    for name, cls in (("target", TargetEngine), ("draft", DraftEngine)):
        real = cls.handle

        def spy(self, msg, real=real, name=name):
            threads[name].add(threading.current_thread().name)
            return real(self, msg)

        monkeypatch.setattr(cls, "handle", spy)
    path, data = overlap_replay(tmp_path)
    clean = [r for r in data["rounds"] if r["clean"]]
    assert len(clean) == 4 and all(r["fleet_ms"] >= r["wall_ms"] >= r["verify_ms"] > 0 for r in clean)
    by_round = {r["round"]: r for r in data["rounds"]}
    assert all(by_round[k]["rerooted"] for k in (2, 3, 4))
    assert [len(t) for t in threads.values()] == [1, 1] and threads["target"] != threads["draft"]
    assert all(t.startswith("replay-") for t in threads["target"] | threads["draft"])
    assert data["config"]["processes"].startswith("one") and "fleet_vs_alone" in data["summary"][path]


def test_overlap_needs_the_draft(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", session_lines("b", 33, PLAN_B))
    assert replay.main(["--trace", path, "--preset", "tiny", "--device", "cpu", "--overlap"]) == 1
    assert "--draft" in capsys.readouterr().err


@pytest.mark.parametrize("draft_reroots", [False, True])
def test_a_round_after_growth_that_answered_first_sends_its_draft_beside_the_verify(tmp_path, monkeypatch,
                                                                                   draft_reroots):
    """Where the growth answered before its verify (a verify slower than the growth: a target
    slowed by 1 s here), the rounds the trace re-rooted re-root the GrowReply's tree in the
    replay, as the orchestrator does: their DraftRequest goes beside the verify and their fleet
    ms is the verify's round trip alone; the draft still re-roots its copy. ``--draft-reroots``
    (SPECSPLIT_GROW_REROOT off): they ask the draft first, as before."""
    import threading
    import time

    from schemas import GrowRequest, VerifyRequest
    from specsplit.engine.draft import DraftEngine
    from specsplit.engine.target import TargetEngine

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    # growth of 10 verifies' engine ms (many tiny draft forwards): a verify slowed by 1 s, which
    # then waits for a growth under way to answer (events, not times: on a loaded box a verify's
    # engine ms, and so the growth's budget, may reach the second; seen in CI)
    monkeypatch.setattr(replayer, "GROW_FRACTION", 10.0)
    real, real_draft = TargetEngine.handle, DraftEngine.handle
    started, answered = threading.Event(), threading.Event()

    def growing(self, msg):
        if not isinstance(msg, GrowRequest):
            return real_draft(self, msg)
        started.set()
        try:
            return real_draft(self, msg)
        finally:
            answered.set()

    def slow(self, msg):
        if isinstance(msg, VerifyRequest) and msg.tree.num_nodes > 1:  # a replayed round's (not a catch-up, alone)
            time.sleep(1.0)
            if started.wait(2.0):  # this round's growth (sent right after the verify): it answers first
                assert answered.wait(60), "the growth never answered"
                time.sleep(0.5)  # its reply is encoded and sent after handle returns (raced once in CI)
            started.clear()
            answered.clear()
        return real(self, msg)

    monkeypatch.setattr(TargetEngine, "handle", slow)
    monkeypatch.setattr(DraftEngine, "handle", growing)
    path, data = overlap_replay(tmp_path, *(["--draft-reroots"] if draft_reroots else []))
    by_round = {r["round"]: r for r in data["rounds"]}
    assert all(by_round[k]["rerooted"] for k in (2, 3, 4)) and not by_round[1]["beside"]
    if draft_reroots:
        assert not any(r["beside"] for r in data["rounds"]) and data["summary"][path]["beside_rounds"] == 0
        assert all(by_round[k]["fleet_ms"] > by_round[k]["wall_ms"] + by_round[k]["draft_ms"] for k in (2, 3, 4))
    else:
        assert all(by_round[k]["beside"] for k in (2, 3, 4)) and data["summary"][path]["beside_rounds"] == 3
        for k in (2, 3, 4):  # the verify's round trip (the growth beside it ended first)
            assert by_round[k]["fleet_ms"] == pytest.approx(by_round[k]["wall_ms"], abs=0.01)
