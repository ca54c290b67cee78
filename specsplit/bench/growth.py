"""The draft's tree search and growth replayed against the target's recorded greedy output:
how often a round starts from the grown tree, for a few growth settings, with no target.

At temperature 0 the target's verdict on any tree is fixed by its greedy output (a trace's
session records keep it and, since they do, the prompt): the accepted path spells the output's
next tokens, the bonus is the token after them. So the real draft engine can draft, be judged,
grow for a fixed number of forwards (the verify's length in draft forwards: ``--grow-forwards``)
and re-root, round after round, exactly as in the fleet but deterministically and with no
target forward. Per setting it reports rounds, tokens a round, the share of rounds that re-rooted
a grown tree, and the draft forwards a round that ran after a verdict (the draft's critical path:
what a draft on its own device adds to a round), and a modelled speed-up over the target alone,
a draft forward costing ``--draft-cost`` verify forwards and a verify costing as a 1-token
forward (a GPU's flat verify cost). ``--lookup N`` hangs prompt lookup's chain under each root
as the fleet does (the cross-session n-gram cache left out) and ``--chains 0,1`` compares growth
without and with being told it (SPECSPLIT_GROW_CHAINS; a cost model learning from the verdicts
estimates each chain node's acceptance, as the orchestrator's does). Prints a Markdown table;
``--json FILE`` writes it.

    specsplit bench growth --trace tests/data/traces/humaneval0-9-qwen-coder-cpu2-spares.jsonl.gz \\
        --spares 0,2 --sessions 4 --max-tokens 150
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from schemas import CacheSync, DraftRequest, EndSession, GrowRequest, SamplingSpec, TreeSpec
from specsplit.orchestrator.costmodel import CostModel
from specsplit.orchestrator.hints import growth_hint
from specsplit.orchestrator.replay import read_trace
from specsplit.orchestrator.state import plan_round
from specsplit.orchestrator.trace import TRACE_VERSION, tree_record


@dataclass
class Tally:
    spares: int
    chains: bool = False  # growth told the lookup chains (SPECSPLIT_GROW_CHAINS)
    sessions: int = 0
    rounds: int = 0
    tokens: int = 0
    reused: int = 0
    after_verdict: int = 0  # draft forwards run after a verdict (not the prompt's round)
    nodes: int = 0
    after_chain: int = 0  # rounds after a verdict that accepted a lookup node
    after_chain_reused: int = 0  # ... that re-rooted a grown tree

    def row(self, draft_cost: float) -> dict:
        r = max(self.rounds, 1)
        modelled = self.tokens / (self.rounds + draft_cost * self.after_verdict) if self.rounds else 0.0
        return {**asdict(self), "tokens_per_round": round(self.tokens / r, 3), "reuse": round(self.reused / r, 3),
                "draft_forwards_after_verdict": round(self.after_verdict / r, 3), "mean_nodes": round(self.nodes / r, 2),
                "modelled_vs_alone": round(modelled, 3)}


def sessions_of(records: Sequence[dict], limit: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) of the greedy sessions that kept their prompt, each prompt once (the
    longest output), output cut at ``max_tokens``; at most ``limit``."""
    best: dict[tuple[int, ...], list[int]] = {}
    for r in records:
        if r.get("kind") == "session" and r.get("greedy") and r.get("prompt") and len(r.get("output", ())) > 1:
            key = tuple(r["prompt"])
            if len(r["output"]) > len(best.get(key, ())):
                best[key] = list(r["output"])
    return [(list(p), out[:max_tokens]) for p, out in list(best.items())[:limit]]


class Counted:
    """The engine's forwards counted (``forward_one``: every forward a request drives)."""

    def __init__(self, engine):
        self.n, self._real = 0, engine.forward_one
        engine.forward_one = self

    def __call__(self, seg):
        self.n += 1
        return self._real(seg)


