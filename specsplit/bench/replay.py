"""``specsplit bench replay``: a round trace's verify forwards re-run on this device, through the
target engine a target worker runs, against the target alone on the same engine and kernels.

A trace (``SPECSPLIT_TRACE_FILE``, ``specsplit.orchestrator.trace``) records for every round the
committed length at its start (``context_len``, the root being the last), the shape of the tree
the target verified (the ``chosen`` nodes of ``merged``) and how many of its nodes the target
accepted. For each greedy session, in file order, the replay prefills a seeded random prompt of
the recorded length (untimed), then sends one ``VerifyRequest`` per recorded round: a tree of
the recorded shape (random tokens) whose root sits at the recorded context, timed. The verdict
of these weights and tokens is not the recorded one, so the replay commits what the trace
committed: the next request's ``CacheSync`` keeps at most what the recorded round committed
(``base_len`` below the cache's length crops it, as after any round); where the engine accepted
fewer nodes, an untimed root-only request first appends the missing tokens, so the timed forward
holds only the recorded sync tokens and the tree. Recorded accepted 2 in a round at context 50:
the next round runs at context 53, on a cache of 52; the engine kept 50 + its own accepted
tokens, so it is cropped to 52 (it accepted 2 or more) or first brought to 52 (0 or 1). After
every request the engine's cache length is checked against that arithmetic.

The target alone: the same prompt in a second session, then one root-only request per token (the
forward a plain round sends) at each context whose token a replayed round committed, timed right
after that round (before it, every other round), so the machine's drift hits both alike. Decode
figures count the clean rounds (not the prompt's prefill round, nor resends): tokens (accepted
+ 1 each) over the replayed verify ms, and over replayed verify + the draft ms recorded on the
trace's machine. With ``--draft`` (the preset's draft) or ``--draft-config DIR`` (random weights
of DIR/config.json) the draft is replayed too, on the same device, after each clean round as the
fleet runs it: one timed ``DraftRequest`` for a tree of the recorded size and depth (the header's
branch, ``min_path_prob`` 0 so random weights build it whole), then a timed ``GrowRequest`` of
0.9 of the round's verify, the growth the fleet runs during that verify. A round the trace says
re-rooted a grown tree (``reused``) follows a forwarded path of the replayed growth (random
weights build other trees than the real pair: the deepest forwarded node within the recorded
verdict's length), so the draft re-roots as in the fleet; any other round, or one whose growth
left no such path, drafts from scratch at the round's context. "with replayed draft" adds the
draft's and the growth's ms to the verify ms, a serial round's bound; "grown during verify" is
the fleet with the draft on its own device: the growth overlaps the verify, and a round's
draft adds what of the growth outlasts the verify before it plus its own ms. ``--fleet``: the
same rounds through the fleet's processes on loopback, timed as the fleet runs them
(``specsplit.bench.replay_fleet``; ``--overlap``: both engines in this process, on their own
threads and streams). Prints Markdown tables; ``--json FILE`` writes every figure
(``specsplit.bench.replay_report``).

    specsplit bench replay --trace runs/trace.jsonl.gz --max-rounds 200 --json runs/replay.json
    specsplit bench replay --trace a.jsonl --trace b.jsonl --device cuda --target-config .whl/cfg/target \\
        --draft-config .whl/cfg/draft
"""

from __future__ import annotations

import argparse
import sys
import time

