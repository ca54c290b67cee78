"""The cost model replayed over round traces (``specsplit.orchestrator.replay``).

Unit tests run on synthetic traces built here (sessions with known outputs, merged trees of a
draft chain, a wrong sibling and prompt-lookup chains, through the real ``merge`` and trace
record): the acceptance rule, the machine's cost by forward size, that the replay feeds the model
what ``rounds.learn`` would, and that rules known to be worse score lower.

The regression test replays every recorded trace tests/data/traces/*.jsonl.gz (from the real
model pair) with the default ``CostModel``: its replayed rate must stay within 2 % of the one in
tests/data/traces/expected.json (or beat it), its prediction within 25 % of the replayed rate, its
choices agree with the recorded run's about as often as when the figures were written,
and deliberately worse rules must score clearly lower, so a cost-model change that undoes a
measured speedup fails here. After a deliberate change of the cost model, or new traces,
regenerate expected.json (and say why in the commit):

    .venv/bin/python tests/test_costmodel_replay.py        # write_expected() over every trace
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from schemas import FlatTree, TreeSpec, VerifyReply
from specsplit.orchestrator import rounds
from specsplit.orchestrator.costmodel import Choice, CostModel, chain_sources
from specsplit.orchestrator.replay import (
    ReplayResult, TrueCost, accepted_path, main, merged_tree, read_trace, replay,
)
from specsplit.orchestrator.state import merge, select
from specsplit.orchestrator.trace import tree_record
from specsplit.proposers.base import Proposal

TRACES = Path(__file__).resolve().parent / "data" / "traces"
EXPECTED = TRACES / "expected.json"
JUNK = 1000  # tokens the synthetic drafts get wrong (outputs are ids 100..399)
TREE = {"max_nodes": 16, "max_depth": 4, "branch": 2, "min_path_prob": 0.0}


# ---- rules that are worse than the default, for the replay to tell apart ---------------------------
def _overhead(cost: CostModel, plain: bool) -> float:
    return (cost.plain_overhead_ms if plain else cost.overhead_ms) or 0.0


class RootOnly(CostModel):
    """Never speculates: every round verifies its root alone (worse wherever drafts are right)."""

    def choose(self, tree, sync_tokens, lookup=frozenset(), *, plain=False, cached=None, sources=None, measure=False):
        return Choice([0], 1.0, _overhead(self, plain) + self.verify_ms(sync_tokens + self.load()[0] + 1))


class KeepAll(CostModel):
    """Keeps every node, with the default's expected accounting (worse where a bigger forward
    costs more: unlikely nodes widen it for little)."""

    def choose(self, tree, sync_tokens, lookup=frozenset(), *, plain=False, cached=None, sources=None, measure=False):
        probs = self.node_probs(tree, lookup, cached, sources=sources)
        ms = _overhead(self, plain) + self.verify_ms(sync_tokens + self.load()[0] + tree.num_nodes)
        return Choice(list(range(tree.num_nodes)), sum(probs), ms)


class OneNode(CostModel):
    """Keeps at most the root's likeliest child (worse where nodes cost little: deeper nodes that
    are often right are left out)."""

    def choose(self, tree, sync_tokens, lookup=frozenset(), *, plain=False, cached=None, sources=None, measure=False):
        probs = self.node_probs(tree, lookup, cached, sources=sources)
        children = [i for i in range(1, tree.num_nodes) if tree.parents[i] == 0]
        nodes = [0, max(children, key=lambda i: (probs[i], -i))] if children else [0]
        ms = _overhead(self, plain) + self.verify_ms(sync_tokens + self.load()[0] + len(nodes))
        return Choice(sorted(nodes), sum(probs[i] for i in nodes), ms)


class Uncalibrated(CostModel):
    """Never calibrates: a drafted node's acceptance is the draft's own path probability (an
    overconfident draft keeps unlikely nodes), a chain node's 0.5 at any position. Worse only by
    as much as the draft is miscalibrated, and only where nodes cost."""

    def accept_prob(self, path_prob: float) -> float:
        return path_prob

    def node_probs(self, tree, lookup=frozenset(), cached=None, *, sources=None):
        chain = chain_sources(lookup, cached, sources)
        probs, score = [1.0] * tree.num_nodes, [0.0] * tree.num_nodes
        for i in range(1, tree.num_nodes):
            p = tree.parents[i]
            score[i] = score[p] + (0.0 if i in chain or not tree.draft_logprobs else tree.draft_logprobs[i])
            probs[i] = min(probs[p], 0.5 if i in chain else math.exp(min(0.0, score[i])))
        return probs


class Steeper(CostModel):
    """Prices every token of a forward past the first at 3x its measured cost, with no minimum
    of nodes: keeps too few where nodes pay, by a margin the few nodes near the best choice
    decide (where nodes cost nearly nothing, 3x nearly nothing changes no choice)."""

    def __init__(self) -> None:
        super().__init__(min_nodes=0)

    def verify_ms(self, tokens, explore=None):
        one = super().verify_ms(1, explore)
        return one + 3.0 * (super().verify_ms(tokens, explore) - one)


# clearly worse (MARGIN): never speculating anywhere; keeping everything where nodes cost (a CPU),
# one node where they cost nearly nothing (a GPU). The naive rules come within a few per cent of
# the default on a few hundred rounds, either side of it by the seed of a synthetic trace: only
# their sum over every steep trace is held to the default.
CLEARLY_WORSE = {"root_only": RootOnly, "keep_all": KeepAll, "one_node": OneNode}
NAIVE = {"uncalibrated": Uncalibrated, "steeper": Steeper}
RULES = {"default": CostModel, **CLEARLY_WORSE, **NAIVE}


# ---- synthetic traces -------------------------------------------------------------------------------
def cpu_verify(tokens: int) -> float:
    """A steep verify line (a CPU); dyadic values, so the replay's sums are exact."""
    return 8.0 + 4.0 * tokens


