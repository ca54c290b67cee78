"""The rounds ``specsplit bench replay`` takes from a round trace: per greedy session, each
round's context, sync, verified tree shape, acceptance and recorded times, checked to follow the
recorded progression (``traced_sessions``), and a run's cut (``limit``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specsplit.orchestrator.costmodel import select_nodes
from specsplit.orchestrator.replay import Record, TraceError, merged_tree, segments
from specsplit.tree import path_to


@dataclass(frozen=True, slots=True)
class TracedRound:
    """What the replay takes from one round line."""

    round: int
    context_len: int  # committed tokens at the round's start; the root is the last
    sync_tokens: int
    parents: tuple[int, ...]  # the verified tree's shape (merged's chosen nodes)
    accepted: int  # nodes the target accepted (the bonus not counted)
    draft_ms: float
    verify_ms: float
    wall_ms: float
    clean: bool  # a first send, not the prompt's prefill
    batch_size: int
    drafted: tuple[int, ...] = (-1,)  # the merged tree the proposers drafted (its parents)
    reused: int = 0  # nodes of a tree the draft grew during the previous round's verify (0: drafted after it)

    @property
    def committed(self) -> int:
        return self.accepted + 1


@dataclass(frozen=True, slots=True)
class TracedSession:
    trace: str
    session: str
    prompt_len: int
    rounds: tuple[TracedRound, ...]


def _round(rec: Record) -> TracedRound:
    tree, _ = merged_tree(rec)
    n = tree.num_nodes
    chosen = list(range(n)) if rec["chosen"] is None else list(rec["chosen"])
    if not chosen or chosen[0] != 0 or chosen != sorted(set(chosen)) or chosen[-1] >= n:
        raise ValueError(f"chosen {chosen} is not ascending node indices of the {n}-node merged tree from 0")
    try:
        parents = select_nodes(tree, chosen).parents
    except KeyError as exc:
        raise ValueError(f"chosen {chosen} leaves node {exc} without its parent") from None
    if rec["verified_nodes"] != len(parents):
        raise ValueError(f"verified_nodes {rec['verified_nodes']} but {len(parents)} chosen nodes")
    accepted = list(rec["accepted_nodes"])
    if accepted and (accepted[-1] >= len(parents) or path_to(accepted[-1], parents)[1:] != accepted):
        raise ValueError(f"accepted_nodes {accepted} is no root-side path of the verified tree")
    return TracedRound(round=int(rec["round"]), context_len=int(rec["context_len"]),
                       sync_tokens=int(rec["sync_tokens"]), parents=tuple(parents), accepted=len(accepted),
                       draft_ms=float(rec["draft_ms"]), verify_ms=float(rec["verify_ms"]),
                       wall_ms=float(rec["wall_ms"]), clean=bool(rec["clean"]),
                       batch_size=int(rec.get("batch_size") or 1), drafted=tuple(tree.parents),
                       reused=int(rec.get("reused") or 0))


def _session(trace: str, sid: str, recs: list[Record]) -> TracedSession:
    rounds = []
    for rec in recs:
        try:
            rounds.append(_round(rec))
            prompt_len = int(rec["prompt_len"])
        except (KeyError, TypeError, ValueError) as exc:
            what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise TraceError(f"{trace}: session {sid} round {rec.get('round')}: {what}") from exc
    for a, b in zip([None, *rounds], rounds):
        want = prompt_len if a is None else a.context_len + a.committed
        if b.context_len != want or b.context_len - 1 - b.sync_tokens < 0:
            raise TraceError(f"{trace}: session {sid} round {b.round}: context_len {b.context_len} after "
                             f"{'the prompt' if a is None else f'round {a.round}'}, expected {want} "
                             "(a rollback or a missing round cannot be replayed)")
    return TracedSession(trace, sid, prompt_len, tuple(rounds))


def traced_sessions(trace: str, records: Iterable[Record]) -> list[TracedSession]:
    """The greedy sessions of a trace's records, in the order their first rounds appear."""
    out = []
    for k, (_, body) in enumerate(segments(records)):
        by_session: dict[str, list[Record]] = {}
        for rec in body:
            if rec.get("kind") == "round":
                if "session" not in rec or "greedy" not in rec:
                    raise TraceError(f"{trace}: a round line without session or greedy: {str(rec)[:120]}")
                if rec["greedy"]:
                    by_session.setdefault(rec["session"], []).append(rec)
        out += [_session(trace, f"{k}-{sid}" if k else sid, recs) for sid, recs in by_session.items()]
    return out


def limit(sessions: Sequence[TracedSession], max_sessions: int | None,
          max_rounds: int | None) -> list[TracedSession]:
    """The first ``max_sessions`` sessions, cut to ``max_rounds`` rounds in all (file order)."""
    out, left = [], max_rounds if max_rounds is not None else sum(len(s.rounds) for s in sessions)
    for s in sessions[:max_sessions]:
        if left <= 0:
            break
        out.append(TracedSession(s.trace, s.session, s.prompt_len, s.rounds[:left]))
        left -= len(out[-1].rounds)
    return out
