"""``specsplit bench replay``'s figures: the decode figures over a replay's clean rounds against
the target alone (``summarize``), per verified tree size (``by_nodes``), as Markdown tables and
JSON (``report``). The replay itself: ``specsplit.bench.replay``."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specsplit.bench.replay_trace import TracedSession
    from specsplit.bench.replayer import AloneStep, ReplayedRound


def _per_s(tokens: float, ms: float) -> float:
    return round(1e3 * tokens / ms, 3) if ms > 0 else 0.0


def summarize(rounds: Sequence[ReplayedRound], alone: Sequence[AloneStep]) -> dict[str, Any]:
    """Decode figures over the clean rounds and the target alone at the same contexts."""
    clean = [r for r in rounds if r.clean]
    tokens = sum(r.accepted + 1 for r in clean)
    verify, draft = sum(r.verify_ms for r in clean), sum(r.recorded_draft_ms for r in clean)
    alone_ms = sum(a.verify_ms for a in alone)
    out = {
        "rounds": len(clean), "other_rounds": len(rounds) - len(clean), "tokens": tokens,
        "mean_nodes": round(statistics.fmean(r.nodes for r in clean), 3) if clean else 0.0,
        "tokens_per_round": round(tokens / len(clean), 3) if clean else 0.0,
        "verify_ms": round(verify, 3), "wall_ms": round(sum(r.wall_ms for r in clean), 3),
        "recorded_draft_ms": round(draft, 3), "recorded_verify_ms": round(sum(r.recorded_verify_ms for r in clean), 3),
        "verify_only_tok_s": _per_s(tokens, verify), "with_draft_tok_s": _per_s(tokens, verify + draft),
        "alone_tokens": len(alone), "alone_ms": round(alone_ms, 3), "alone_tok_s": _per_s(len(alone), alone_ms),
        "recorded_verify_only_tok_s": _per_s(tokens, sum(r.recorded_verify_ms for r in clean)),
        "recorded_tok_s": _per_s(tokens, sum(r.recorded_wall_ms for r in clean)),
        "catchup_rounds": sum(1 for r in rounds if r.catchup_tokens),
        "batched_rounds": sum(1 for r in clean if r.batch_size > 1),
    }
    replayed = [r.draft_ms for r in clean if r.draft_ms is not None]
    if clean and len(replayed) == len(clean):
        out["replayed_draft_ms"] = round(sum(replayed), 3)
        out["replayed_grow_ms"] = round(sum(r.grow_ms or 0.0 for r in clean), 3)
        # serially: every draft and growth after its verify
        out["with_replayed_draft_tok_s"] = _per_s(tokens, verify + sum(replayed) + out["replayed_grow_ms"])
        out["grown_draft_ms"] = round(grown_draft_ms(rounds), 3)
        out["recorded_reused_rounds"] = sum(1 for r in clean if r.reused > 0)
        out["rerooted_rounds"] = sum(1 for r in clean if r.rerooted)
        out["rerooted"] = f"{out['rerooted_rounds']} ({out['recorded_reused_rounds']})"
        out["grown_during_verify_tok_s"] = _per_s(tokens, verify + out["grown_draft_ms"])
        # the same with the draft re-rooting every grown tree on the round's critical path (GROW_REROOT off)
        out["grown_draft_ms_draft_reroots"] = round(grown_draft_ms(rounds, local=False), 3)
        out["grown_during_verify_draft_reroots_tok_s"] = _per_s(tokens, verify + out["grown_draft_ms_draft_reroots"])
    a = out["alone_tok_s"]
    fleet = [r.fleet_ms for r in clean if r.fleet_ms is not None]
    if clean and len(fleet) == len(clean):  # measured with the growth beside the verify (``--fleet``, ``--overlap``)
        alone_wall = sum(s.wall_ms for s in alone)
        out |= {"fleet_ms": round(sum(fleet), 3), "fleet_tok_s": _per_s(tokens, sum(fleet)),
                "beside_rounds": sum(1 for r in clean if r.beside),
                "alone_wall_ms": round(alone_wall, 3), "alone_wall_tok_s": _per_s(len(alone), alone_wall)}
        out["fleet_vs_alone"] = round(out["fleet_tok_s"] / a, 3) if a else 0.0
        w = out["alone_wall_tok_s"]
        out["fleet_vs_alone_wall"] = round(out["fleet_tok_s"] / w, 3) if w else 0.0
    if "replayed_draft_ms" in out:
        out["with_replayed_draft_vs_alone"] = round(out["with_replayed_draft_tok_s"] / a, 3) if a else 0.0
        out["grown_during_verify_vs_alone"] = round(out["grown_during_verify_tok_s"] / a, 3) if a else 0.0
        out["grown_during_verify_draft_reroots_vs_alone"] = (
            round(out["grown_during_verify_draft_reroots_tok_s"] / a, 3) if a else 0.0)
    out["verify_only_vs_alone"] = round(out["verify_only_tok_s"] / a, 3) if a else 0.0
    out["with_draft_vs_alone"] = round(out["with_draft_tok_s"] / a, 3) if a else 0.0
    out["paired_median_vs_alone"] = paired_median(clean, alone)
    return out


def grown_draft_ms(rounds: Sequence[ReplayedRound], local: bool = True) -> float:
    """The replayed draft ms on the critical path of the clean rounds, the draft on its own
    device as in the fleet. Where the growth after the previous round's draft was replayed
    (``grow_ms``), it ran during that round's verify: a round that re-rooted the grown tree
    after growth that ended within that verify adds nothing (``local``: the orchestrator
    re-roots the GrowReply's tree itself, SPECSPLIT_GROW_REROOT, the draft's request beside the
    verify); otherwise its draft waits for what of the growth outlasts that verify, then takes
    its own ms (a re-rooting request's where the trace's round re-rooted and the replayed growth
    left a path to re-root at; else a draft from scratch). Without replayed growth, a round whose
    tree was grown during the previous round's verify (``reused``) adds only what its draft
    outlasts that verify; any other round its whole draft."""
    total, before = 0.0, None
    for r in rounds:
        if r.clean and r.draft_ms is not None:
            follows = (before is not None and before.round == r.round - 1
                       and (before.trace, before.session) == (r.trace, r.session))
            if follows and before.grow_ms is not None:
                if not (local and r.rerooted and before.grow_ms <= before.verify_ms):
                    total += max(0.0, before.grow_ms - before.verify_ms) + r.draft_ms
            elif follows and r.reused > 0:
                total += max(0.0, r.draft_ms - before.verify_ms)
            else:
                total += r.draft_ms
        before = r
    return total


def paired_median(clean: Sequence[ReplayedRound], alone: Sequence[AloneStep]) -> float:
    """The median over clean rounds of (the target alone's ms for the round's tokens, measured
    right beside it) / (the round's verify ms): verify-only speedup, robust to the machine's drift."""
    step = {(a.trace, a.session, a.context_len): a.verify_ms for a in alone}
    ratios = [sum(step[r.trace, r.session, c] for c in range(r.context_len, r.context_len + r.accepted + 1))
              / r.verify_ms for r in clean if (r.trace, r.session, r.context_len) in step and r.verify_ms > 0]
    return round(statistics.median(ratios), 3) if ratios else 0.0


def by_nodes(rounds: Sequence[ReplayedRound], alone: Sequence[AloneStep]) -> list[dict[str, Any]]:
    """Per verified tree size (clean rounds): median forward ms replayed and recorded."""
    sizes: dict[int, list[ReplayedRound]] = {}
    for r in rounds:
        if r.clean:
            sizes.setdefault(r.nodes, []).append(r)
    rows = [{"nodes": n, "rounds": len(rs), "median_ms": round(statistics.median(r.verify_ms for r in rs), 2),
             "recorded_median_ms": round(statistics.median(r.recorded_verify_ms for r in rs), 2),
             "tokens_per_round": round(statistics.fmean(r.accepted + 1 for r in rs), 3)}
            for n, rs in sorted(sizes.items())]
    if alone:
        rows.append({"nodes": 1, "alone": True, "rounds": len(alone),
                     "median_ms": round(statistics.median(a.verify_ms for a in alone), 2),
                     "recorded_median_ms": None, "tokens_per_round": 1.0})
    return rows


SUMMARY_COLUMNS = (("rounds", "rounds"), ("tokens", "tokens"), ("tokens/round", "tokens_per_round"),
                   ("verify-only tok/s", "verify_only_tok_s"), ("with draft tok/s", "with_draft_tok_s"),
                   ("target alone tok/s", "alone_tok_s"), ("verify-only / alone", "verify_only_vs_alone"),
                   ("with draft / alone", "with_draft_vs_alone"), ("paired median", "paired_median_vs_alone"),
                   ("recorded tok/s", "recorded_tok_s"))


DRAFT_COLUMNS = (("with replayed draft tok/s", "with_replayed_draft_tok_s"),
                 ("with replayed draft / alone", "with_replayed_draft_vs_alone"),
                 ("re-rooted (recorded)", "rerooted"),
                 ("grown during verify tok/s", "grown_during_verify_tok_s"),
                 ("grown during verify / alone", "grown_during_verify_vs_alone"))


FLEET_COLUMNS = (("draft beside verify", "beside_rounds"), ("fleet tok/s", "fleet_tok_s"), ("fleet / alone", "fleet_vs_alone"),
                 ("alone via router tok/s", "alone_wall_tok_s"), ("fleet / alone via router", "fleet_vs_alone_wall"))


def markdown(summaries: dict[str, dict[str, Any]], sizes: list[dict[str, Any]], device: str) -> str:
    columns = SUMMARY_COLUMNS + (DRAFT_COLUMNS if all("replayed_draft_ms" in s for s in summaries.values()) else ())
    columns += FLEET_COLUMNS if all("fleet_tok_s" in s for s in summaries.values()) else ()
    lines = ["| trace | device | " + " | ".join(h for h, _ in columns) + " |",
             "|---|---|" + "---:|" * len(columns)]
    for name, s in summaries.items():
        cells = (f"{s[k]:.2f}" if isinstance(s[k], float) else str(s[k]) for _, k in columns)
        lines.append(f"| {name} | {device} | " + " | ".join(cells) + " |")
    lines += ["", "| verified nodes | rounds | forward ms (median) | recorded ms (median) | tokens/round |",
              "|---:|---:|---:|---:|---:|"]
    for row in sizes:
        name = "1 (target alone)" if row.get("alone") else str(row["nodes"])
        rec = "-" if row["recorded_median_ms"] is None else f"{row['recorded_median_ms']:.1f}"
        lines.append(f"| {name} | {row['rounds']} | {row['median_ms']:.1f} | {rec} | {row['tokens_per_round']:.2f} |")
    return "\n".join(lines)


def report(args, described: dict[str, Any], sessions: Sequence[TracedSession], rounds: list[ReplayedRound],
           alone: list[AloneStep]) -> None:
    """The Markdown tables on stdout; with ``--json``, every figure and row."""
    import torch

    summaries = {t: summarize([r for r in rounds if r.trace == t], [a for a in alone if a.trace == t])
                 for t in dict.fromkeys(s.trace for s in sessions)}
    if len(summaries) > 1:
        summaries["total"] = summarize(rounds, alone)
    sizes = by_nodes(rounds, alone)
    print(markdown(summaries, sizes, args.device))
    print("with draft: replayed verify ms + the draft ms recorded on the trace's machine; with replayed draft: "
          "+ the draft (and its growth) replayed here, serially; grown during verify: the draft on its own device, as the fleet "
          "runs it: after each draft the replayed growth (0.9 of the verify) overlaps the verify, and a round "
          "the trace re-rooted re-roots the grown tree (re-rooted: rounds that did here, of those recorded); "
          "figures over the clean rounds")
    if getattr(args, "overlap", False):
        print("fleet (--overlap): both engines in this process, each on its own thread and stream: each round's "
              "draft + its verify with the growth beside it + what of the growth outlasts it; alone via router: "
              "the target alone's steps through its thread")
    elif getattr(args, "fleet", False):
        workers = "one worker process hosting both roles (--pair)" if getattr(args, "pair", False) else \
            "a worker per role"
        print(f"fleet: through the fleet's processes on loopback (a router per role, {workers}), each round's "
              "draft round trip + its verify's, with the growth sent beside the verify, + what of the growth "
              "outlasts it; against the target alone's engine ms (alone) and its round trips through the same "
              "router (alone via router)")
    if args.json_path:
        name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device
        config = {k: v for k, v in vars(args).items() if k != "json_path"} | described | {
            "torch": torch.__version__, "device_name": name,
            "draft_ms": "recorded" + (" and replayed" if args.draft or args.draft_config else "")}
        out = {"config": config, "summary": summaries, "by_nodes": sizes, "rounds": [asdict(r) for r in rounds],
               "alone": [asdict(a) for a in alone]}
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