def draft_tree(rng: random.Random, root: int, future: list[int], depth: int, right: float) -> FlatTree:
    """A draft chain of ``depth`` nodes under ``root`` that spells ``future`` while the draft is
    right (``right`` per step), then junk; plus a wrong sibling of its first node. The draft is
    overconfident: its wrong tokens get probabilities 0.6-0.95, its right ones 0.75-0.99."""
    tokens, parents, logps, on = [root], [-1], [0.0], True
    for d in range(depth):
        on = on and d < len(future) and rng.random() < right
        tokens.append(future[d] if on else JUNK + d)
        parents.append(d)
        logps.append(math.log(rng.uniform(0.75, 0.99) if on else rng.uniform(0.6, 0.95)))
    if depth:
        tokens.append(JUNK + 50)
        parents.append(0)
        logps.append(math.log(rng.uniform(0.02, 0.2)))
    return FlatTree(token_ids=tokens, parents=parents, draft_logprobs=logps)


def lookup_chain(rng: random.Random, future: list[int], right: float) -> list[tuple[str, Proposal]]:
    """Half the rounds, a prompt-lookup chain of up to 3 tokens, right with probability ``right``."""
    if rng.random() < 0.5 or not future:
        return []
    chain = future[:3] if rng.random() < right else [JUNK + 70, *future[1:3]]
    return [("lookup", Proposal(chain=chain, keys=[0] * len(chain)))]


def round_record(sid: str, rnd: int, prompt_len: int, done: int, output: list[int], merged: FlatTree,
                 sources: dict, drafted: FlatTree | None, kept: int, *, draft_ms: float = 6.0,
                 other_ms: float = 0.5, verify=cpu_verify, **over) -> dict:
    """A round of a recorded run that kept ``merged``'s first ``kept`` nodes; its verdict from
    ``output``. ``over``: fields to override."""
    verified = FlatTree(token_ids=merged.token_ids[:kept], parents=merged.parents[:kept])
    path = accepted_path(verified, output, done)
    at = done + len(path)
    sync = prompt_len if rnd == 0 else 1
    verify_ms = verify(sync + kept)
    draft = draft_ms if drafted is not None else 0.0
    rec = {
        "kind": "round", "session": sid, "round": rnd, "prompt_len": prompt_len, "context_len": prompt_len + done,
        "sync_tokens": sync, "plain": drafted is None, "confirm": False, "greedy": True,
        "max_depth": TREE["max_depth"], "min_path_prob": 0.0, "merged": tree_record(merged, sources),
        "drafted_nodes": drafted.num_nodes if drafted is not None else 0, "chosen": list(range(kept)),
        "expected_tokens": 1.0 + 0.5 * (kept - 1), "expected_ms": 20.0, "verified_nodes": kept,
        "accepted_nodes": path, "accepted_token_ids": [verified.token_ids[i] for i in path],
        "bonus_token_id": output[at] if at < len(output) else JUNK + 99, "draft_ms": draft, "grow_ms": 0.0,
        "verify_ms": verify_ms, "wall_ms": draft + verify_ms + other_ms, "reused": 0, "batch_size": 1,
        "batch_tokens": sync + kept, "partial": False, "clean": rnd > 0, "active_sessions": 1,
    }
    rec.update(over)
    return rec


