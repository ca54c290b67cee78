"""Rows, summary ratios, the markdown table and the PNG plot of `specsplit bench`."""

from __future__ import annotations

import json
from pathlib import Path

# target_packed (optional, not in the default set): the target alone through transformers
# generate with the same prepacked oneDNN weights the fleet's target uses, to show how much of
# the speedup is the kernels and how much is speculation. llamacpp (optional): the target alone
# through llama.cpp on the same GGUF, the anchor of issue #13
SYSTEMS = ("target", "target_packed", "assisted", "specsplit", "llamacpp")
BASELINES = ("target", "target_packed", "assisted", "llamacpp")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def make_row(i: int, prompt: str, n_prompt: int, answers: dict, greedy: bool = True) -> dict:
    row = {"prompt_index": i, "prompt_head": prompt[:60], "prompt_tokens": n_prompt}
    for name, ans in answers.items():
        row[name] = {"new_tokens": ans.new_tokens, "seconds": round(ans.seconds, 4), "tok_s": round(ans.tok_s, 3),
                     **ans.extra}
    spec = answers.get("specsplit")
    if spec is not None:
        row["specsplit"].update(rounds=spec.rounds, accepted=spec.accepted, drafted=spec.drafted,
                                mean_accepted=round((spec.accepted + spec.rounds) / spec.rounds, 3) if spec.rounds else 0.0,
                                acceptance_rate=round(spec.accepted / spec.drafted, 4) if spec.drafted else 0.0)
        if "target" in answers and greedy:  # sampled outputs are compared by distribution, not tokens
            row["identical_to_target"] = spec.token_ids == answers["target"].token_ids
            row["first_divergence"] = first_divergence(spec.token_ids, answers["target"].token_ids)
    llama = answers.get("llamacpp")
    if llama is not None and "target" in answers and greedy:  # the GGUF's quantized weights vs the target's
        row["llamacpp_identical_to_target"] = llama.token_ids == answers["target"].token_ids
        row["llamacpp_first_divergence"] = first_divergence(llama.token_ids, answers["target"].token_ids)
    return row


def summarize(rows: list[dict]) -> dict:
    totals = {}
    for name in SYSTEMS:
        have = [r[name] for r in rows if name in r]
        if have:
            toks = sum(h["new_tokens"] for h in have)
            secs = sum(h["seconds"] for h in have)
            totals[name] = {"tokens": toks, "seconds": round(secs, 3), "tok_s": round(toks / secs, 3) if secs else 0.0}
    out = {"prompts": len(rows), "totals": totals}
    llama_ident = [r["llamacpp_identical_to_target"] for r in rows if "llamacpp_identical_to_target" in r]
    if llama_ident:
        out["llamacpp_identical_to_target"] = f"{sum(llama_ident)}/{len(llama_ident)}"
    if "specsplit" in totals:
        s = totals["specsplit"]["tok_s"]
        for name in BASELINES:
            if name in totals and totals[name]["tok_s"]:
                out[f"speedup_vs_{name}"] = round(s / totals[name]["tok_s"], 3)
        sp = [r["specsplit"] for r in rows if "specsplit" in r]
        rounds = sum(x["rounds"] for x in sp)
        out["mean_accepted"] = round((sum(x["accepted"] for x in sp) + rounds) / rounds, 3) if rounds else 0.0
        drafted = sum(x["drafted"] for x in sp)
        out["acceptance_rate"] = round(sum(x["accepted"] for x in sp) / drafted, 4) if drafted else 0.0
        predicted = [(x["new_tokens"], x["predicted_tok_s"], x["tok_s"]) for x in sp if x.get("predicted_tok_s")]
        if predicted:  # the cost model's expectation against the measured speed, per prompt
            out["predicted_tok_s"] = round(sum(n for n, _, _ in predicted) / sum(n / p for n, p, _ in predicted), 3)
            out["predicted_within_20pct"] = f"{sum(abs(p - m) <= 0.2 * m for _, p, m in predicted)}/{len(predicted)}"
        ident = [r["identical_to_target"] for r in rows if "identical_to_target" in r]
        if ident:
            out["identical_to_target"] = f"{sum(ident)}/{len(ident)}"
        causes = [r["divergence"] for r in rows if "divergence" in r]
        if causes:  # each divergence from the target's greedy decoding, with its cause
            out["divergences_named"] = f"{sum(c['named'] for c in causes)}/{len(causes)}"
    return out


def markdown(rows: list[dict], summary: dict) -> str:
    names = [n for n in SYSTEMS if n in summary["totals"]]
    llama = "llamacpp_identical_to_target" in summary
    pred = "predicted_tok_s" in summary
    head = ("| # | prompt | " + " | ".join(f"{n} tok/s" for n in names) + (" | specsplit predicted" if pred else "")
            + " | accepted/round | identical |" + (" llamacpp identical |" if llama else ""))
    lines = [head, "|" + "---|" * (len(names) + 4 + llama + pred)]
    for r in rows:
        spec = r.get("specsplit", {})
        lines.append(f"| {r['prompt_index']} | {r['prompt_head'][:28].replace('|', ' ').replace(chr(10), ' ')} | "
                     + " | ".join(f"{r[n]['tok_s']:.2f}" for n in names)
                     + (f" | {spec.get('predicted_tok_s', '-')}" if pred else "")
                     + f" | {spec.get('mean_accepted', '-')} | {r.get('identical_to_target', '-')} |"
                     + (f" {r.get('llamacpp_identical_to_target', '-')} |" if llama else ""))
    lines.append("| **total** | | " + " | ".join(f"**{summary['totals'][n]['tok_s']:.2f}**" for n in names)
                 + (f" | {summary['predicted_tok_s']} ({summary['predicted_within_20pct']} within 20%)" if pred else "")
                 + f" | {summary.get('mean_accepted', '-')} | {summary.get('identical_to_target', '-')} |"
                 + (f" {summary['llamacpp_identical_to_target']} |" if llama else ""))
    ratios = ", ".join(f"{k} = {v}x" for k, v in summary.items() if k.startswith("speedup"))
    causes = [f"- prompt {r['prompt_index']}, token {r['divergence']['position']}: {r['divergence']['cause']}"
              for r in rows if "divergence" in r]
    return ("\n".join(lines) + (f"\n\n{ratios}\n" if ratios else "\n")
            + ("\ndivergences from the target's greedy decoding:\n" + "\n".join(causes) + "\n" if causes else ""))


def write_json(path: str, config: dict, rows: list[dict], summary: dict) -> None:
    Path(path).write_text(json.dumps({"config": config, "rows": rows, "summary": summary}, indent=2))


def plot(path: str, rows: list[dict], summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in SYSTEMS if n in summary["totals"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(1, len(names))
    for k, n in enumerate(names):
        xs = [r["prompt_index"] + k * width for r in rows]
        ax1.bar(xs, [r[n]["tok_s"] for r in rows], width=width, label=n)
    ax1.set_xlabel("prompt")
    ax1.set_ylabel("tokens / s")
    ax1.legend()
    ax1.set_title("per prompt")
    ax2.bar(names, [summary["totals"][n]["tok_s"] for n in names], color=[f"C{k}" for k in range(len(names))])
    ax2.set_title("total tokens / total time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
