"""Rows, summary ratios, the markdown table and the PNG plot of `specsplit bench`."""

from __future__ import annotations

import json
from pathlib import Path

# target_packed (optional, not in the default set): the target alone through transformers
# generate with the same prepacked oneDNN weights the fleet's target uses, to show how much of
# the speedup is the kernels and how much is speculation. llamacpp (optional): the target alone
# through llama.cpp on the same GGUF, the anchor of issue #13. specsplit_ref (optional): the same
# fleet running another checkout's code (--ref-source), the "before" of an A/B (issue #44)
SYSTEMS = ("target", "target_packed", "assisted", "specsplit", "specsplit_ref", "llamacpp")
BASELINES = ("target", "target_packed", "assisted", "llamacpp")
FLEETS = ("specsplit", "specsplit_ref")  # served by a local fleet: rounds and acceptance per row
# greedy token identity: (row key, first-divergence key, system, reference system)
IDENTITY = (("identical_to_target", "first_divergence", "specsplit", "target"),
            ("llamacpp_identical_to_target", "llamacpp_first_divergence", "llamacpp", "target"),
            ("ref_identical_to_target", "ref_first_divergence", "specsplit_ref", "target"),
            ("identical_to_ref", "first_divergence_from_ref", "specsplit", "specsplit_ref"))
# the table's identity columns beyond the always-shown "identical" (specsplit vs the target)
IDENTITY_COLUMNS = (("llamacpp identical", "llamacpp_identical_to_target"),
                    ("ref identical", "ref_identical_to_target"), ("identical to ref", "identical_to_ref"))


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
    for name in FLEETS:
        fleet = answers.get(name)
        if fleet is not None:
            row[name].update(rounds=fleet.rounds, accepted=fleet.accepted, drafted=fleet.drafted,
                             **acceptance(fleet.accepted, fleet.rounds, fleet.drafted))
    if greedy:  # sampled outputs are compared by distribution, not tokens
        for key, div_key, name, ref in IDENTITY:
            if name in answers and ref in answers:
                row[key] = answers[name].token_ids == answers[ref].token_ids
                row[div_key] = first_divergence(answers[name].token_ids, answers[ref].token_ids)
    return row


def acceptance(accepted: int, rounds: int, drafted: int) -> dict:
    """Tokens committed per round (accepted + the bonus) and accepted over drafted, e.g.
    acceptance(6, 3, 12) == {"mean_accepted": 3.0, "acceptance_rate": 0.5}."""
    return {"mean_accepted": round((accepted + rounds) / rounds, 3) if rounds else 0.0,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0}


def total_acceptance(rows: list[dict], name: str) -> dict:
    """acceptance() over every row of the fleet system ``name``."""
    have = [r[name] for r in rows if name in r]
    return acceptance(*(sum(x[f] for x in have) for f in ("accepted", "rounds", "drafted")))


def summarize(rows: list[dict]) -> dict:
    totals = {}
    for name in SYSTEMS:
        have = [r[name] for r in rows if name in r]
        if have:
            toks = sum(h["new_tokens"] for h in have)
            secs = sum(h["seconds"] for h in have)
            totals[name] = {"tokens": toks, "seconds": round(secs, 3), "tok_s": round(toks / secs, 3) if secs else 0.0}
    out = {"prompts": len(rows), "totals": totals}
    for key, *_ in IDENTITY:
        ident = [r[key] for r in rows if key in r]
        if ident:
            out[key] = f"{sum(ident)}/{len(ident)}"
    if "specsplit_ref" in totals:
        out.update({f"ref_{k}": v for k, v in total_acceptance(rows, "specsplit_ref").items()})
    if "specsplit" in totals:
        s = totals["specsplit"]["tok_s"]
        for name in (*BASELINES, "specsplit_ref"):  # speedup_vs_target, ..., speedup_vs_ref
            if name in totals and totals[name]["tok_s"]:
                out[f"speedup_vs_{name.removeprefix('specsplit_')}"] = round(s / totals[name]["tok_s"], 3)
        out.update(total_acceptance(rows, "specsplit"))
        sp = [r["specsplit"] for r in rows if "specsplit" in r]
        predicted = [(x["new_tokens"], x["predicted_tok_s"], x["tok_s"]) for x in sp if x.get("predicted_tok_s")]
        if predicted:  # the cost model's expectation against the measured speed, per prompt
            out["predicted_tok_s"] = round(sum(n for n, _, _ in predicted) / sum(n / p for n, p, _ in predicted), 3)
            out["predicted_within_20pct"] = f"{sum(abs(p - m) <= 0.2 * m for _, p, m in predicted)}/{len(predicted)}"
        causes = [r["divergence"] for r in rows if "divergence" in r]
        if causes:  # each divergence from the target's greedy decoding, with its cause
            out["divergences_named"] = f"{sum(c['named'] for c in causes)}/{len(causes)}"
    return out


def columns(summary: dict) -> list[tuple]:
    """The table's columns after '#' and 'prompt': (header, a row's cell, the total's cell)."""
    cols = [(f"{n} tok/s", lambda r, n=n: f"{r[n]['tok_s']:.2f}", f"**{summary['totals'][n]['tok_s']:.2f}**")
            for n in SYSTEMS if n in summary["totals"]]
    if "predicted_tok_s" in summary:
        cols.append(("specsplit predicted", lambda r: r.get("specsplit", {}).get("predicted_tok_s", "-"),
                     f"{summary['predicted_tok_s']} ({summary['predicted_within_20pct']} within 20%)"))
    cols.append(("accepted/round", lambda r: r.get("specsplit", {}).get("mean_accepted", "-"),
                 summary.get("mean_accepted", "-")))
    if "ref_mean_accepted" in summary:
        cols.append(("ref accepted/round", lambda r: r.get("specsplit_ref", {}).get("mean_accepted", "-"),
                     summary["ref_mean_accepted"]))
    cols.append(("identical", lambda r: r.get("identical_to_target", "-"), summary.get("identical_to_target", "-")))
    cols += [(head, lambda r, key=key: r.get(key, "-"), summary[key]) for head, key in IDENTITY_COLUMNS
             if key in summary]
    return cols


def markdown(rows: list[dict], summary: dict) -> str:
    cols = columns(summary)
    lines = ["| # | prompt | " + " | ".join(head for head, _, _ in cols) + " |", "|" + "---|" * (len(cols) + 2)]
    for r in rows:
        lines.append(f"| {r['prompt_index']} | {r['prompt_head'][:28].replace('|', ' ').replace(chr(10), ' ')} | "
                     + " | ".join(str(cell(r)) for _, cell, _ in cols) + " |")
    lines.append("| **total** | | " + " | ".join(str(total) for _, _, total in cols) + " |")
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
