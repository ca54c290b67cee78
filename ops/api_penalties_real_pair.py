"""Penalties on the real pair, with the official ``openai`` client: ``honcho start`` of the
repository's Procfile and .env (the default preset, free ports), then, at temperature 0, each
answer with ``frequency_penalty`` / ``presence_penalty`` / ``repetition_penalty`` against the
fleet target's own plain decoding with the same penalties (its engine in this process, int8 as
the worker runs it, one token a round). Then the cost: the same questions with and without
penalties, alternating: tok/s and tokens a round side by side. A fourth way bans two common
tokens (``logit_bias`` -100 on " the" and ","), which the draft then never proposes.

    python ops/api_penalties_real_pair.py --json ops/results/api-penalties-real-pair-qwen-coder-cpu2-amx.json
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.api_logprobs_real_pair import QUESTIONS, plain_decoding
from ops.api_real_pair import check, new_report, report_checks, served_fleet, time_ways, timed_run_args
from ops.api_structured_real_pair import Reference

SETTINGS = {"frequency 0.5": {"frequency_penalty": 0.5},
            "presence 0.5, repetition 1.1": {"presence_penalty": 0.5, "repetition_penalty": 1.1}}


def sampling_of(penalties: dict):
    """The ``SamplingSpec`` of a request's body (``logit_bias`` as OpenAI's dict)."""
    from schemas import SamplingSpec, TokenBias

    bias = penalties.get("logit_bias")
    return SamplingSpec(**{**penalties, "logit_bias": [TokenBias(token_id=int(t), bias=b) for t, b in bias.items()]}
                        if bias else penalties)


def main(argv=None) -> int:
    args, tok = timed_run_args(__doc__, argv)
    banned = [tok.encode(" the"), tok.encode(",")]
    assert all(len(ids) == 1 for ids in banned), banned
    settings = {**SETTINGS, 'logit_bias -100 on " the", ","': {"logit_bias": {str(ids[0]): -100 for ids in banned}}}
    report = new_report(max_new_tokens=args.max_new_tokens, settings=settings)
    with served_fleet("specsplit-api-penalties-", report) as (_, sync, tmp):
        model = report["model"]
        ref = Reference()

        def ask(messages, penalties: dict):
            extra = {k: v for k, v in penalties.items() if k == "repetition_penalty"}
            body = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
            t0 = time.perf_counter()
            res = sync.chat.completions.create(model=model, messages=messages, temperature=0,
                                               max_tokens=args.max_new_tokens, extra_body=extra or None, **body)
            return res, time.perf_counter() - t0

        for name, penalties in settings.items():
            for i, messages in enumerate(QUESTIONS):
                ids = tok.encode_chat(messages)
                want, _ = plain_decoding(ref, tok, ids, args.max_new_tokens, f"pen-{name}-{i}",
                                         sampling_of(penalties), logprobs=None)
                res, _ = ask(messages, penalties)
                plain, _ = ask(messages, {})
                check(report, f"{name}, q{i}: = plain decoding with the penalties",
                      res.choices[0].message.content == tok.decode(want),
                      tokens=res.usage.completion_tokens, changed=res.choices[0].message.content
                      != plain.choices[0].message.content, answer=res.choices[0].message.content)
        time_ways(report, args.repeats, [("", [(way, partial(ask, messages, penalties))
                                               for way, penalties in [("none", {}), *settings.items()]])
                                         for messages in QUESTIONS], "penalties")
    return report_checks(report, tmp, args.json)


if __name__ == "__main__":
    sys.exit(main())
