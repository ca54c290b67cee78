"""The cost model replayed over recorded round traces: what its choices would have delivered on
the machine the trace was recorded on (torch-free; ``specsplit bench costreplay``).

A greedy session's output is the target's greedy continuation, so a trace
(``specsplit.orchestrator.trace``) says for any node of any round's merged candidate tree
whether the target would accept it: in a round that began with k output tokens committed, the
node at depth d whose path spells t1..td is accepted iff t_j == output[k + j - 1] for every j
(a node past the output's end is not). Output [5, 6, 7], a round at k = 1 whose merged tree is
root -> 6 -> 7 plus root -> 9: nodes 6 and 7 are accepted, 9 is not; keeping {root, 6} commits
2 tokens, {root, 6, 7} 3.

``replay`` runs a fresh cost model over the rounds of the greedy sessions, in file order, as an
orchestrator runs it: ``draft_spec`` (kept beside the recorded ``min_path_prob``), ``choose`` on
the recorded merged tree, then what ``rounds.learn`` feeds it, from the verdict the target
would have given that choice. Each clean round (a first send, not the prompt's prefill) is
scored at the time its choice would have taken: the recorded draft and other time (transport,
the orchestrator), which do not depend on the choice, plus the verify forward at what the trace
measured for that forward size (``TrueCost``). The evaluation is per round: the recorded context
goes on as recorded, so a round's tokens are what its own choice makes of its own candidates.
Rounds of sampled sessions, SpecPV confirm and partial rounds are not replayed; a round whose
recorded verdict contradicts the session's output (a rollback) neither.

    specsplit bench costreplay --trace runs/trace.jsonl.gz [--json runs/costreplay.json]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas import FlatTree, TreeSpec
from specsplit.orchestrator.costmodel import CostModel, Source, expanded_nodes, select_nodes

Record = dict[str, Any]  # one trace line, as json.loads gives it


class TraceError(ValueError):
    """A trace line that is not JSON (other than a last line cut short where the writer stopped)."""


def read_trace(path: str | Path) -> list[Record]:
    """Every record of a trace file, gzip-compressed or not (by its first bytes, not its name:
    a fleet writes its trace as plain lines whatever the name ends in)."""
    path = Path(path)
    with open(path, "rb") as f:
        opener = gzip.open if f.read(2) == b"\x1f\x8b" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if n == len(lines):
                break  # the writer stopped mid-line
            raise TraceError(f"{path}:{n}: {exc}") from exc
    return records


def segments(records: Iterable[Record]) -> Iterator[tuple[Record, list[Record]]]:
    """(header, the records after it) for each orchestrator run a file holds (a writer appends
    a header when it opens the file); records before any header come with the header {}."""
    header: Record = {}
    body: list[Record] = []
    for r in records:
        if r.get("kind") == "header":
            if body:
                yield header, body
            header, body = r, []
        else:
            body.append(r)
    if body:
        yield header, body


def forward_tokens(rec: Record) -> int:
    """The tokens of the verify forward that served round ``rec``: every session's when reported."""
    return rec["batch_tokens"] if rec.get("batch_tokens", 0) > 0 else rec["sync_tokens"] + rec["verified_nodes"]


