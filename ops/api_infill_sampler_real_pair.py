"""llama.vim's sampled ``/infill`` on the real pair: llama.cpp's ``infill`` sampler applied by the
fleet, against the chain without it (what the fleet did before: top-k 40 / top-p 0.99 at
temperature 1) and, with ``--llama-server-bin``, llama-server itself on the same bodies.

1. ``honcho start`` of the repository's Procfile and .env (the default preset, free ports, the
   n-gram cache off): every gap of ``ops/api_fim_real_pair.GAPS`` asked with llama.vim's body
   (its files, ``n_indent``, top-k 40, top-p 0.99, no temperature) under ``--seeds`` seeds, each
   way in turn (alternating the order): the answer's tokens, time, and the tree's drafted and
   accepted tokens (``timings``).
2. The oracle, after the fleet stopped: the target (transformers, float32) forwards each prompt
   with its answer, and each token of an answer must be one llama.cpp's infill sampler leaves at
   its place (``specsplit.engine.infill`` on the top-40 / top-p 0.99 candidates); the share is
   reported for both ways (float32 here, int8 in the worker: a token at a threshold may differ).

    python ops/api_infill_sampler_real_pair.py --json ops/results/api-infill-sampler-real-pair-cpu2-avx512-epyc.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.api_fim_real_pair import GAPS
from ops.api_infill_real_pair import layout, llama_server, vim_body
from ops.api_real_pair import check, new_report, report_checks, served_fleet

WAYS = {"infill": ["top_k", "top_p", "infill"], "top-k/top-p": ["top_k", "top_p"]}


def sampled_body(before: str, after: str, n_predict: int, samplers: list[str], seed: int) -> dict:
    """llama.vim's request as it sends it (top-k 40, top-p 0.99), ``samplers`` and a seed."""
    return {**vim_body(before, after, n_predict), "top_k": 40, "samplers": samplers, "seed": seed,
            "response_fields": None, "return_tokens": True}


def ask(url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    res = httpx.post(f"{url}/infill", json=body, timeout=600).json()
    timings = res.get("timings", {})
    return {"wall_s": round(time.perf_counter() - t0, 3), "tokens": res.get("tokens", []),
            "predicted_n": timings.get("predicted_n"), "content": res["content"], "stop_type": res.get("stop_type"),
            "draft_n": timings.get("draft_n"), "draft_n_accepted": timings.get("draft_n_accepted")}


def left_by_sampler(model, vocab, prompt: list[int], answer: list[int]) -> list[bool]:
    """For each token of ``answer``: is it one the infill sampler leaves at its place?"""
    import torch

    from schemas import SamplingSpec
    from specsplit.engine import sampling as S

    if not answer:
        return []
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer[:-1]])).logits[0, len(prompt) - 1:].float()
    probs, cand = S.top_k_rows(logits, 40, SamplingSpec(temperature=1.0, top_k=40, top_p=0.99))
    keep, forced = vocab.keep(cand.numpy(), probs.numpy())
    return [bool(t == vocab.eot) if forced[i] else t in set(cand[i][torch.from_numpy(keep[i])].tolist())
            for i, t in enumerate(answer)]


def summary(runs: list[dict]) -> dict:
    drafted = sum(r["draft_n"] or 0 for r in runs)
    return {"answers": len(runs), "tokens_mean": round(statistics.mean(len(r["tokens"]) for r in runs), 1),
            "wall_s_mean": round(statistics.mean(r["wall_s"] for r in runs), 3),
            "tok_s": round(sum(len(r["tokens"]) for r in runs) / sum(r["wall_s"] for r in runs), 2),
            "accepted_per_drafted": round(sum(r["draft_n_accepted"] or 0 for r in runs) / drafted, 3)
            if drafted else None,
            "ended_by_eog": sum(r["stop_type"] == "eos" for r in runs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--llama-server-bin", default=None, help="a llama.cpp build's bin dir with llama-server")
    p.add_argument("--repack", action="store_true", help="llama-server with its repacked weights (its default; "
                   "off by default here: it crashed on an AMX Xeon)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from specsplit.api.tokenizer import ServedTokenizer
    from specsplit.models import ModelSettings, resolve_model_paths

    target_dir = resolve_model_paths(ModelSettings()).target
    tok = ServedTokenizer(target_dir)
    report = new_report(max_new_tokens=args.max_new_tokens, seeds=args.seeds, ways=WAYS)
    runs: dict[str, list[dict]] = {}
    with served_fleet("specsplit-api-infill-sampler-", report, SPECSPLIT_LOOKUP_CACHE_KEYS="0") as (url, _, tmp), \
            contextlib.ExitStack() as stack:
        urls = {way: url for way in WAYS}
        if args.llama_server_bin:
            from specsplit.bench.llamacpp import kept_gguf

            urls["llama-server infill"] = stack.enter_context(llama_server(
                Path(args.llama_server_bin).expanduser(), kept_gguf(ModelSettings()), None, 2,
                tmp / "llama-server.log", repack=args.repack))
        names = list(urls)
        ask(url, sampled_body(*GAPS[0], 8, WAYS["infill"], 0))  # (first forwards of each shape)
        for seed in range(args.seeds):
            for i, (before, after) in enumerate(GAPS):
                for way in names if (seed + i) % 2 == 0 else names[::-1]:
                    samplers = WAYS.get(way, WAYS["infill"])
                    body = sampled_body(before, after, args.max_new_tokens, samplers, 1000 * seed + i)
                    runs.setdefault(way, []).append({"gap": i, "seed": seed, **ask(urls[way], body),
                                                     "prompt": layout(tok, body)})
        for way in names:
            print(f"--- {way}, seed 0 ---")
            for r in runs[way][:len(GAPS)]:
                print(f"{GAPS[r['gap']][0]}\033[1m{r['content']}\033[0m{GAPS[r['gap']][1]}", flush=True)
    from transformers import AutoModelForCausalLM

    from specsplit.engine.infill import InfillVocab

    model = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype="float32").eval()
    vocab = InfillVocab.for_tokenizer(tok.tok, target_dir, model.config.vocab_size)
    table = {}
    for way in WAYS:
        left = [ok for r in runs[way] for ok in left_by_sampler(model, vocab, r.pop("prompt"), r["tokens"])]
        table[way] = {**summary(runs[way]), "tokens_the_sampler_leaves": round(sum(left) / max(1, len(left)), 4)}
    if "llama-server infill" in runs:
        for r in runs["llama-server infill"]:
            r.pop("prompt")
            r["tokens"] = tok.encode_text(r["content"])  # (its tokens as text: for the counts only)
        table["llama-server infill"] = summary(runs["llama-server infill"])
    print(f"\n{'way':<22}{'tokens':>8}{'tok/s':>8}{'accepted':>10}{'ends':>6}{'left':>8}")
    for way, row in table.items():
        print(f"{way:<22}{row['tokens_mean']:>8}{row['tok_s']:>8}{row['accepted_per_drafted'] or 0:>10}"
              f"{row['ended_by_eog']:>6}{row.get('tokens_the_sampler_leaves', float('nan')):>8}")
    check(report, "infill answers: >= 97% of tokens are ones the infill sampler leaves (float32 oracle)",
          table["infill"]["tokens_the_sampler_leaves"] >= 0.97)
    report["table"], report["runs"] = table, runs
    return report_checks(report, tmp, args.json)


if __name__ == "__main__":
    sys.exit(main())
