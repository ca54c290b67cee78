"""``specsplit bench longctx``: long contexts, full verification vs SpecPV approximate vs exact.

Each context is real text: Python standard-library source files from this machine, concatenated
in a fixed order, then a function to complete; its last N tokens (the target's tokenizer) are
the prompt. The draft/target pair runs in this process through the same engines the workers use
(``specsplit.local.generate``), greedy, one mode after another on the same prompt, every mode with
the same fixed tree by default (``--tree-budget cost --lookup-max-tokens 8 --tree 16,10,2,0.3``
drafts as the fleet's defaults do: a cost-model budget per mode, prompt lookup). Per context
and mode: verify ms per round (prefill round excluded; partial and full rounds apart), tokens
per round, end-to-end and decode tok/s; for approximate mode, the share of its tokens equal to
full verification's (position by position) and the first divergence. Prints a markdown table,
writes ``--json FILE``.

    specsplit bench longctx --contexts 2048,8192,16384 --json runs/longctx.json
    specsplit bench longctx --preset tiny --contexts 1024,2048 --threshold 512 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

from schemas import SamplingSpec, SpecPVSpec, TreeSpec
from specsplit.config import WorkerSettings
from specsplit.logs import configure_logging
from specsplit.models import ModelSettings, load_model, resolve_model_paths
from specsplit.models.settings import model_dtype
from specsplit.openmp import set_worker_openmp
from specsplit.orchestrator.costmodel import CostModel
from specsplit.orchestrator.state import RoundStats

MODES = ("full", "approx", "exact")
TASK = '''

def merge_sorted(left: list[int], right: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list, in linear time."""
'''


def _load_as_fleet(service: str, path, model_settings, overrides: dict):
    """(model, tokenizer) with the kernels the fleet's worker would run (the role's backend:
    int8 and batch-invariant attention for a CPU target by default), so the figures are the fleet's."""
    from specsplit.backends import build_backend  # torch: only after main() has set OpenMP's environment

    backend = build_backend(service, getattr(model_settings, f"{service}_device"), WorkerSettings(**overrides))
    model, tok = load_model(path, dtype=backend.load_dtype(model_dtype(service, model_settings)),
                            device=getattr(model_settings, f"{service}_device"))
    return backend.prepare(model), tok


def parse(argv):
    p = argparse.ArgumentParser(prog="specsplit bench longctx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="2048,8192,16384", help="comma list of prompt lengths in tokens")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--preset", default=None, help="model preset (default: SPECSPLIT_PRESET or qwen-coder)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--tree", default="16,6,2", help="max_nodes,max_depth,branch[,min_path_prob]")
    p.add_argument("--tree-budget", choices=["cost", "fixed"], default="fixed",
                   help="cost: each round's nodes and draft depth from a cost model, as the fleet's orchestrator "
                        "(a fresh one per mode); fixed: the whole tree")
    p.add_argument("--lookup-max-tokens", type=int, default=0, help="prompt-lookup candidates per round")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sink-blocks", type=int, default=2)
    p.add_argument("--retrieval-blocks", type=int, default=256)
    p.add_argument("--window-blocks", type=int, default=8)
    p.add_argument("--buffer-tokens", type=int, default=128)
    p.add_argument("--threshold", type=int, default=4096)
    p.add_argument("--refresh-every", type=int, default=32)
    p.add_argument("--draft-quantize", choices=["none", "int8"], default="int8", help="as the fleet's .env")
    p.add_argument("--target-quantize", choices=["none", "int8"], default="int8", help="as the fleet's .env")
    p.add_argument("--draft-window", type=int, default=None,
                   help="draft attends to sinks + this many recent tokens past that (default: the fleet's "
                        "SPECSPLIT_DRAFT_WINDOW_TOKENS; 0: the whole context); the same in every mode")
    p.add_argument("--draft-sink", type=int, default=None, help="the draft window's sink tokens (default: the fleet's)")
    p.add_argument("--json", dest="json_path")
    return p.parse_args(argv)


def stdlib_text(min_chars: int) -> str:
    """Standard-library .py files of this interpreter, sorted by path, concatenated until at
    least ``min_chars`` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(f"# file: {path.relative_to(root)}\n{text}\n")
        total += len(parts[-1])
        if total >= min_chars:
            break
    if total < min_chars:
        raise SystemExit(f"specsplit bench longctx: the standard library at {root} has under {min_chars} characters")
    return "".join(parts)


def long_prompts(tokenizer, contexts: list[int]) -> dict[int, list[int]]:
    """{N: the last N - len(task) tokens of the stdlib text + the task's tokens}."""
    task = tokenizer.encode(TASK, add_special_tokens=False)
    need = max(contexts)
    text = stdlib_text(need * 8)
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < need:  # a tokenizer denser than 8 characters a token
        text = stdlib_text(len(text) * 2)
        ids = tokenizer.encode(text, add_special_tokens=False)
    return {n: ids[len(ids) - (n - len(task)):] + task for n in contexts}


class WarmEngines:
    """One context's engines, kept from its first mode for the next ones: their first round
    keeps the prompt's cache from the first mode's prefill instead of computing it again (the
    target all of it, its first round verified fully; the draft all but its last two tokens,
    re-encoding one), so every mode's first round is still a full verification. The prefill is the same computation in every mode (SpecPV only changes
    verification past the threshold, after it), so it is measured once, in the first mode, and
    counted in every mode's end-to-end tok/s; at 16K tokens on a 2-core CPU it takes minutes.
    The rest of the session (round, kept draft tree, SpecPV view) starts afresh."""

    def __init__(self, draft_window=None, backends: dict | None = None):
        self.draft_window = draft_window  # a DraftWindow (None: the whole context)
        self.backends = backends or {}  # role -> the engines' Backend (default: the engines' own)
        self.engines: dict[str, object] = {}
        self.rounds: list = []  # (partial, verify_ms, prefill) of the current mode's verifies
        self.first_round_s = 0.0  # wall time of the current mode's first draft + verify

    def make(self, role: str):
        # torch: only after main() has set OpenMP's environment
        from specsplit.engine.draft import DraftEngine
        from specsplit.engine.target import TargetEngine

        warm, base = self, TargetEngine if role == "target" else DraftEngine

        class Warm(base):
            def handle(self, msg):
                first = getattr(msg, "round", None) == 0
                t0 = time.perf_counter()
                if first:
                    msg = self._reuse(msg)
                reply = super().handle(msg)
                if first:
                    warm.first_round_s += time.perf_counter() - t0
                if role == "target" and hasattr(reply, "partial"):
                    warm.rounds.append((reply.partial, reply.verify_ms, first or msg.sync.append_token_ids != []))
                return reply

            def _reuse(self, msg):
                session, sync = self.store.get(msg.session_id), getattr(msg, "sync", None)
                n = len(sync.append_token_ids) if sync is not None else 0
                if session is None or sync.base_len != 0 or n < 2 or session.kv.length < n - 1:
                    return msg
                session.last_round, session.draft_tree, session.specpv = -1, None, None
                if role == "target":  # the whole prompt as the first mode prefilled it (a long one's
                    # chunks on the prompt attention), verified fully this round
                    keep = sync.model_copy(update={"base_len": n, "append_token_ids": []})
                    return msg.model_copy(update={"sync": keep, "confirm": True})
                keep = sync.model_copy(update={"base_len": n - 1, "append_token_ids": sync.append_token_ids[-1:]})
                return msg.model_copy(update={"sync": keep})

        def make(model, limits):
            if role not in self.engines:
                extra = {"backend": self.backends[role]} if role in self.backends else {}
                self.engines[role] = Warm(model, limits, **extra) if role == "target" else \
                    Warm(model, limits, window=self.draft_window, **extra)
            return self.engines[role]

        return make


def run_mode(draft, target, prompt: list[int], mode: str, args, spec, warm: WarmEngines,
             prefill_s: float | None = None) -> dict:
    """One mode on one context; ``prefill_s``: the first mode's prefill (draft and target first
    rounds), counted instead of this mode's cache-reusing first round."""
    from specsplit.local import generate  # torch: only after main() has set OpenMP's environment

    warm.rounds, warm.first_round_s = [], 0.0
    stats = RoundStats()
    specpv = None if mode == "full" else spec.model_copy(update={"exact": mode == "exact"})
    t0 = time.perf_counter()
    out = generate(draft, target, prompt, max_new_tokens=args.max_new_tokens, tree=args.tree_spec,
                   sampling=SamplingSpec(), stats=stats, specpv=specpv,
                   cost_model=CostModel() if args.tree_budget == "cost" else None,
                   lookup_max_tokens=args.lookup_max_tokens,
                   make_target_engine=warm.make("target"), make_draft_engine=warm.make("draft"))
    wall = time.perf_counter() - t0
    own_prefill_s = warm.first_round_s
    steady = [(p, ms) for p, ms, prefill in warm.rounds if not prefill]
    part = [ms for p, ms in steady if p]
    full = [ms for p, ms in steady if not p]
    decode_s = max(1e-9, wall - own_prefill_s)
    shared = own_prefill_s if prefill_s is None else prefill_s
    return {
        "tokens": out, "new_tokens": len(out), "rounds": stats.rounds, "partial_rounds": stats.partial_rounds,
        "rolled_back": stats.rolled_back, "tokens_per_round": len(out) / max(1, stats.rounds),
        "verify_ms_per_round": _mean([ms for _, ms in steady]), "verify_ms_partial": _mean(part),
        "verify_ms_full": _mean(full), "prefill_ms": shared * 1e3, "prefill_reused": prefill_s is not None,
        "first_round_ms": own_prefill_s * 1e3, "wall_s": decode_s + shared,
        "tok_s": len(out) / (decode_s + shared), "decode_tok_s": len(out) / decode_s,
    }


def _mean(xs) -> float | None:
    return sum(xs) / len(xs) if xs else None


def agreement(approx: list[int], full: list[int]) -> tuple[float, int | None]:
    same = sum(a == b for a, b in zip(approx, full))
    first = next((i for i, (a, b) in enumerate(zip(approx, full)) if a != b), None)
    if first is None and len(approx) != len(full):
        first = min(len(approx), len(full))
    return same / max(1, len(full)), first


def table(rows: list[dict]) -> str:
    head = ("| context | mode | verify ms/round | partial / full ms | tokens/round | tok/s | decode tok/s "
            "| rounds (partial) | rolled back | same as full | first divergence |")
    lines = [head, "|" + "---|" * 11]
    def f(x, d=1) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    for r in rows:
        same = "-" if r.get("same_as_full") is None else f"{100 * r['same_as_full']:.0f}%"
        first = "-" if r.get("first_divergence") is None else str(r["first_divergence"])
        lines.append(
            f"| {r['context']} | {r['mode']} | {f(r['verify_ms_per_round'])} | {f(r['verify_ms_partial'])} / "
            f"{f(r['verify_ms_full'])} | {r['tokens_per_round']:.2f} | {r['tok_s']:.1f} | {r['decode_tok_s']:.1f} "
            f"| {r['rounds']} ({r['partial_rounds']}) | {r['rolled_back']} | {same} | {first} |")
    return "\n".join(lines)


def summarize(rows: list[dict], contexts: list[int], threshold: int) -> dict:
    by = {(r["context"], r["mode"]): r for r in rows}
    big = max(contexts)
    past = [c for c in contexts if c > threshold] or [big]
    out = {}
    for mode in MODES:
        lo, hi = by.get((min(past), mode)), by.get((big, mode))
        if lo and hi and lo["verify_ms_per_round"] and hi["verify_ms_per_round"]:
            out[f"{mode}_verify_growth"] = hi["verify_ms_per_round"] / lo["verify_ms_per_round"]
        if mode != "full" and hi and by.get((big, "full")):
            out[f"{mode}_speedup_at_{big}"] = hi["tok_s"] / by[(big, "full")]["tok_s"]
            out[f"{mode}_decode_speedup_at_{big}"] = hi["decode_tok_s"] / by[(big, "full")]["decode_tok_s"]
    out["growth_from_context"] = min(past)
    return out


def measure(draft, target, prompts: dict[int, list[int]], modes: list[str], args, spec, window, rows: list,
            backends: dict | None = None):
    """Every mode on every context (ascending), rows appended to ``rows``; yields each context
    once its modes are measured."""
    for c in sorted(prompts):
        outs, warm, prefill_s = {}, WarmEngines(window, backends), None
        for mode in modes:
            print(f"context {c}: {mode} ...", file=sys.stderr, flush=True)
            r = run_mode(draft, target, prompts[c], mode, args, spec, warm, prefill_s)
            prefill_s = r["prefill_ms"] / 1e3
            outs[mode] = r["tokens"]
            rows.append({"context": c, "mode": mode, **{k: v for k, v in r.items() if k != "tokens"}})
        for row in rows[-len(modes):]:
            if "full" in outs and row["mode"] != "full":
                row["same_as_full"], row["first_divergence"] = agreement(outs[row["mode"]], outs["full"])
                row["identical_to_full"] = outs[row["mode"]] == outs["full"]
        yield c


def settle(args):
    """(contexts, modes, SpecPVSpec, the draft's DraftWindow) from parsed arguments; sets
    ``args.tree_spec`` and the draft window's defaults (the fleet's)."""
    from specsplit.engine.draftview import DraftWindow  # torch: only after main() has set OpenMP's environment

    contexts = sorted({int(c) for c in args.contexts.split(",") if c})
    modes = [m for m in args.modes.split(",") if m]
    if not contexts or any(c < 16 for c in contexts) or set(modes) - set(MODES) or not modes:
        raise SystemExit(f"specsplit bench longctx: --contexts takes token counts >= 16, --modes a comma list of "
                         f"{', '.join(MODES)}")
    n, d, b, *rest = args.tree.split(",")
    args.tree_spec = TreeSpec(max_nodes=int(n), max_depth=int(d), branch=int(b),
                              min_path_prob=float(rest[0]) if rest else 0.0)
    spec = SpecPVSpec(block_size=args.block_size, sink_blocks=args.sink_blocks, retrieval_blocks=args.retrieval_blocks,
                      window_blocks=args.window_blocks, buffer_tokens=args.buffer_tokens, threshold=args.threshold,
                      refresh_every=args.refresh_every)
    fleet = WorkerSettings()
    args.draft_window = fleet.draft_window_tokens if args.draft_window is None else args.draft_window
    args.draft_sink = fleet.draft_sink_tokens if args.draft_sink is None else args.draft_sink
    return contexts, modes, spec, DraftWindow(sink_tokens=args.draft_sink, window_tokens=args.draft_window)


def main(argv=None) -> int:
    set_worker_openmp()  # the engines here stand for a target worker: its OpenMP wait
    args = parse(argv)
    contexts, modes, spec, window = settle(args)
    import torch  # only now: main() has set OpenMP's environment

    configure_logging("WARNING")
    if args.threads:
        torch.set_num_threads(args.threads)
    ms = ModelSettings(**({"preset": args.preset} if args.preset else {}))
    paths = resolve_model_paths(ms)
    quantize = {"draft_quantize": args.draft_quantize, "target_quantize": args.target_quantize}
    target, tok = _load_as_fleet("target", paths.target, ms, quantize)
    draft = _load_as_fleet("draft", paths.draft, ms, quantize)[0]
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    prompts = long_prompts(tok, contexts)
    rows = []
    for c in measure(draft, target, prompts, modes, args, spec, window, rows):
        if args.json_path:  # after every context: a long run that stops keeps what it measured
            write_json(args, spec, paths, rows, summarize(rows, contexts, spec.threshold), done=c == contexts[-1])
    summary = summarize(rows, contexts, spec.threshold)
    print(table(rows))
    print(json.dumps(summary, indent=2))
    if args.json_path:
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0


def write_json(args, spec, paths, rows: list[dict], summary: dict, done: bool) -> None:
    import torch  # only after main() has set OpenMP's environment

    Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "tree_spec"} | {
        "spec": spec.model_dump(), "draft": str(paths.draft), "target": str(paths.target),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    Path(args.json_path).write_text(json.dumps({"config": config, "rows": rows, "summary": summary,
                                                "complete": done}, indent=2))