@dataclass(frozen=True)
class TrueCost:
    """The machine's verify cost by forward size, as a trace measured it: each measured size's
    median ms; between measured sizes the line between them; past them the least-squares line
    over the medians (slope >= 0), never below the smallest median, nor, above the largest
    size, below the largest's (a bigger forward never priced cheaper than a measured smaller
    one). Medians {2: 10, 4: 20, 8: 40}: 3 -> 15, 10 -> 50, 1 -> 10."""

    sizes: tuple[int, ...]  # measured forward sizes, ascending
    medians: tuple[float, ...]  # their median verify ms
    intercept: float
    slope: float

    @classmethod
    def fit(cls, records: Iterable[Record]) -> TrueCost | None:
        """From the clean rounds among ``records`` (None: there are none)."""
        by_size: dict[int, list[float]] = {}
        for r in records:
            if r.get("kind") == "round" and r.get("clean"):
                by_size.setdefault(forward_tokens(r), []).append(float(r["verify_ms"]))
        if not by_size:
            return None
        sizes = tuple(sorted(by_size))
        medians = tuple(statistics.median(by_size[s]) for s in sizes)
        mx, my = statistics.fmean(sizes), statistics.fmean(medians)
        sxx = sum((x - mx) ** 2 for x in sizes)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(sizes, medians)) / sxx) if sxx > 0 else 0.0
        return cls(sizes, medians, my - slope * mx, slope)

    def ms(self, tokens: int) -> float:
        sizes, medians = self.sizes, self.medians
        i = bisect.bisect_left(sizes, tokens)
        if i < len(sizes) and sizes[i] == tokens:
            return medians[i]
        if 0 < i < len(sizes):
            x0, x1, y0, y1 = sizes[i - 1], sizes[i], medians[i - 1], medians[i]
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        line = max(self.intercept + self.slope * tokens, min(medians))
        return line if i == 0 else max(line, medians[-1])


def accepted_path(tree: FlatTree, output: Sequence[int], done: int) -> list[int]:
    """The nodes of ``tree`` (root excluded, root side first) the target accepts in a round that
    began with ``done`` tokens of ``output`` committed: each spells the output's next token
    under the last. Output [5, 6, 7], done 1, tree 7 -> [6 -> [8, 7], 9]: the 6 and the 7 under it."""
    path: list[int] = []
    node = 0
    while done + len(path) < len(output):
        want = output[done + len(path)]
        node = next((i for i in range(node + 1, tree.num_nodes)
                     if tree.parents[i] == node and tree.token_ids[i] == want), -1)
        if node < 0:
            break
        path.append(node)
    return path


def merged_tree(rec: Record, chain_tokens: int | None = None) -> tuple[FlatTree, dict[int, Source]]:
    """Round ``rec``'s merged candidate tree and its chain nodes' sources. ``chain_tokens``: at
    most that many chain nodes, as a smaller ``lookup_max_tokens`` would have merged (chains are
    appended after the draft's tree, so their first nodes are what a smaller budget keeps)."""
    m = rec["merged"]
    n = len(m["token_ids"])
    if chain_tokens is not None:
        n = min(n, max(1, rec["drafted_nodes"]) + max(0, chain_tokens))
    tree = FlatTree(token_ids=m["token_ids"][:n], parents=m["parents"][:n],
                    draft_logprobs=m["draft_logprobs"][:n] if m["draft_logprobs"] else [])
    return tree, {i: (name, key) for i, name, key in m["sources"] if i < n}


@dataclass(frozen=True, slots=True)
class ScoredRound:
    """A clean round as replayed, beside what the recorded run did in it."""

    session: str
    round: int
    tokens: int  # what the replayed choice commits (accepted + bonus), within the output
    ms: float  # its round time: recorded draft and other ms + the verify of its forward size
    expected_tokens: float  # the replayed model's Choice
    expected_ms: float
    nodes: int  # nodes kept, the root included
    agreed: bool  # the recorded run kept the same nodes
    drafted: bool  # a draft tree was asked for (not a plain round)
    min_path_prob: float  # the replayed model's draft_spec threshold
    recorded_min_path_prob: float
    recorded_tokens: int  # the recorded verdict's, within the output
    recorded_ms: float  # the recorded round's wall ms
    recorded_expected_tokens: float | None  # the recorded Choice (None: no cost model)
    recorded_expected_ms: float | None