def flat_verify(tokens: int) -> float:
    """A nearly flat verify cost (a GPU)."""
    return 20.0 + 0.125 * tokens


def synthetic_session(rng: random.Random, sid: str, *, n_out: int = 40, prompt_len: int = 20, right: float = 0.85,
                      plain_every: int = 5, verify=cpu_verify) -> list[dict]:
    """One greedy session's round records and its session record. The recorded run kept a
    random prefix of each merged tree, so every forward size gets measured."""
    output = [rng.randrange(100, 400) for _ in range(n_out)]
    prompt_last = rng.randrange(100, 400)
    records, done, rnd = [], 0, 0
    while done < n_out:
        root = output[done - 1] if done else prompt_last
        depth = min(TREE["max_depth"], n_out - done - 1)
        future = output[done:done + depth]
        drafted = None if rnd % plain_every == plain_every - 1 else draft_tree(rng, root, future, depth, right)
        base = drafted if drafted is not None else FlatTree(token_ids=[root], parents=[-1], draft_logprobs=[0.0])
        merged, sources = merge(base, lookup_chain(rng, future, right), TreeSpec(**{**TREE, "max_depth": depth}), 3)
        rec = round_record(sid, rnd, prompt_len, done, output, merged, sources, drafted,
                           rng.randint(1, merged.num_nodes), verify=verify)
        records.append(rec)
        done += len(rec["accepted_nodes"]) + 1
        rnd += 1
    records.append({"kind": "session", "session": sid, "prompt_len": prompt_len, "max_new_tokens": n_out,
                    "greedy": True, "output": output, "finish": "length", "rounds": rnd})
    return records


def synthetic_trace(seed: int = 0, sessions: int = 6, **kw) -> list[dict]:
    rng = random.Random(seed)
    records = [{"kind": "header", "version": 1, "tree": TREE, "tree_budget": "cost", "lookup_max_tokens": 3}]
    for s in range(sessions):
        records += synthetic_session(rng, f"s{s}", **kw)
    return records


# ---- unit tests -------------------------------------------------------------------------------------
def test_a_node_is_accepted_iff_its_path_spells_the_output():
    # root 7 -> 6 -> {8, 7}, root -> 9 -> 7; output [5, 6, 7]; the round began with 1 token committed
    tree = FlatTree(token_ids=[7, 6, 8, 7, 9, 7], parents=[-1, 0, 1, 1, 0, 4])
    assert accepted_path(tree, [5, 6, 7], 1) == [1, 3]  # 8 is off the path, the 7 under 9 too
    assert accepted_path(tree, [5, 6, 9], 1) == [1]  # the chain stops where it leaves the output
    assert accepted_path(tree, [5, 9, 7], 1) == [4, 5]
    assert accepted_path(tree, [5, 6], 1) == [1]  # past the output's end nothing is accepted
    assert accepted_path(tree, [5, 6, 7], 3) == []
    assert accepted_path(tree, [6, 7], 0) == [1, 3]


def test_true_cost_takes_medians_interpolates_and_extrapolates_by_the_line():
    def rnd(size: int, ms: float, clean: bool = True, batch_tokens: int = 0) -> dict:
        return {"kind": "round", "clean": clean, "sync_tokens": 1, "verified_nodes": size - 1,
                "batch_tokens": batch_tokens, "verify_ms": ms}

    records = [rnd(2, 9.0), rnd(2, 10.0), rnd(2, 30.0), rnd(2, 1000.0, clean=False), rnd(4, 20.0),
               rnd(1, 40.0, batch_tokens=8)]  # a shared forward: priced by the batch's tokens
    true = TrueCost.fit(records)
    assert true.sizes == (2, 4, 8) and true.medians == (10.0, 20.0, 40.0)
    assert true.ms(2) == 10.0 and true.ms(3) == 15.0 and true.ms(6) == 30.0
    assert true.ms(10) == pytest.approx(50.0) and true.ms(16) == pytest.approx(80.0)  # the line: 5 ms a token
    assert true.ms(1) == 10.0  # never below the smallest measured
    # past the largest size never below it, even where the line over the medians is
    knee = TrueCost.fit([rnd(2, 10.0), rnd(3, 10.0), rnd(4, 10.0), rnd(5, 30.0)])
    assert knee.ms(6) >= 30.0 and knee.ms(40) == pytest.approx(knee.intercept + knee.slope * 40)
    assert TrueCost.fit([rnd(3, 12.0)]).ms(9) == 12.0  # one size: flat
    assert TrueCost.fit([rnd(3, 12.0, clean=False)]) is None