from specsplit.bench.replay_report import report
from specsplit.bench.replay_trace import TracedSession, limit, traced_sessions
from specsplit.bench.replayer import (  # noqa: F401 - re-exported: the replay's engine side
    GROW_FRACTION,
    GROW_WIDTH,
    MIN_ROUNDS,
    AloneStep,
    ReplayedRound,
    Replayer,
    ReplayError,
    build_draft,
    build_target,
    run,
    trace_branch,
)
from specsplit.openmp import set_worker_openmp
from specsplit.orchestrator.replay import TraceError, read_trace


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specsplit bench replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", action="append", required=True, metavar="FILE",
                   help="a round trace (.jsonl or .jsonl.gz); repeat for several")
    p.add_argument("--preset", default=None, help="model preset (default: SPECSPLIT_PRESET or qwen-coder)")
    p.add_argument("--target-config", default=None, metavar="DIR",
                   help="random weights of DIR/config.json instead of the preset's target")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights of the preset's configs even where their weights are pulled")
    p.add_argument("--draft", action="store_true", help="replay the draft too: the preset's draft model")
    p.add_argument("--draft-config", default=None, metavar="DIR",
                   help="replay the draft too, on random weights of DIR/config.json")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda where available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the target's dtype (default: bfloat16 on accelerators, SPECSPLIT_TARGET_DTYPE on CPU)")
    p.add_argument("--threads", type=int, default=None, help="CPU: the target's threads (default: a worker's)")
    p.add_argument("--sessions", type=int, default=None, metavar="N", help="replay the first N greedy sessions")
    p.add_argument("--max-rounds", type=int, default=None, metavar="N", help="replay N rounds in all (file order)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt and tree tokens")
    p.add_argument("--max-seconds", type=float, default=None, metavar="S",
                   help="start no round S seconds after the command started (model loads included) and "
                        "report the rounds replayed: a run under an outer time limit still writes its figures")
    arrangement = p.add_mutually_exclusive_group()
    arrangement.add_argument("--fleet", action="store_true",
                   help="replay through the fleet's processes on loopback: a router per role and its worker "
                        "(specsplit.bench.replay_fleet)")
    arrangement.add_argument("--overlap", action="store_true",
                   help="with the draft: both engines in this process, each on its own thread and CUDA stream, "
                        "the growth beside the verify, timed as --fleet times them")
    p.add_argument("--pair", action="store_true",
                   help="--fleet with the draft: both workers in one process (`specsplit pair`: a thread and CUDA "
                        "stream each) instead of one process per role")
    p.add_argument("--draft-reroots", action="store_true",
                   help="--fleet/--overlap: every re-rooting round asks the draft first (SPECSPLIT_GROW_REROOT off); "
                        "default: the orchestrator re-roots the grown tree and the draft's request goes beside the verify")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="also write every figure as JSON to FILE")
    return p.parse_args(argv)


def load_sessions(args) -> list[TracedSession]:
    sessions = [s for path in args.trace for s in traced_sessions(path, read_trace(path))]
    picked = limit(sessions, args.sessions, args.max_rounds)
    if not picked:
        raise TraceError(f"{', '.join(args.trace)}: no greedy round to replay")
    return picked


def _log(msg: str) -> None:
    print(f"replay: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    set_worker_openmp()  # the engine here stands for a target worker: its OpenMP wait
    args = parse(argv)
    try:
        sessions = load_sessions(args)
        import torch  # only now: main() has set OpenMP's environment

        from specsplit.logs import configure_logging

        configure_logging("WARNING")
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if args.pair and not (args.fleet and (args.draft or args.draft_config)):
            raise ReplayError("--pair runs the fleet's two workers in one process: add --fleet and --draft")
        if args.fleet or args.overlap:
            from specsplit.bench.replay_fleet import run_fleet, run_overlap

            described, rounds, alone = (run_fleet if args.fleet else run_overlap)(args, sessions, started, _log)
            report(args, described, sessions, rounds, alone)
            return 0
        engine, described = build_target(args)
        draft, draft_described = build_draft(args)
        if draft is not None:
            described |= {"draft": draft_described | {"backend": draft.backend.describe()}}
        replayer = Replayer(engine, args.seed, draft, trace_branch(args.trace))
        if args.max_seconds is not None:
            replayer.deadline = started + args.max_seconds
        rounds, alone = run(replayer, sessions, progress=_log)
    except (OSError, TraceError, ReplayError) as exc:
        print(f"specsplit bench replay: {exc}", file=sys.stderr)
        return 1
    report(args, described | {"backend": engine.backend.describe()}, sessions, rounds, alone)
    return 0


if __name__ == "__main__":
    sys.exit(main())