@dataclass(frozen=True)
class ReplayResult:
    """The scored rounds of one or more traces (``+`` adds results), and what was left out."""

    scored: tuple[ScoredRound, ...] = ()
    unscored: int = 0  # replayed rounds that were no cost sample (a prefill, a resend): taught acceptance only
    skipped: int = 0  # not replayed: sampled sessions, SpecPV confirm / partial rounds, no session output
    mismatched: int = 0  # not replayed: the recorded verdict contradicts the output (a rollback)

    def __add__(self, other: ReplayResult) -> ReplayResult:
        return ReplayResult(self.scored + other.scored, self.unscored + other.unscored,
                            self.skipped + other.skipped, self.mismatched + other.mismatched)

    @property
    def rounds(self) -> int:
        return len(self.scored)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.scored)

    @property
    def ms(self) -> float:
        return sum(s.ms for s in self.scored)

    @property
    def tok_s(self) -> float:
        return _per_s(self.tokens, self.ms)

    @property
    def predicted_tok_s(self) -> float:
        """What the replayed choices expected, over the same rounds as ``tok_s``."""
        return _per_s(sum(s.expected_tokens for s in self.scored), sum(s.expected_ms for s in self.scored))

    @property
    def mean_nodes(self) -> float:
        return _mean([s.nodes for s in self.scored])

    @property
    def agreement(self) -> float:
        """Share of the scored rounds whose replayed choice is the recorded one."""
        return _mean([float(s.agreed) for s in self.scored])

    @property
    def recorded_tok_s(self) -> float:
        return _per_s(sum(s.recorded_tokens for s in self.scored), sum(s.recorded_ms for s in self.scored))

    @property
    def recorded_predicted_tok_s(self) -> float:
        known = [s for s in self.scored if s.recorded_expected_tokens is not None]
        return _per_s(sum(s.recorded_expected_tokens for s in known), sum(s.recorded_expected_ms for s in known))

    def min_path_probs(self) -> tuple[float, float]:
        """(replayed, recorded) mean draft threshold over the scored drafted rounds."""
        drafted = [s for s in self.scored if s.drafted]
        return _mean([s.min_path_prob for s in drafted]), _mean([s.recorded_min_path_prob for s in drafted])

    def to_dict(self) -> dict[str, Any]:
        mpp, recorded_mpp = self.min_path_probs()
        return {"rounds": self.rounds, "tokens": self.tokens, "ms": round(self.ms, 3),
                "tok_s": round(self.tok_s, 3), "predicted_tok_s": round(self.predicted_tok_s, 3),
                "mean_nodes": round(self.mean_nodes, 3), "agreement": round(self.agreement, 4),
                "min_path_prob": round(mpp, 4), "recorded_min_path_prob": round(recorded_mpp, 4),
                "recorded_tok_s": round(self.recorded_tok_s, 3),
                "recorded_predicted_tok_s": round(self.recorded_predicted_tok_s, 3),
                "unscored": self.unscored, "skipped": self.skipped, "mismatched": self.mismatched}


def _per_s(tokens: float, ms: float) -> float:
    return 1e3 * tokens / ms if ms > 0 else 0.0


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


@dataclass(frozen=True, slots=True)
class _Priced:
    """A replayed clean round's forward and time."""

    own_tokens: int  # this session's tokens in the verify forward (sync + kept nodes)
    forward_tokens: int  # the whole forward's (the other sessions' as recorded)
    verify_ms: float  # TrueCost of forward_tokens
    ms: float  # the round: draft + other recorded ms + verify_ms


