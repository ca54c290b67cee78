"""``specsplit bench``: the target alone vs transformers assisted generation vs the SpecSplit fleet.

Alternates the three systems prompt by prompt in one invocation (the order rotates), with the
same prompt formatting (the tokenizer's chat template), the same dtypes and the same threads.
Prints a markdown table, writes ``--json FILE`` (per-prompt rows and ``summary.speedup_vs_target``
/ ``summary.speedup_vs_assisted``: ratios of total tokens over total time) and a PNG plot.
With a llama.cpp build (--llamacpp-bin DIR or SPECSPLIT_LLAMACPP_BIN), ``--systems ...,llamacpp``
adds the target alone through llama.cpp on the same GGUF (``summary.speedup_vs_llamacpp``).
``--systems ...,specsplit_ref --ref-source DIR`` adds a second fleet, with the same settings,
running the code of the checkout DIR: an A/B of a change against a commit in one run
(``summary.speedup_vs_ref``, ``identical_to_ref``).

    specsplit bench --limit 20 --max-new-tokens 128 --json runs/bench.json
    specsplit bench --prompts chat10 --systems target,specsplit,llamacpp --llamacpp-bin DIR
    git worktree add /tmp/before HEAD~1
    specsplit bench --limit 10 --systems target,specsplit,specsplit_ref --ref-source /tmp/before
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

from specsplit.bench import import_torch_as_users_run_it
from specsplit.bench import llamacpp as LL
from specsplit.bench import report as R
from specsplit.bench.systems import (
    Answer,
    FleetRunner,
    HFRunner,
    checkout_commit,
    checkout_env,
    humaneval_prompts,
    jsonl_prompts,
    require_checkout,
)

TRACE_ENV = "SPECSPLIT_TRACE_FILE"  # the orchestrator's per-round trace (JSON lines), where it has one


def absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def parse(argv):
    p = argparse.ArgumentParser(prog="specsplit bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", help="JSONL file with a 'prompt' field per line, or a shipped set: chat10 "
                                     "(default: HumanEval)")
    p.add_argument("--offset", type=int, default=0, help="skip this many prompts first")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default=None, help="model preset (default: SPECSPLIT_PRESET or qwen-coder)")
    p.add_argument("--systems", default="target,assisted,specsplit",
                   help="comma list of: target, target_packed (the target alone with the fleet's packed weights), "
                        "assisted, specsplit, specsplit_ref (the same fleet on another checkout's code, needs "
                        "--ref-source), llamacpp (the target alone through llama.cpp, needs --llamacpp-bin)")
    p.add_argument("--ref-source", type=absolute, default=None, metavar="DIR",
                   help="a checkout of this repository (e.g. `git worktree add /tmp/before COMMIT`) whose code the "
                        "specsplit_ref fleet runs, with the specsplit fleet's settings")
    p.add_argument("--record-trace", type=absolute, default=None, metavar="FILE",
                   help=f"the specsplit fleet's orchestrator writes one JSON line per round to FILE ({TRACE_ENV}); "
                        "not the specsplit_ref fleet's")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch threads of the baselines")
    p.add_argument("--draft-threads", type=int, default=None, help="default: the workers' default")
    p.add_argument("--target-threads", type=int, default=None, help="default: the workers' default")
    p.add_argument("--prefill-threads", type=int, default=None, help="workers' threads for prompt prefills (default: every core)")
    p.add_argument("--draft-dtype", default=None)
    p.add_argument("--target-dtype", default=None)
    p.add_argument("--engine", choices=["llamacpp", "torch"], default=os.environ.get("SPECSPLIT_BENCH_ENGINE", "torch"),
                   help="the fleet's kernels for both roles (SPECSPLIT_DRAFT/TARGET_ENGINE); the target row runs "
                        "the same ones: torch = transformers (int8), as `honcho start` runs them; llamacpp = the "
                        "preset's GGUFs on llama.cpp")
    p.add_argument("--draft-engine", choices=["llamacpp", "torch"], default=None,
                   help="the fleet draft's kernels when they differ from --engine's (the target row follows --engine)")
    p.add_argument("--draft-quantize", choices=["none", "int8"], default="int8")
    p.add_argument("--tree-budget", choices=["cost", "fixed"], default="cost",
                   help="the fleet's per-round tree budget: a cost model, or the whole tree")
    p.add_argument("--lookup-max-tokens", type=int, default=8, help="prompt-lookup tokens per tree (0: off)")
    p.add_argument("--speculator", choices=["draft", "lookup"], default="draft",
                   help="the fleet's candidates (SPECSPLIT_SPECULATOR): the draft worker's trees plus prompt "
                        "lookup, or prompt lookup alone (no draft worker is started)")
    p.add_argument("--target-quantize", choices=["none", "int8"], default="int8",
                   help="the fleet's target kernels; the target and assisted rows use the same ones")
    p.add_argument("--tree", default="16,10,2,0.3", help="max_nodes,max_depth,branch[,min_path_prob] of the fleet's trees")
    p.add_argument("--grow", action=argparse.BooleanOptionalAction, default=True,
                   help="the draft grows its tree while the target verifies (greedy)")
    p.add_argument("--assisted-tokens", default="auto", help="'auto' tunes it on the first prompt, or an int")
    p.add_argument("--llamacpp-bin", default=os.environ.get(LL.BIN_ENV) or None,
                   help=f"a llama.cpp build's bin dir with {LL.BINARY} (default: {LL.BIN_ENV})")
    p.add_argument("--llamacpp-model", default=None,
                   help="GGUF file for llamacpp (default: the target's GGUF kept by `specsplit models pull --keep`)")
    p.add_argument("--llamacpp-threads", type=int, default=None, help="default: --threads")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --json)")
    p.add_argument("--chat", choices=["auto", "on", "off"], default="auto")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fleet_drafts(args) -> int:
    """Draft workers the bench's fleet starts: none for prompt lookup alone."""
    return 0 if args.speculator == "lookup" else 1


