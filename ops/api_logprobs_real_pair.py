"""Log-probabilities on the real pair, with the official ``openai`` client: ``honcho start`` of
the repository's Procfile and .env (the default preset, free ports), then, at temperature 0,
each answer's ``logprobs`` against the fleet target's own plain decoding of the same prompt ids
(its engine in this process, int8 as the worker runs it, one token a round: a quantized target
is its own reference). Checks: the same tokens; each token's log-probability and its top 5 the
same to 1e-3 (the largest differences are reported); streamed = whole. Then the cost: the same
questions with and without logprobs, alternating, tok/s side by side.

Prints each check and a table, and writes a JSON report.

    python ops/api_logprobs_real_pair.py --json ops/results/api-logprobs-real-pair-qwen-coder-cpu2-amx.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.api_real_pair import check, new_report, report_checks, served_fleet, timed_run_args
from ops.api_structured_real_pair import Reference

QUESTIONS = [
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Explain what a hash map is in two sentences."}],
]
TOP = 5


def plain_decoding(ref: Reference, tok, ids: list[int], max_new: int, sid: str, sampling=None,
                   logprobs: int | None = TOP) -> tuple[list[int], list]:
    """The target engine's plain decoding (a one-node tree a round; ``sampling``: greedy by
    default, penalties honoured): (tokens, each token's (logprob, top ids, top logprobs))."""
    from schemas import CacheSync, ErrorReply, SamplingSpec, VerifyRequest
    from specsplit.orchestrator.state import root_only

    committed, cached, out, rows = list(ids), 0, [], []
    for rnd in range(max_new):
        sync = CacheSync(base_len=cached, append_token_ids=committed[cached:-1], prompt_len=len(ids))
        reply = ref.target.engine.handle(VerifyRequest(session_id=sid, round=rnd, sync=sync, logprobs=logprobs,
                                                       tree=root_only(committed[-1]), sampling=sampling or SamplingSpec()))
        assert not isinstance(reply, ErrorReply), reply
        cached = reply.cache_len
        committed.append(reply.bonus_token_id)
        out.append(reply.bonus_token_id)
        if reply.logprobs is not None:
            rows.append((reply.logprobs.token[0], reply.logprobs.top_ids[0], reply.logprobs.top[0]))
        if reply.bonus_token_id in tok.stop_token_ids:
            break
    return out, rows


def main(argv=None) -> int:
    args, tok = timed_run_args(__doc__, argv)
    report = new_report(max_new_tokens=args.max_new_tokens, top_logprobs=TOP)
    with served_fleet("specsplit-api-logprobs-", report) as (_, sync, tmp):
        model = report["model"]
        ref = Reference()
        worst = {"token": 0.0, "top": 0.0}
        for i, messages in enumerate(QUESTIONS):
            ids = tok.encode_chat(messages)
            want, rows = plain_decoding(ref, tok, ids, args.max_new_tokens, f"plain-{i}")
            shown = [(t, r) for t, r in zip(want, rows) if t not in tok.stop_token_ids]
            body = {"model": model, "messages": messages, "max_tokens": args.max_new_tokens, "temperature": 0,
                    "logprobs": True, "top_logprobs": TOP}
            whole = sync.chat.completions.create(**body)
            content = whole.choices[0].logprobs.content
            same_tokens = [e.token for e in content] == [tok.token_piece(t)[0] for t, _ in shown]
            d_token = max((abs(e.logprob - r[0]) for e, (_, r) in zip(content, shown)), default=0.0)
            d_top = max((abs(a.logprob - b) for e, (_, r) in zip(content, shown)
                         for a, b in zip(e.top_logprobs, r[2])), default=0.0)
            top_same = sum([a.token for a in e.top_logprobs] == [tok.token_piece(j)[0] for j in r[1]]
                           for e, (_, r) in zip(content, shown))
            worst = {"token": max(worst["token"], d_token), "top": max(worst["top"], d_top)}
            check(report, f"q{i}: the tokens of plain decoding", same_tokens, tokens=len(content))
            check(report, f"q{i}: each token's logprob = plain decoding's (1e-3)", d_token < 1e-3,
                  max_abs_diff=d_token)
            check(report, f"q{i}: top {TOP} = plain decoding's (1e-3)", d_top < 1e-3, max_abs_diff=d_top,
                  same_order=f"{top_same}/{len(content)}")
            streamed = [e for c in sync.chat.completions.create(**body, stream=True) if c.choices and c.choices[0].logprobs
                        for e in c.choices[0].logprobs.content]
            check(report, f"q{i}: streamed = whole", [e.token for e in streamed] == [e.token for e in content]
                  and all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(streamed, content)))
        report["max_abs_diff"] = worst
        timings: dict[str, list[float]] = {"without": [], "with": []}
        for r in range(args.repeats):
            for messages in QUESTIONS:
                for way in (("without", "with") if r % 2 == 0 else ("with", "without")):
                    extra = {"logprobs": True, "top_logprobs": TOP} if way == "with" else {}
                    t0 = time.perf_counter()
                    res = sync.chat.completions.create(model=model, messages=messages, temperature=0,
                                                       max_tokens=args.max_new_tokens, **extra)
                    timings[way].append(res.usage.completion_tokens / (time.perf_counter() - t0))
        report["tok_s"] = {k: round(statistics.mean(v), 3) for k, v in timings.items()}
        report["tok_s_runs"] = {k: [round(x, 3) for x in v] for k, v in timings.items()}
        ratio = report["tok_s"]["with"] / report["tok_s"]["without"]
        report["with_over_without"] = round(ratio, 3)
        print(f"\n| logprobs | tok/s (mean of {len(timings['with'])}) |\n|---|---|")
        for k, v in report["tok_s"].items():
            print(f"| {k} | {v} |")
        print(f"with / without: {ratio:.3f}; largest |diff| vs plain decoding: token {worst['token']:.2e}, "
              f"top {worst['top']:.2e}")
    return report_checks(report, tmp, args.json)


if __name__ == "__main__":
    sys.exit(main())