def test_chain_tokens_caps_the_chain_nodes_replayed():
    rec = synthetic_trace(seed=3, sessions=1)[1]
    rec["merged"] = tree_record(FlatTree(token_ids=[1, 2, 3, 4, 5], parents=[-1, 0, 0, 2, 3],
                                         draft_logprobs=[0.0, -0.1, 0.0, 0.0, 0.0]),
                                {2: ("lookup", 0), 3: ("lookup", 0), 4: ("lookup", 0)})
    rec["drafted_nodes"] = 2
    tree, sources = merged_tree(rec, chain_tokens=2)
    assert tree.token_ids == [1, 2, 3, 4] and sources == {2: ("lookup", 0), 3: ("lookup", 0)}
    assert merged_tree(rec)[0].num_nodes == 5


class RecordedChoice(CostModel):
    """Keeps what the recorded run kept (``plan``: each replayed round's nodes, in order)."""

    def __init__(self, plan: list[list[int]]) -> None:
        super().__init__()
        self.plan = plan

    def choose(self, tree, sync_tokens, lookup=frozenset(), *, plain=False, cached=None, sources=None, measure=False):
        super().choose(tree, sync_tokens, lookup, plain=plain, cached=cached, sources=sources, measure=measure)
        return Choice(self.plan.pop(0), 1.0, 10.0)


def test_replay_feeds_the_model_what_rounds_learn_feeds_it():
    """Oracle: where the replayed choice is the recorded one and the machine's cost by size is
    what each round measured, the replayed model ends in the state an actor's ``rounds.learn``
    over the recorded rounds leaves (verdicts from the output equal the recorded ones)."""
    records = synthetic_trace(seed=1, sessions=3)
    rounds_ = [r for r in records if r["kind"] == "round"]
    made: list[CostModel] = []

    def make() -> CostModel:
        made.append(RecordedChoice([r["chosen"] for r in rounds_]))
        return made[-1]

    result = replay(records, make)
    assert result.rounds == sum(r["clean"] for r in rounds_) and result.mismatched == 0 and result.agreement == 1.0
    oracle = RecordedChoice([r["chosen"] for r in rounds_])
    for rec in rounds_:
        _learn_as_an_actor(oracle, rec)
    assert made[0] == oracle
    assert result.tok_s == pytest.approx(result.recorded_tok_s)  # same choices, same measured cost


def _learn_as_an_actor(cost: CostModel, rec: dict) -> None:
    tree, sources = merged_tree(rec)
    n = rec["drafted_nodes"]
    drafted = Proposal(tree=FlatTree(token_ids=tree.token_ids[:n], parents=tree.parents[:n]),
                       draft_ms=rec["draft_ms"]) if n else None
    spec = TreeSpec(**TREE)
    cost.active_sessions = 1
    rp = rounds.RoundPlan(rec["round"], False, cost.draft_spec(spec), rec["sync_tokens"], rec["plain"], (),
                          rec["context_len"])
    cands = select(tree, sources, cost, sync_tokens=rec["sync_tokens"], plain=rec["plain"], drafted=drafted)
    reply = VerifyReply(session_id=rec["session"], round=rec["round"], accepted_token_ids=rec["accepted_token_ids"],
                        accepted_nodes=rec["accepted_nodes"], bonus_token_id=rec["bonus_token_id"], cache_len=0,
                        verify_ms=rec["verify_ms"], batch_tokens=rec["batch_tokens"], batch_size=rec["batch_size"])
    timing = rounds.Timing(rec["draft_ms"], rec["grow_ms"], rec["verify_ms"], rec["wall_ms"])
    cost.speculating = 1 if drafted is not None else 0
    rounds.learn(cost, [], rp, cands, reply, [*rec["accepted_token_ids"], rec["bonus_token_id"]], timing,
                 clean=rec["clean"])
    cost.speculating = 0


