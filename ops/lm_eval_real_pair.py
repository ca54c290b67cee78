"""lm-eval (EleutherAI's evaluation harness) on the real pair through the HTTP API, as people
point it at an OpenAI server: its ``local-completions`` model (token prompts, ``echo`` +
``logprobs: 1`` + ``max_tokens: 1``: the loglikelihood request) against ``honcho start`` of the
repository's Procfile and .env (the default preset, free ports), on two tasks kept here: a
multiple-choice one (ops/data/lm_eval_mc.jsonl: 24 questions x 4 answers, scored by
loglikelihood) and a perplexity one (ops/data/lm_eval_ppl.jsonl: texts of 250 to 1,800 tokens,
loglikelihood_rolling, as wikitext's).

Checks every (log-likelihood, is_greedy) lm-eval logged against the fleet target alone (its
engine in this process, int8 as the worker runs it: a quantized target is its own reference):
its prefill of the same tokens (to 1e-3), and its plain forward of them (reported, with the
largest difference); the accuracy from those equals lm-eval's; each text's log-likelihood
equals the engine's prefill of it (to 1e-3). Then the time lm-eval took, and
what the prompt's rows cost the engine: its prefill of the same requests, and of 512- and
2048-token prompts, with and without them.

lm-eval is not a dependency of SpecSplit; give the python of an environment that has it:

    uv venv /tmp/lm-eval && uv pip install --python /tmp/lm-eval/bin/python "lm_eval[api,hf]" torch==2.13.0
    python ops/lm_eval_real_pair.py --lm-eval /tmp/lm-eval/bin/python \\
        --json ops/results/lm-eval-real-pair-qwen-coder-cpu2-amx.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.api_real_pair import check, new_report, report_checks, served_fleet


def task_yaml(name: str, data: Path, output_type: str, rest: str) -> str:
    """An lm-eval task over a JSONL file of this repository (its test split)."""
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"output_type: {output_type}\ntest_split: test\n{rest}")


DATA = REPO / "ops" / "data" / "lm_eval_mc.jsonl"
TASK = "specsplit_mc"
TASK_YAML = task_yaml(TASK, DATA, "multiple_choice", """doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
# perplexity (as wikitext's task): each text scored whole, after lm-eval's prefix token; the texts
# (250, 900 and 1,800 tokens of this repository's docs) fit its 2,048-token window
PPL_DATA = REPO / "ops" / "data" / "lm_eval_ppl.jsonl"
PPL_TASK = "specsplit_ppl"
PPL_YAML = task_yaml(PPL_TASK, PPL_DATA, "loglikelihood_rolling", """doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's tokens for a (context, continuation) request (``TemplateLM._encode_pair``: the
    context's trailing spaces move to the continuation, which is the whole's tokens after the
    context's)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def requesting_s(log: str, total: int) -> int | None:
    """The seconds lm-eval spent requesting the API for ``total`` requests (the elapsed time of
    its progress bar over them: its start and its task loading excluded), or None when the log
    shows none."""
    hits = re.findall(rf"Requesting API: 100%[^\r\n]*? {total}/{total} \[(\d+):(\d+)<", log)
    return int(hits[-1][0]) * 60 + int(hits[-1][1]) if hits else None


def requests_of(sample: dict) -> list[tuple[str, str]]:
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        return [(a["arg_0"], a["arg_1"]) for a in args.values()]
    return [tuple(a) for a in args]


def score(rows: list[float], greedy_rows: list[int], ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """(log-likelihood, is_greedy) of ``cont`` after ``ctx`` from per-token rows of ctx + cont
    (row k: the log-probability of token k + 1, and the most likely token there)."""
    at = range(len(ctx) - 1, len(ctx) - 1 + len(cont))
    return sum(rows[k] for k in at), all(greedy_rows[k] == t for k, t in zip(at, cont))


class Alone:
    """The fleet target's engine in this process: its prefill of a prompt with the prompt's
    log-probabilities (the worker's code path, alone), and the model's plain forward."""

    def __init__(self) -> None:
        from ops.api_structured_real_pair import Reference

        self.engine = Reference().target.engine
        self.engine.prefix_cache = None  # each prefill forwards its prompt whole: the costs compare
        self.n = 0

    def prefill(self, ids: list[int], scored: bool = True) -> tuple[list[float], list[int]]:
        """The engine's first round on ``ids`` from an empty cache, with the prompt's
        log-probabilities (``scored``; else the round alone, for its time: nothing returned)."""
        from schemas import CacheSync, EndSession, ErrorReply, VerifyRequest
        from specsplit.orchestrator.state import root_only

        self.n += 1
        sid = f"alone-{self.n}"
        sync = CacheSync(base_len=0, append_token_ids=ids[:-1], prompt_len=len(ids))
        reply = self.engine.handle(VerifyRequest(session_id=sid, round=0, sync=sync, tree=root_only(ids[-1]),
                                                 prompt_logprobs=1 if scored else None))
        self.engine.handle(EndSession(session_id=sid))
        assert not isinstance(reply, ErrorReply), reply
        lp = reply.prompt_logprobs
        return (lp.token, [row[0] for row in lp.top_ids]) if scored else ([], [])

    def plain(self, ids: list[int]) -> tuple[list[float], list[int]]:
        import torch

        with torch.no_grad():
            logits = self.engine.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1)
        return lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1))[:, 0].tolist(), lp.argmax(-1).tolist()


def perplexity_checks(alone: Alone, tok, tmp: Path, results: dict, report: dict) -> None:
    """Each text's log-likelihood lm-eval logged (one window: its prefix token, then the text)
    against the engine alone's prefill of the same tokens."""
    samples = [json.loads(line) for f in (tmp / "out").rglob(f"samples_{PPL_TASK}_*.jsonl") for line in f.open()]
    check(report, "every text was scored", len(samples) == sum(1 for _ in PPL_DATA.open()), samples=len(samples))
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id  # lm-eval's prefix_token_id
    worst, lengths = 0.0, []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        got = s["resps"][0][0]
        got = float(got[0] if isinstance(got, list) else got)
        ids = [prefix, *tok.encode(s["doc"]["text"], add_special_tokens=False)]
        lengths.append(len(ids) - 1)
        want = sum(alone.prefill(ids)[0])
        worst = max(worst, abs(want - got))
    report["perplexity"] = {"text_tokens": lengths, "max_abs_diff": worst,
                            **{k: results["results"][PPL_TASK][f"{k},none"]
                               for k in ("word_perplexity", "byte_perplexity", "bits_per_byte")}}
    check(report, "each text's log-likelihood = the target's prefill alone (1e-3)", worst < 1e-3,
          max_abs_diff=worst, text_tokens=lengths)


def long_prompt_cost(alone: Alone, tok, report: dict, lengths=(512, 2048), repeats: int = 3) -> None:
    """The engine's prefill of a long prompt with and without its rows (alternating, best of
    ``repeats`` each): what the prompt's log-probabilities cost."""
    text = (REPO / "specsplit" / "engine" / "target.py").read_text()
    ids = tok.encode(text, add_special_tokens=False) * 4
    report["long_prompt"] = {}
    print("\n| prompt tokens | prefill s | with the prompt's rows s | ratio |\n|---|---|---|---|")
    for n in lengths:
        times: dict[str, list[float]] = {"unscored": [], "scored": []}
        for r in range(repeats):
            for way in (("scored", "unscored") if r % 2 == 0 else ("unscored", "scored")):
                t0 = time.perf_counter()
                alone.prefill(ids[:n], scored=way == "scored")
                times[way].append(time.perf_counter() - t0)
        best = {k: min(v) for k, v in times.items()}
        ratio = best["scored"] / best["unscored"]
        report["long_prompt"][str(n)] = {"unscored_s": round(best["unscored"], 3), "scored_s": round(best["scored"], 3),
                                         "ratio": round(ratio, 3), "runs": {k: [round(x, 3) for x in v]
                                                                            for k, v in times.items()}}
        print(f"| {n} | {best['unscored']:.2f} | {best['scored']:.2f} | {ratio:.3f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lm-eval", required=True, help="a python that has lm_eval installed")
    p.add_argument("--batch-size", type=int, default=4, help="lm-eval's requests per call (prompts per request)")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from specsplit.models import ModelSettings, resolve_model_paths

    target_path = resolve_model_paths(ModelSettings()).target
    tok = AutoTokenizer.from_pretrained(target_path)
    report = new_report(task=TASK, questions=sum(1 for _ in DATA.open()), batch_size=args.batch_size)
    with served_fleet("specsplit-lm-eval-", report) as (url, _, tmp):
        (tmp / "tasks").mkdir()
        (tmp / "tasks" / f"{TASK}.yaml").write_text(TASK_YAML)
        (tmp / "tasks" / f"{PPL_TASK}.yaml").write_text(PPL_YAML)
        cmd = [args.lm_eval, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"model={report['model']},base_url={url}/v1/completions,tokenizer={target_path},"
               "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,timeout=600",
               "--tasks", f"{TASK},{PPL_TASK}", "--include_path", str(tmp / "tasks"), "--batch_size", str(args.batch_size),
               "--output_path", str(tmp / "out"), "--log_samples"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "OPENAI_API_KEY": "unused"}
        t0 = time.perf_counter()
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        report["lm_eval_s"] = round(time.perf_counter() - t0, 2)
        (tmp / "lm_eval.log").write_text(run.stdout + run.stderr)
        # the multiple-choice task's requests (each text of the perplexity one has its own bar)
        report["lm_eval_requesting_s"] = requesting_s(run.stdout + run.stderr, 4 * report["questions"])
        check(report, "lm-eval ran to its end", run.returncode == 0, rc=run.returncode)
        if run.returncode != 0:
            print((run.stdout + run.stderr)[-3000:])
            return report_checks(report, tmp, args.json)
    samples = [json.loads(line) for f in (tmp / "out").rglob(f"samples_{TASK}_*.jsonl") for line in f.open()]
    results = json.loads(next((tmp / "out").rglob("results_*.json")).read_text())
    report["lm_eval_acc"] = results["results"][TASK]["acc,none"]
    check(report, "every question was scored", len(samples) == report["questions"], samples=len(samples))
    alone = Alone()
    worst = {"prefill": 0.0, "plain": 0.0}
    greedy_same = {"prefill": 0, "plain": 0}
    picks = {"prefill": [], "plain": []}
    alone_s = plain_s = 0.0
    n = 0
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        # (log-likelihood, is_greedy) per request, as lm-eval logs them (strings in its samples)
        got = [(float(r[0]), str(r[1]) == "True") for r in (r[0] if isinstance(r[0], list) else r for r in s["resps"])]
        ours = {"prefill": [], "plain": []}
        for (context, continuation), (ll, greedy) in zip(requests_of(s), got):
            ctx, cont = encode_pair(tok, context, continuation)
            t0 = time.perf_counter()
            rows = {"prefill": alone.prefill(ctx + cont)}
            t1 = time.perf_counter()
            alone.prefill(ctx + cont, scored=False)  # the same round without the prompt's rows: their cost
            alone_s += t1 - t0
            plain_s += time.perf_counter() - t1
            rows["plain"] = alone.plain(ctx + cont)
            n += 1
            for way, (lps, top) in rows.items():
                want, want_greedy = score(lps, top, ctx, cont)
                worst[way] = max(worst[way], abs(want - ll))
                greedy_same[way] += want_greedy == greedy
                ours[way].append(want)
        for way in picks:
            picks[way].append(max(range(len(ours[way])), key=ours[way].__getitem__) == int(s["target"]))
    report["requests"] = n
    report["max_abs_diff"] = {k: round(v, 6) for k, v in worst.items()}
    report["is_greedy_same"] = {k: f"{v}/{n}" for k, v in greedy_same.items()}
    report["acc_alone"] = {k: sum(v) / len(v) for k, v in picks.items()}
    report["alone_prefill_s"] = round(alone_s, 2)
    report["alone_prefill_unscored_s"] = round(plain_s, 2)
    report["scored_over_unscored"] = round(alone_s / plain_s, 3)
    check(report, "each log-likelihood = the target's prefill alone (1e-3)", worst["prefill"] < 1e-3,
          max_abs_diff=worst["prefill"])
    check(report, "each is_greedy = the target's prefill alone", greedy_same["prefill"] == n)
    check(report, "accuracy = the target's prefill alone", report["acc_alone"]["prefill"] == report["lm_eval_acc"],
          lm_eval=report["lm_eval_acc"], alone=report["acc_alone"]["prefill"])
    print(f"\nlm-eval: acc {report['lm_eval_acc']:.3f} over {len(samples)} questions ({n} requests) in "
          f"{report['lm_eval_s']} s ({report['lm_eval_requesting_s']} s requesting); the engine alone prefilled them "
          f"in {report['alone_prefill_s']} s "
          f"({report['alone_prefill_unscored_s']} s without the prompt's rows: "
          f"{report['scored_over_unscored']}x)")
    print(f"largest |diff| of a log-likelihood: prefill alone {worst['prefill']:.2e}, plain forward "
          f"{worst['plain']:.2e} (is_greedy the same: {report['is_greedy_same']['plain']}; acc "
          f"{report['acc_alone']['plain']:.3f})")
    perplexity_checks(alone, tok, tmp, results, report)
    long_prompt_cost(alone, tok, report)
    return report_checks(report, tmp, args.json)


if __name__ == "__main__":
    sys.exit(main())
