"""Rows, the markdown table and the PNG of ``specsplit bench api``: one request's answer at
either door (``Answer``), a door's passes at one level merged, the per-level figures and the
API / producer ratios."""

from __future__ import annotations

from dataclasses import dataclass, replace

from specsplit.bench.load import percentile


@dataclass(frozen=True)
class Answer:
    """One request as its client saw it; times in seconds from the request's start."""

    index: int  # prompt index
    text: str = ""
    tokens: int = 0
    first_s: float | None = None  # the first text (whole characters) streamed
    end_s: float = 0.0  # the answer's end
    chunks: int = 0  # streamed pieces of text
    finish_reason: str = ""
    prompt_tokens: int = 0
    error: str = ""
    reproduced: bool = True  # the same answer in every pass of its level (merge)
    first_token_s: float | None = None  # the first token, where the door shows tokens (the producer)

    @property
    def tpot_s(self) -> float | None:
        if self.first_s is None or self.tokens < 2:
            return None
        return (self.end_s - self.first_s) / (self.tokens - 1)


@dataclass(frozen=True)
class Pass:
    answers: list[Answer]  # in prompt order
    wall_s: float


def _mean(xs: list[float | None]) -> float | None:
    return None if None in xs else sum(xs) / len(xs)


def merge(passes: list[Pass]) -> list[Answer]:
    """One answer per prompt over a door's passes at one level: the first pass's answer with the
    passes' mean times; not ``reproduced`` when the passes' answers differ; failed when one did."""
    out = []
    for i, first in enumerate(passes[0].answers):
        same = [p.answers[i] for p in passes]
        error = next((a.error for a in same if a.error), "")
        out.append(replace(first, error=error) if error else replace(
            first, first_s=_mean([a.first_s for a in same]), end_s=_mean([a.end_s for a in same]),
            first_token_s=_mean([a.first_token_s for a in same]),
            reproduced=all((a.text, a.tokens, a.finish_reason) == (first.text, first.tokens, first.finish_reason)
                           for a in same)))
    return out


def _ms(xs: list[float], q: float) -> float | None:
    return round(1000 * percentile(xs, q), 2) if xs else None


def door_stats(merged: list[Answer], passes: list[Pass]) -> dict:
    ok = [a for a in merged if not a.error]
    ttft = [a.first_s for a in ok if a.first_s is not None]
    first_token = [a.first_token_s for a in ok if a.first_token_s is not None]
    tpot = [a.tpot_s for a in ok if a.tpot_s is not None]
    e2e = [a.end_s for a in ok]
    wall = sum(p.wall_s for p in passes) / len(passes)
    tokens, chunks = sum(a.tokens for a in ok), sum(a.chunks for a in ok)
    return {"tok_s": round(tokens / wall, 3) if wall > 0 else 0.0, "new_tokens": tokens, "wall_s": round(wall, 3),
            "ttft_p50_ms": _ms(ttft, 50), "ttft_p99_ms": _ms(ttft, 99),
            "first_token_p50_ms": _ms(first_token, 50), "first_token_p99_ms": _ms(first_token, 99),
            "tpot_p50_ms": _ms(tpot, 50), "tpot_p99_ms": _ms(tpot, 99),
            "tpot_mean_ms": round(1000 * sum(tpot) / len(tpot), 2) if tpot else None,
            "e2e_p50_s": round(percentile(e2e, 50), 3), "e2e_p99_s": round(percentile(e2e, 99), 3),
            "tokens_per_chunk": round(tokens / chunks, 3) if chunks else None,
            "failed": len(merged) - len(ok), "errors": [a.error for a in merged if a.error][:5],
            "passes_tok_s": [round(sum(a.tokens for a in p.answers) / p.wall_s, 3) if p.wall_s > 0 else 0.0
                             for p in passes],
            "passes_wall_s": [round(p.wall_s, 3) for p in passes]}


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def same_answer(a: Answer, p: Answer) -> bool:
    """The API's answer equals the producer's: text, token count, finish reason, prompt tokens."""
    return (not a.error and not p.error and a.reproduced and p.reproduced
            and (a.text, a.tokens, a.finish_reason, a.prompt_tokens) == (p.text, p.tokens, p.finish_reason, p.prompt_tokens))