def fleet_env(args, model_settings) -> dict:
    n, d, b, *rest = args.tree.split(",")
    env = {"SPECSPLIT_TREE_MAX_NODES": n, "SPECSPLIT_TREE_MAX_DEPTH": d, "SPECSPLIT_TREE_BRANCH": b,
           "SPECSPLIT_TREE_MIN_PATH_PROB": rest[0] if rest else None,
           "SPECSPLIT_GROW": str(args.grow).lower(), "SPECSPLIT_DRAFT_THREADS": args.draft_threads,
           "SPECSPLIT_TARGET_THREADS": args.target_threads, "SPECSPLIT_PREFILL_THREADS": args.prefill_threads,
           "SPECSPLIT_DRAFT_QUANTIZE": args.draft_quantize, "SPECSPLIT_TARGET_QUANTIZE": args.target_quantize,
           "SPECSPLIT_TREE_BUDGET": args.tree_budget, "SPECSPLIT_LOOKUP_MAX_TOKENS": args.lookup_max_tokens,
           "SPECSPLIT_SPECULATOR": args.speculator,
           "SPECSPLIT_DRAFT_ENGINE": args.draft_engine or args.engine, "SPECSPLIT_TARGET_ENGINE": args.engine,
           "SPECSPLIT_DRAFT_DTYPE": args.draft_dtype, "SPECSPLIT_TARGET_DTYPE": args.target_dtype,
           TRACE_ENV: args.record_trace,
           "SPECSPLIT_LOG_LEVEL": "INFO"}  # the fleet's logs go to files; readiness is read from them
    return {k: str(v) for k, v in env.items() if v is not None}