def replay_session(engine, counted: Counted, sid: str, prompt: list[int], output: list[int], spec: TreeSpec,
                   grow_forwards: int, width: int, tally: Tally, *, lookup: int = 0,
                   cost: CostModel | None = None, record=None) -> None:
    """One session: draft, hang prompt lookup's chain of up to ``lookup`` tokens under the root
    (as the fleet does), judge by ``output``, grow ``grow_forwards`` forwards (told the chain
    when ``tally.chains``, its nodes' acceptance estimated by ``cost``, which learns from every
    verdict), re-root; until the output is committed. ``record``: called with each round's and
    the session's trace line (``round_line``)."""
    base, append, root, done, rnd = 0, prompt[:-1], prompt[-1], 0, 0
    after_chain = False
    while done < len(output) - 1:
        counted.n = 0
        context_len = len(prompt) + done
        reply = engine.handle(DraftRequest(session_id=sid, round=rnd, root=root, tree=spec,
                                           sync=CacheSync(base_len=base, append_token_ids=append)))
        if not hasattr(reply, "tree"):
            raise RuntimeError(f"session {sid} round {rnd}: {reply}")
        forwards = counted.n
        cands = plan_round(reply.tree, prompt + output[:done], spec, SamplingSpec(), lookup_max_tokens=lookup)
        tree = cands.tree
        node, accepted, path = 0, [], []
        while done < len(output):
            node = next((i for i in range(node + 1, tree.num_nodes)
                         if tree.parents[i] == node and tree.token_ids[i] == output[done]), -1)
            if node < 0:
                break
            accepted.append(output[done])
            path.append(node)
            done += 1
        if rnd > 0:
            tally.after_chain += after_chain
            tally.after_chain_reused += after_chain and reply.reused_nodes > 0
        if cost is not None:
            cost.observe_round(tree, path, sources=cands.sources)
        after_chain = any(i in cands.sources for i in path)
        if done >= len(output):
            break
        bonus = output[done]
        done += 1
        if record is not None:
            record(round_line(sid, rnd, prompt, context_len, spec, cands, reply, path, accepted, bonus))
        steps = {"n": 0}

        def waiting() -> bool:  # growth checks before each forward: it stops after grow_forwards
            steps["n"] += 1
            return steps["n"] > grow_forwards

        engine.others_waiting = waiting
        hint, probs = growth_hint(cands, cost) if tally.chains else (None, [])
        engine.handle(GrowRequest(session_id=sid, round=rnd, budget_ms=60_000.0, width=width, tree=hint,
                                  node_probs=probs))
        if rnd > 0:  # the prompt's round drafts from scratch in any setting
            tally.rounds += 1
            tally.tokens += len(accepted) + 1
            tally.reused += reply.reused_nodes > 0
            tally.after_verdict += forwards
            tally.nodes += reply.tree.num_nodes
        base, append, root, rnd = base + len(append) + 1, accepted, bonus, rnd + 1
    engine.others_waiting = lambda: False
    engine.handle(EndSession(session_id=sid))
    tally.sessions += 1
    if record is not None:
        record({"kind": "session", "session": sid, "prompt_len": len(prompt), "prompt": list(prompt),
                "max_new_tokens": len(output), "greedy": True, "output": list(output[:done]), "finish": "length",
                "rounds": rnd})