class _Replayer:
    """One cost model over one orchestrator run's rounds."""

    def __init__(self, cost: CostModel, true: TrueCost, tree: TreeSpec, chain_tokens: int | None) -> None:
        self.cost, self.true, self.tree, self.chain_tokens = cost, true, tree, chain_tokens

    def round(self, rec: Record, output: Sequence[int]) -> ScoredRound | None:
        """Choose, verify against the output, learn; the scored round (None: not clean)."""
        cost, done = self.cost, rec["context_len"] - rec["prompt_len"]
        tree, sources = merged_tree(rec, self.chain_tokens)
        cost.active_sessions = rec.get("active_sessions") or 1
        threshold = cost.draft_spec(self.tree.model_copy(update={"max_depth": rec["max_depth"]})).min_path_prob
        choice = cost.choose(tree, rec["sync_tokens"], sources=sources, plain=rec["plain"],
                             measure=rec["drafted_nodes"] > 0 and cost.measuring())  # as ``state.select``
        kept = select_nodes(tree, choice.nodes)
        index = {old: new for new, old in enumerate(choice.nodes)}
        kept_sources = {index[i]: src for i, src in sources.items() if i in index}
        accepted = accepted_path(kept, output, done)
        if not rec["clean"]:  # as rounds.learn: a prefill or a resend teaches acceptance only
            cost.observe_round(kept, accepted, sources=kept_sources)
            return None
        priced = self._price(rec, kept.num_nodes)
        self._learn(rec, kept, kept_sources, accepted, priced)
        recorded = rec["chosen"] if rec["chosen"] is not None else list(range(len(rec["merged"]["token_ids"])))
        left = len(output) - done
        return ScoredRound(
            session=rec["session"], round=rec["round"], tokens=min(len(accepted) + 1, left), ms=priced.ms,
            expected_tokens=choice.expected_tokens, expected_ms=choice.expected_ms, nodes=len(choice.nodes),
            agreed=choice.nodes == recorded, drafted=rec["drafted_nodes"] > 0, min_path_prob=threshold,
            recorded_min_path_prob=rec["min_path_prob"],
            recorded_tokens=min(len(rec["accepted_token_ids"]) + 1, left), recorded_ms=rec["wall_ms"],
            recorded_expected_tokens=rec.get("expected_tokens"), recorded_expected_ms=rec.get("expected_ms"))

    def _price(self, rec: Record, nodes: int) -> _Priced:
        own = rec["sync_tokens"] + nodes
        others = 0
        if rec["batch_size"] > 1 and rec["batch_tokens"] > 0:
            others = max(0, rec["batch_tokens"] - rec["sync_tokens"] - rec["verified_nodes"])
        verify = self.true.ms(own + others)
        draft = rec["draft_ms"] if rec["drafted_nodes"] > 0 else 0.0
        other = max(0.0, rec["wall_ms"] - rec["draft_ms"] - rec["verify_ms"])
        return _Priced(own, own + others if rec["batch_tokens"] > 0 else 0, verify, draft + other + verify)

    def _learn(self, rec: Record, kept: FlatTree, sources: dict[int, Source], accepted: list[int],
               p: _Priced) -> None:
        """What ``rounds.learn`` feeds the model after a clean round, from the replayed verdict."""
        cost, drafted, new = self.cost, rec["drafted_nodes"] > 0, len(accepted) + 1
        cost.speculating = 1 if drafted else 0  # this session, in a drafted round until its verdict
        if drafted:
            cost.observe_speculation(new, rec["draft_ms"] + rec.get("grow_ms", 0.0), draft_ms=rec["draft_ms"],
                                     nodes=kept.num_nodes)
        cost.observe_round(kept, accepted, sources=sources)
        cost.observe_forward(p.own_tokens, p.verify_ms, p.forward_tokens, rec["batch_size"])
        if not drafted:
            cost.observe_plain(new, p.ms - p.verify_ms)
        else:
            cost.observe_overhead(max(0.0, p.ms - p.verify_ms))
            cost.observe_rate(new, p.ms)
            if rec["reused"] == 0:
                m = rec["merged"]
                n = rec["drafted_nodes"]
                draft_tree = FlatTree(token_ids=m["token_ids"][:n], parents=m["parents"][:n])
                cost.observe_draft(expanded_nodes(draft_tree), rec["draft_ms"])
        cost.speculating = 0


def consistent(rec: Record, output: Sequence[int], done: int) -> bool:
    """Whether round ``rec``'s recorded verdict (accepted tokens and bonus) spells the output
    from ``done`` on, as far as the output goes."""
    if not 0 <= done < len(output):
        return False
    got = [*rec["accepted_token_ids"], rec["bonus_token_id"]]
    m = min(len(got), len(output) - done)
    return got[:m] == list(output[done:done + m])