def main(argv=None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: stop the fleet
    args = parse(argv)
    import_torch_as_users_run_it()  # the baselines' OpenMP wait; before anything imports torch
    from specsplit.backends import default_prefill_threads, default_threads

    args.draft_threads = args.draft_threads or default_threads("draft")  # recorded in the JSON config
    args.target_threads = args.target_threads or default_threads("target", args.speculator)
    args.prefill_threads = args.prefill_threads or default_prefill_threads()
    from specsplit.logs import configure_logging
    from specsplit.models import ModelSettings, load_model, resolve_model_paths
    from specsplit.produce import PromptCodec
    from specsplit.workers import model_dtype

    configure_logging("WARNING")
    ms = ModelSettings(**({"preset": args.preset} if args.preset else {}))
    args.draft_dtype = args.draft_dtype or model_dtype("draft", ms)
    args.target_dtype = args.target_dtype or model_dtype("target", ms)
    systems = check_systems(args)
    if "llamacpp" in systems:  # before any model loads: fail fast without a build or a GGUF
        if args.temperature > 0:
            raise SystemExit("specsplit bench: the llamacpp system runs greedy only (--temperature 0)")
        llama_bin = LL.find_binary(args.llamacpp_bin)
        args.llamacpp_model = str(Path(args.llamacpp_model).expanduser() if args.llamacpp_model else LL.kept_gguf(ms))
        args.llamacpp_threads = args.llamacpp_threads or args.threads
    paths = resolve_model_paths(ms)
    texts = (jsonl_prompts(args.prompts) if args.prompts else humaneval_prompts())[args.offset: args.offset + args.limit]
    codec = PromptCodec(paths.target, chat=args.chat)
    encoded = [codec.encode(t) for t in texts]

    llama = (LL.LlamaCppRunner(llama_bin, Path(args.llamacpp_model), args.llamacpp_threads, codec.tok)
             if "llamacpp" in systems else None)
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-bench-"))
    fleets, runners = create_fleets(args, ms, systems, tmp), {}
    try:
        for name, fleet in fleets.items():
            fleet.start(fleet_drafts(args), 1)
            log(f"{name}: fleet starting (logs in {fleet.tmp})")
        hf = llama_target = None
        if args.engine == "llamacpp" and "target" in systems:
            from specsplit.bench.systems import LlamaTargetRunner
            from specsplit.models.loading import resolve_gguf

            llama_target = LlamaTargetRunner(resolve_gguf("target", ms), args.threads, codec.stop_token_ids)
        if {"target", "target_packed", "assisted"} & set(systems) - ({"target"} if llama_target else set()):
            from specsplit.backends import CpuBackend

            # the target alone runs the fleet target's kernels (int8 / packed weights), so the
            # speculation gain stays separable from the kernel gain
            fleet_kernels = CpuBackend(args.threads, args.threads, quantize=args.target_quantize)
            target, tok = load_model(paths.target, dtype=fleet_kernels.load_dtype(args.target_dtype))
            target = fleet_kernels.prepare(target)
            draft = load_model(paths.draft, dtype=args.draft_dtype)[0] if "assisted" in systems else None
            hf = HFRunner(target, draft, codec.stop_token_ids, tok.pad_token_id or codec.stop_token_ids[0],
                          args.temperature, args.seed)
            if "target_packed" in systems:
                from specsplit.models.packing import pack_linear_weights

                hf.packed_target = load_model(paths.target, dtype=args.target_dtype)[0]
                log(f"target_packed: {pack_linear_weights(hf.packed_target)} Linear layers packed")
        connect_fleets(args, fleets, runners, codec.stop_token_ids, encoded[0])
        if hf is not None and "assisted" in systems:
            if args.assisted_tokens == "auto":
                best = hf.tune_assisted(encoded[0], min(48, args.max_new_tokens), log, assisted_drafts(hf.draft))
                log(f"assisted generation tuned: {best}")
            else:
                hf.assisted_kwargs = {"num_assistant_tokens": int(args.assisted_tokens),
                                      "num_assistant_tokens_schedule": "constant"}
        rows = run_all(args, systems, texts, encoded, hf, runners, llama, llama_target)
    finally:
        if llama_target is not None:
            llama_target.close()
        for runner in runners.values():
            runner.close()
        for fleet in fleets.values():
            fleet.stop()
    summary = R.summarize(rows)
    print(R.markdown(rows, summary))
    config = {k: v for k, v in vars(args).items()} | {"draft": str(paths.draft), "target": str(paths.target),
                                                       "assisted_kwargs": hf.assisted_kwargs if hf else None,
                                                       "cpu_count": os.cpu_count(),
                                                       "ref_commit": checkout_commit(Path(args.ref_source))
                                                       if args.ref_source else None}
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        R.write_json(args.json_path, config, rows, summary)
        plot_path = args.plot or str(Path(args.json_path).with_suffix(".png"))
        R.plot(plot_path, rows, summary)
        log(f"wrote {args.json_path} and {plot_path}")
    return 0


def check_systems(args) -> list[str]:
    """The systems --systems names, each known and given what it needs (before any model loads)."""
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(R.SYSTEMS)
    if unknown or not systems:
        raise SystemExit(f"specsplit bench: --systems takes a comma list of {', '.join(R.SYSTEMS)} (got {args.systems!r})")
    if ("specsplit_ref" in systems) != bool(args.ref_source):
        raise SystemExit("specsplit bench: the specsplit_ref system and --ref-source DIR go together")
    return systems


def create_fleets(args, model_settings, systems: list[str], tmp: Path) -> dict:
    """A fleet (not started) for each fleet system in ``systems``, logging in tmp/NAME, all with
    fleet_env's settings; specsplit_ref's runs --ref-source's code and records no trace (that
    code may not know the setting). Exits before anything starts when specsplit_ref's processes
    would not import --ref-source's packages."""
    from specsplit.launch import Fleet

    fleets = {}
    if args.record_trace and "specsplit" in systems:
        Path(args.record_trace).parent.mkdir(parents=True, exist_ok=True)
    taken: set[int] = set()
    for name in (n for n in R.FLEETS if n in systems):
        ref = name == "specsplit_ref"
        for _ in range(20):  # each fleet picks free ports on its own, none bound yet: draw again on a clash
            fleet = Fleet.create(tmp / name, preset=model_settings.preset, threads=1, **fleet_env(args, model_settings),
                                 **(checkout_env(Path(args.ref_source)) if ref else {}))
            if not taken & set(fleet.ports.values()):
                break
        else:
            raise SystemExit(f"specsplit bench: no free ports for {name} apart from the other fleets'; run it again")
        taken |= set(fleet.ports.values())
        fleets[name] = fleet
        if ref:
            fleets[name].env.pop(TRACE_ENV, None)  # fleet_env's, or one the shell set
            found = require_checkout(Path(args.ref_source), fleets[name].env)
            log(f"specsplit_ref runs {args.ref_source}: {', '.join(found.values())}")
    return fleets


def connect_fleets(args, fleets: dict, runners: dict, stop_ids: list[int], warm_ids: list[int]) -> None:
    """Waits for each started fleet and adds its client to ``runners`` (the caller closes them,
    even after a failure here), warmed on one prompt."""
    from schemas import SamplingSpec

    for name, fleet in fleets.items():
        fleet.wait_ready(drafts=fleet_drafts(args), timeout_s=900)
        runners[name] = FleetRunner(fleet.orchestrator, stop_ids,
                                    SamplingSpec(temperature=args.temperature, seed=args.seed))
        runners[name].start()
        runners[name].warm(warm_ids)


def assisted_drafts(draft) -> dict:
    """The draft variants assisted generation is tuned over: as loaded, and int8 dynamic (the
    fastest draft on this CPU, which the fleet can use too), so the comparison is fair."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        int8 = torch.ao.quantization.quantize_dynamic(draft, {torch.nn.Linear}, dtype=torch.qint8, inplace=False)
    return {str(next(draft.parameters()).dtype).removeprefix("torch."): draft, "int8-dynamic": int8}


def run_all(args, systems, texts, encoded, hf, fleet_runners: dict, llama=None, llama_target=None) -> list[dict]:
    from tqdm import tqdm

    target = llama_target or hf
    calls = {"target": (lambda ids: target.target_alone(ids, args.max_new_tokens)),
             "target_packed": (lambda ids: hf.target_alone(ids, args.max_new_tokens, hf.packed_target)),
             "assisted": (lambda ids: hf.assisted(ids, args.max_new_tokens)),
             **{n: (lambda ids, n=n: fleet_runners[n](ids, args.max_new_tokens)) for n in fleet_runners},
             "llamacpp": (lambda ids: llama(ids, args.max_new_tokens))}
    rows = []
    for i, (text, ids) in enumerate(tqdm(list(zip(texts, encoded)), desc="bench", file=sys.stderr)):
        order = systems[i % len(systems):] + systems[: i % len(systems)]  # rotate to cancel drift
        answers: dict[str, Answer] = {}
        for name in order:
            answers[name] = calls[name](ids)
        row = R.make_row(args.offset + i, text, len(ids), {n: answers[n] for n in systems},
                         greedy=args.temperature == 0)
        if row.get("identical_to_target") is False and llama_target is not None:
            row["divergence"] = llama_target.divergence(ids, answers["target"].token_ids,
                                                        answers["specsplit"].token_ids, row["first_divergence"])
            log(f"prompt {args.offset + i}: {row['divergence']['cause']}")
        rows.append(row)
        log(" ".join(f"{n}={answers[n].tok_s:.2f}" for n in systems) + " tok/s"
            + "".join(f" {key}={row[key]}" for key, *_ in R.IDENTITY if key in row))
    return rows


if __name__ == "__main__":
    sys.exit(main())