def round_line(sid: str, rnd: int, prompt: list[int], context_len: int, spec: TreeSpec, cands, reply,
               path: list[int], accepted: list[int], bonus: int) -> dict:
    """A replayed round as an orchestrator's trace line (``specsplit.orchestrator.trace``), so
    ``specsplit bench replay`` runs the rounds a draft growing ``--grow-forwards`` forwards a
    verify would give: every node verified, no target measured (verify and wall ms 0), the
    draft's ms this CPU's."""
    tree = cands.tree
    return {"kind": "round", "session": sid, "round": rnd, "prompt_len": len(prompt), "context_len": context_len,
            "sync_tokens": len(prompt) - 1 if rnd == 0 else 0, "plain": False, "confirm": False, "greedy": True,
            "max_depth": spec.max_depth, "min_path_prob": 0.0, "merged": tree_record(tree, cands.sources),
            "drafted_nodes": reply.tree.num_nodes, "chosen": None, "expected_tokens": None, "expected_ms": None,
            "verified_nodes": tree.num_nodes, "accepted_nodes": list(path), "accepted_token_ids": list(accepted),
            "bonus_token_id": bonus, "draft_ms": round(reply.draft_ms, 3), "grow_ms": 0.0, "verify_ms": 0.0,
            "wall_ms": 0.0, "reused": reply.reused_nodes, "batch_size": 1, "batch_tokens": tree.num_nodes,
            "partial": False, "clean": rnd > 0, "active_sessions": 1}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specsplit bench growth", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", action="append", required=True, help="a round trace with prompts in its session records")
    p.add_argument("--preset", default=None, help="the draft's preset (default: SPECSPLIT_PRESET's)")
    p.add_argument("--spares", default="0,2", help="SPECSPLIT_DRAFT_GROW_SPARES values, comma-separated")
    p.add_argument("--lookup", type=int, default=0,
                   help="prompt-lookup tokens hung under each root (SPECSPLIT_LOOKUP_MAX_TOKENS; 0: none)")
    p.add_argument("--chains", default="0", help="SPECSPLIT_GROW_CHAINS values (0, 1), comma-separated")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=150, help="output tokens replayed per session")
    p.add_argument("--grow-forwards", type=int, default=3, help="draft forwards of growth per verify")
    p.add_argument("--width", type=int, default=4, help="nodes a growth forward adds (SPECSPLIT_GROW_WIDTH)")
    p.add_argument("--max-nodes", type=int, default=8)
    p.add_argument("--max-depth", type=int, default=5)
    p.add_argument("--branch", type=int, default=2)
    p.add_argument("--draft-cost", type=float, default=0.35, help="a draft forward in verify forwards (the model)")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--record-trace", default=None, metavar="FILE",
                   help="write the rounds as a round trace (one --spares and one --chains value), which "
                        "`specsplit bench replay` runs on a device: the rounds of a draft with its own device")
    args = p.parse_args(argv)
    try:
        args.spares = [int(s) for s in args.spares.split(",")]
        args.chains = [bool(int(s)) for s in args.chains.split(",")]
    except ValueError:
        p.error(f"--spares, --chains: comma-separated integers, got {args.spares!r}, {args.chains!r}")
    if args.record_trace and len(args.spares) * len(args.chains) != 1:
        p.error("--record-trace records one setting: give one --spares and one --chains value")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from specsplit.bench.gpu import load_engine
    from specsplit.config import WorkerSettings
    from specsplit.models import ModelSettings
    from specsplit.openmp import set_worker_openmp

    set_worker_openmp()
    sessions = [s for path in args.trace for s in sessions_of(read_trace(path), args.sessions, args.max_tokens)]
    if not sessions:
        print("specsplit bench growth: no greedy session with its prompt in the trace(s) (recorded before "
              "session records kept prompts?)", file=sys.stderr)
        return 2
    ms = ModelSettings(**({"preset": args.preset} if args.preset else {}))
    load = argparse.Namespace(device="cpu", dtype=None, draft_config=None, random_weights=False)
    engine, described = load_engine("draft", load, ms, WorkerSettings())
    counted = Counted(engine)
    spec = TreeSpec(max_nodes=args.max_nodes, max_depth=args.max_depth, branch=args.branch, min_path_prob=0.0)
    rows, t0 = [], time.perf_counter()
    lines: list[dict] = []
    for spares in args.spares:
        for chains in args.chains:
            engine.grow_spares, tally, cost = spares, Tally(spares, chains), CostModel()
            for i, (prompt, output) in enumerate(sessions):
                replay_session(engine, counted, f"growth-{spares}-{int(chains)}-{i}", prompt, output, spec,
                               args.grow_forwards, args.width, tally, lookup=args.lookup, cost=cost,
                               record=lines.append if args.record_trace else None)
            rows.append(tally.row(args.draft_cost))
            print(f"spares {spares} chains {int(chains)}: {rows[-1]}", file=sys.stderr, flush=True)
    cols = ("spares", "chains", "rounds", "tokens_per_round", "reuse", "draft_forwards_after_verdict", "mean_nodes",
            "after_chain", "after_chain_reused", "modelled_vs_alone")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    if args.record_trace:
        write_trace(args.record_trace, lines, {
            "source": "specsplit bench growth", "traces": args.trace, "grow_forwards": args.grow_forwards,
            "width": args.width, "spares": args.spares[0], "chains": args.chains[0], "lookup": args.lookup,
            "tree": {"max_nodes": args.max_nodes, "max_depth": args.max_depth, "branch": args.branch},
            "draft": described})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json"}, "draft": described,
                       "sessions": len(sessions), "seconds": round(time.perf_counter() - t0, 1), "rows": rows},
                      f, indent=1, default=str)
    return 0


def write_trace(path: str, lines: list[dict], header: dict) -> None:
    """A round trace (gzip-compressed when ``path`` ends in .gz): a header, then ``lines``."""
    text = "".join(json.dumps(x, separators=(",", ":"), default=str) + "\n"
                   for x in [{"kind": "header", "version": TRACE_VERSION, "time": time.time(), **header}, *lines])
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(text)