def test_worse_rules_score_lower_where_drafts_are_often_right():
    steep = synthetic_trace(seed=2, sessions=8, right=0.7)
    flat = synthetic_trace(seed=2, sessions=8, right=0.7, verify=flat_verify)
    for records, worse in ((steep, ("root_only", "keep_all")), (flat, ("root_only", "one_node"))):
        default = replay(records)
        assert default.rounds > 50 and default.mismatched == 0
        assert abs(default.predicted_tok_s / default.tok_s - 1.0) < 0.1  # calibrated: it predicts what it gets
        for name in worse:
            r = replay(records, RULES[name])
            assert r.rounds == default.rounds and r.tok_s < MARGIN * default.tok_s, (name, r.tok_s, default.tok_s)
    assert replay(steep, RootOnly).mean_nodes == 1.0 and replay(flat, KeepAll).tok_s > 0.95 * replay(flat).tok_s
    # the naive rules lose over many rounds of an overconfident draft
    many = synthetic_trace(seed=3, sessions=40, right=0.7)
    default = replay(many).tok_s
    for name in NAIVE:
        assert replay(many, RULES[name]).tok_s < 0.99 * default, name


class Spy(CostModel):
    """The default, remembering each choice it made."""

    def __init__(self) -> None:
        super().__init__()
        self.choices: list[Choice] = []

    def choose(self, *args, **kw):
        self.choices.append(super().choose(*args, **kw))
        return self.choices[-1]


def test_predicted_and_actual_rates_cover_the_same_rounds():
    records = synthetic_trace(seed=4, sessions=3)
    rounds_ = [r for r in records if r["kind"] == "round"]
    rounds_[3]["partial"] = True  # not replayed
    rounds_[5]["accepted_token_ids"] = [JUNK + 7]  # a verdict the output contradicts: not replayed
    rounds_[5]["accepted_nodes"] = [1]
    rounds_[7]["clean"] = False  # a resend: replayed, not scored
    sampled = synthetic_session(random.Random(9), "sampled")
    for r in sampled:
        r["greedy"] = False
    records += sampled
    spies: list[Spy] = []
    result = replay(records, lambda: spies.append(Spy()) or spies[-1])
    replayed = [r for i, r in enumerate(rounds_) if i not in (3, 5)]
    scored = [c for r, c in zip(replayed, spies[0].choices) if r["clean"]]
    assert len(spies[0].choices) == len(replayed) and result.rounds == len(scored)
    assert [(s.session, s.round) for s in result.scored] == [(r["session"], r["round"]) for r in replayed if r["clean"]]
    assert result.skipped == 1 + sum(r["kind"] == "round" for r in sampled) and result.mismatched == 1
    assert result.unscored == sum(not r["clean"] for r in replayed)
    expected = 1e3 * sum(c.expected_tokens for c in scored) / sum(c.expected_ms for c in scored)
    assert result.predicted_tok_s == pytest.approx(expected)
    assert result.tok_s == pytest.approx(1e3 * sum(s.tokens for s in result.scored) / sum(s.ms for s in result.scored))
    d = result.to_dict()
    assert d["rounds"] == result.rounds and d["tok_s"] == round(result.tok_s, 3)


def test_each_orchestrator_run_in_a_file_gets_a_fresh_model():
    made: list[CostModel] = []
    first, second = synthetic_trace(seed=5, sessions=2), synthetic_trace(seed=6, sessions=2)
    both = replay(first + second, lambda: made.append(CostModel()) or made[-1])
    assert len(made) == 2 and both == replay(first) + replay(second)