def replay(records: Iterable[Record], make_cost: Callable[[], CostModel] = CostModel, *,
           chain_tokens: int | None = None) -> ReplayResult:
    """``make_cost()``'s choices over the greedy rounds of ``records`` (a trace's lines, in file
    order), a fresh model for each orchestrator run in them. ``chain_tokens``: replay with at
    most that many chain nodes per round (``merged_tree``)."""
    result = ReplayResult()
    for header, body in segments(records):
        result += _replay_run(header, body, make_cost, chain_tokens)
    return result


def _replay_run(header: Record, body: list[Record], make_cost: Callable[[], CostModel],
                chain_tokens: int | None) -> ReplayResult:
    rounds = [r for r in body if r.get("kind") == "round"]
    outputs = {r["session"]: r["output"] for r in body if r.get("kind") == "session" and r.get("greedy")}
    true = TrueCost.fit(rounds)
    if true is None:  # nothing measured: nothing to price (and no clean round to score)
        return ReplayResult(skipped=len(rounds))
    replayer = _Replayer(make_cost(), true, TreeSpec.model_validate(header.get("tree") or {}), chain_tokens)
    scored, unscored, skipped, mismatched = [], 0, 0, 0
    for rec in rounds:
        output = outputs.get(rec["session"])
        if output is None or not rec["greedy"] or rec["confirm"] or rec["partial"]:
            skipped += 1
        elif not consistent(rec, output, rec["context_len"] - rec["prompt_len"]):
            mismatched += 1
        elif (s := replayer.round(rec, output)) is None:
            unscored += 1
        else:
            scored.append(s)
    return ReplayResult(tuple(scored), unscored, skipped, mismatched)


def markdown_table(results: dict[str, ReplayResult]) -> str:
    """One row per trace (and a total row for several): the replayed rate, what the choices
    predicted, and the recorded run's own figures over the same rounds."""
    rows = list(results.items())
    if len(rows) > 1:
        rows.append(("total", sum(results.values(), ReplayResult())))
    lines = [("| trace | rounds | tok/s | predicted tok/s | predicted / actual | nodes | agreement "
              "| min_path_prob | recorded tok/s | recorded predicted tok/s | recorded min_path_prob |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        mpp, recorded_mpp = r.min_path_probs()
        ratio = r.predicted_tok_s / r.tok_s if r.tok_s else 0.0
        lines.append(f"| {name} | {r.rounds} | {r.tok_s:.2f} | {r.predicted_tok_s:.2f} | {ratio:.2f} "
                     f"| {r.mean_nodes:.2f} | {100 * r.agreement:.0f} % | {mpp:.2f} | {r.recorded_tok_s:.2f} "
                     f"| {r.recorded_predicted_tok_s:.2f} | {recorded_mpp:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="specsplit bench costreplay",
        description="Replay the cost model (a fresh CostModel) over round traces (SPECSPLIT_TRACE_FILE): "
                    "each greedy round's choice priced at the trace's measured verify cost and scored by "
                    "the session's output. Prints a Markdown table per trace and in total.")
    p.add_argument("--trace", nargs="+", required=True, metavar="FILE", help="trace files (.jsonl or .jsonl.gz)")
    p.add_argument("--json", metavar="OUT", help="also write the figures as JSON to OUT")
    p.add_argument("--chain-tokens", type=int, default=None, metavar="N",
                   help="replay with at most N chain (lookup, n-gram cache) nodes per round (default: as recorded)")
    args = p.parse_args(argv)
    try:
        results = {path: replay(read_trace(path), chain_tokens=args.chain_tokens) for path in args.trace}
    except (OSError, TraceError) as exc:
        print(f"specsplit bench costreplay: {exc}", file=sys.stderr)
        return 1
    print(markdown_table(results))
    if args.json:
        total = sum(results.values(), ReplayResult())
        out = {"traces": {k: v.to_dict() for k, v in results.items()}, "total": total.to_dict()}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