def make_row(concurrency: int, order: list[str], api_passes: list[Pass], producer_passes: list[Pass]) -> dict:
    api, prod = merge(api_passes), merge(producer_passes)
    a, p = door_stats(api, api_passes), door_stats(prod, producer_passes)
    same = [same_answer(x, y) for x, y in zip(api, prod)]
    return {
        "concurrency": concurrency, "sessions": len(api), "order": order, "api": a, "producer": p,
        # the API's time per output token / the producer's (1.0: the HTTP door costs nothing)
        "tpot_ratio_p50": _ratio(a["tpot_p50_ms"], p["tpot_p50_ms"]),
        "tpot_ratio_p99": _ratio(a["tpot_p99_ms"], p["tpot_p99_ms"]),
        "ttft_ratio_p50": _ratio(a["ttft_p50_ms"], p["ttft_p50_ms"]),
        "ttft_ratio_p99": _ratio(a["ttft_p99_ms"], p["ttft_p99_ms"]),
        "tok_s_ratio": _ratio(a["tok_s"], p["tok_s"]),
        "identical": sum(same),
        "same_token_counts": sum(not x.error and not y.error and x.tokens == y.tokens for x, y in zip(api, prod)),
        "same_prompt_tokens": sum(not x.error and x.prompt_tokens == y.prompt_tokens for x, y in zip(api, prod)),
        "requests": [{"prompt_index": x.index, "prompt_tokens": y.prompt_tokens, "api_prompt_tokens": x.prompt_tokens,
                      "api_tokens": x.tokens, "producer_tokens": y.tokens, "finish_reason": [x.finish_reason, y.finish_reason],
                      "api_ttft_ms": _ms([x.first_s], 50) if x.first_s is not None else None,
                      "producer_ttft_ms": _ms([y.first_s], 50) if y.first_s is not None else None,
                      "api_tpot_ms": _ms([x.tpot_s], 50) if x.tpot_s is not None else None,
                      "producer_tpot_ms": _ms([y.tpot_s], 50) if y.tpot_s is not None else None,
                      "api_chunks": x.chunks, "producer_chunks": y.chunks, "identical": ok,
                      **({"error": [x.error, y.error]} if x.error or y.error else {})}
                     for x, y, ok in zip(api, prod, same)],
    }


def summarize(rows: list[dict]) -> dict:
    same, total = sum(r["identical"] for r in rows), sum(r["sessions"] for r in rows)
    by = lambda key: {str(r["concurrency"]): r[key] for r in rows}
    return {"identical": f"{same}/{total}", "all_identical": same == total,
            "failed": sum(r["api"]["failed"] + r["producer"]["failed"] for r in rows),
            "tpot_ratio_p50": by("tpot_ratio_p50"), "tpot_ratio_p99": by("tpot_ratio_p99"),
            "ttft_ratio_p50": by("ttft_ratio_p50"), "tok_s_ratio": by("tok_s_ratio")}


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def markdown(rows: list[dict]) -> str:
    def pair(d: dict, key: str) -> str:
        lo, hi = d[f"{key}_p50_ms"], d[f"{key}_p99_ms"]
        return "-" if lo is None else f"{lo:.1f} / {hi:.1f}"

    lines = ["| concurrency | TTFT p50 / p99 ms, API | producer | TPOT p50 / p99 ms, API | producer "
             "| tok/s, API | producer | API / producer TPOT p50 (p99) | identical |", "|" + "---|" * 9]
    for r in rows:
        a, p = r["api"], r["producer"]
        lines.append(f"| {r['concurrency']} | {pair(a, 'ttft')} | {pair(p, 'ttft')} | {pair(a, 'tpot')} "
                     f"| {pair(p, 'tpot')} | {a['tok_s']:.2f} | {p['tok_s']:.2f} "
                     f"| {_x(r['tpot_ratio_p50'])} ({_x(r['tpot_ratio_p99'])}) | {r['identical']}/{r['sessions']} |")
    return "\n".join(lines) + "\n"


def plot(path: str, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("ttft", "time to first token, ms"), ("tpot", "time per output token, ms"), ("tok_s", "aggregate tok/s"))
    for ax, (key, label) in zip(axes, panels):
        for k, door in enumerate(("api", "producer")):
            if key == "tok_s":
                ax.plot(xs, [r[door]["tok_s"] for r in rows], "o-", color=f"C{k}", label=door)
                continue
            for q, style in ((50, "o-"), (99, "s--")):
                ys = [r[door][f"{key}_p{q}_ms"] for r in rows]
                ax.plot(xs, [float("nan") if y is None else y for y in ys], style, color=f"C{k}", label=f"{door} p{q}")
        if key == "tpot":
            for r in rows:
                if r["tpot_ratio_p50"] is not None and r["api"]["tpot_p50_ms"] is not None:
                    ax.annotate(f"{r['tpot_ratio_p50']:.2f}x", (r["concurrency"], r["api"]["tpot_p50_ms"]),
                                textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
        if len(xs) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set(xlabel="requests in flight", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