def test_costreplay_command_prints_a_table_and_writes_json(tmp_path, capsys):
    paths = []
    for seed in (7, 8):
        path = tmp_path / f"trace{seed}.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in synthetic_trace(seed=seed, sessions=2))
        paths.append(str(path))
    out = tmp_path / "replay.json"
    assert main(["--trace", *paths, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.count("\n| ") == 3 and "| total |" in table  # two traces and their total
    got = json.loads(out.read_text())
    total = sum((replay(read_trace(p)) for p in paths), ReplayResult())
    assert got["total"] == total.to_dict() and set(got["traces"]) == set(paths)


def test_costreplay_is_a_bench_command(capsys):
    from specsplit.cli import main as cli_main

    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "costreplay", "--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("usage: specsplit bench costreplay")


def test_replay_never_imports_torch():
    code = ("import sys, specsplit.orchestrator.replay\n"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\nassert not bad, bad\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr


# ---- the regression over recorded traces -----------------------------------------------------------
REAL = sorted(TRACES.glob("*.jsonl.gz"))
NO_TRACES = pytest.mark.skip(reason="no recorded traces yet: tests/data/traces/*.jsonl.gz (from the real pair) "
                                    "and their expected.json (write_expected)")
TRACE_PARAMS = [pytest.param(p, id=p.name) for p in REAL] or [pytest.param(None, marks=NO_TRACES, id="none")]
MARGIN = 0.97  # a clearly worse rule scores at most this share of the default's rate
AGREEMENT_SLACK = 0.05  # replayed choices may agree with the recorded ones this much less often
STEEP = 1.25  # nodes cost where a forward 8 tokens wider than the smallest measured costs this much more


@functools.cache
def _records(path: Path) -> list[dict]:
    return read_trace(path)


@functools.cache
def _replayed(path: Path, rule: str = "default") -> ReplayResult:
    return replay(_records(path), RULES[rule])


def nodes_cost(path: Path) -> bool:
    """Whether the trace's machine prices a wider verify forward clearly higher (a CPU, not a GPU)."""
    true = TrueCost.fit(_records(path))
    return true is not None and true.ms(true.sizes[0] + 8) >= STEEP * true.ms(true.sizes[0])


def write_expected(paths: list[Path] | None = None) -> dict:
    """Replay each trace (default: every one in tests/data/traces) with the default cost model
    and write its rates to expected.json, the figures the regression test holds it to."""
    expected = json.loads(EXPECTED.read_text()) if EXPECTED.exists() else {}
    for path in paths or REAL:
        r = replay(read_trace(path))
        expected[Path(path).name] = {"tok_s": round(r.tok_s, 3), "predicted_tok_s": round(r.predicted_tok_s, 3),
                                     "agreement": round(r.agreement, 3)}
    EXPECTED.write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    return expected


@pytest.mark.parametrize("path", TRACE_PARAMS)
def test_the_default_cost_model_keeps_its_replayed_rate(path):
    assert EXPECTED.exists(), "no tests/data/traces/expected.json: run `python tests/test_costmodel_replay.py`"
    expected = json.loads(EXPECTED.read_text()).get(path.name)
    assert expected is not None, f"{path.name} has no figures in expected.json: run write_expected"
    r = _replayed(path)
    assert r.rounds > 0 and r.mismatched <= 0.01 * r.rounds, r.to_dict()
    assert r.tok_s >= 0.98 * expected["tok_s"], (r.tok_s, expected)
    assert abs(r.predicted_tok_s / r.tok_s - 1.0) <= 0.25, (r.predicted_tok_s, r.tok_s)
    # its choices: the node sets it keeps agree with what the recorded run's model kept as often as
    # when the figures were written (a rule that chooses otherwise must justify its figures anew)
    assert r.agreement >= expected.get("agreement", 0.0) - AGREEMENT_SLACK, (r.agreement, expected)


@pytest.mark.parametrize("rule", list(CLEARLY_WORSE))
@pytest.mark.parametrize("path", TRACE_PARAMS)
def test_clearly_worse_rules_score_lower_on_recorded_traces(path, rule):
    if rule == "keep_all" and not nodes_cost(path):
        pytest.skip("nodes cost nearly nothing here (a flat verify cost): keeping them all is no loss")
    if rule == "one_node" and nodes_cost(path):
        pytest.skip("nodes cost here (a steep verify cost): one node may be as good as a few")
    default, worse = _replayed(path), _replayed(path, rule)
    assert worse.tok_s <= MARGIN * default.tok_s, (rule, worse.tok_s, default.tok_s)


@pytest.mark.skipif(not REAL, reason="no recorded traces yet (tests/data/traces/*.jsonl.gz)")
@pytest.mark.parametrize("rule", list(NAIVE))
def test_naive_rules_never_beat_the_default_over_every_steep_trace(rule):
    steep = [p for p in REAL if nodes_cost(p)]
    if not steep:
        pytest.skip("no trace where nodes cost: these rules choose as the default does there")
    default = sum((_replayed(p) for p in steep), ReplayResult())
    naive = sum((_replayed(p, rule) for p in steep), ReplayResult())
    assert naive.tok_s <= 1.01 * default.tok_s, (rule, naive.tok_s, default.tok_s)


if __name__ == "__main__":
    print(json.dumps(write_expected(), indent=2))
