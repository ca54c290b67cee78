"""Fill in the middle (``suffix`` on ``/v1/completions``) on the real pair, as an editor's
completion plugin sends it: ``honcho start`` of the repository's Procfile and .env (the default
preset, free ports), the ``openai`` client, greedy. Each gap's answer, whole and streamed (and
once with the text before the gap as token ids), against the fleet target's own plain decoding
of the model's FIM prompt (its engine in this process, int8 as the worker runs it, one token a
round); then each is timed (``--repeats``), with its tokens a round. The n-gram cache is off
(SPECSPLIT_LOOKUP_CACHE_KEYS=0), so a gap asked again is not answered from the first answer.

    python ops/api_fim_real_pair.py --json ops/results/api-fim-real-pair-qwen-coder-cpu2-amx.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.api_fixed_length_real_pair import decoding
from ops.api_real_pair import check, new_report, report_checks, served_fleet, time_ways, timed_run_args
from ops.api_structured_real_pair import Reference

GAPS = [  # (the text before the cursor, the text after it)
    ("def is_prime(n: int) -> bool:\n    ", "\n\n\nprint([k for k in range(20) if is_prime(k)])\n"),
    ("import json\n\n\ndef load_config(path):\n    ", "\n    return config\n"),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        ",
     "\n\n    def pop(self):\n        return self.items.pop()\n\n    def peek(self):\n        return self.items[-1]\n"),
    ("def total(prices, tax_rate):\n    subtotal = 0\n    for price in prices:\n        ",
     "\n    return subtotal * (1 + tax_rate)\n"),
]


def main(argv=None) -> int:
    args, tok = timed_run_args(__doc__, argv)
    stops = list(tok.stop_token_ids)
    report = new_report(max_new_tokens=args.max_new_tokens, fim_tokens=list(tok.fim or ()))
    with served_fleet("specsplit-api-fim-", report, SPECSPLIT_LOOKUP_CACHE_KEYS="0") as (_, client, tmp):
        model = report["model"]
        ref = Reference()
        cases = []
        for i, (before, after) in enumerate(GAPS):
            ids = tok.encode(tok.infill(before, after))
            want = decoding(ref, ids, args.max_new_tokens, f"fim-{i}", stops, 0)
            text = tok.decode(want)
            body = {"model": model, "prompt": before, "suffix": after, "max_tokens": args.max_new_tokens,
                    "temperature": 0}
            whole = client.completions.create(**body)
            check(report, f"gap {i}: the answer = the target's decoding of the FIM prompt",
                  whole.choices[0].text == text and whole.usage.completion_tokens == len(want)
                  and whole.usage.prompt_tokens == len(ids), tokens=whole.usage.completion_tokens,
                  finish=whole.choices[0].finish_reason, answer=whole.choices[0].text)
            streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)
            check(report, f"gap {i}: streamed = whole", streamed == whole.choices[0].text)
            if i == 0:
                as_ids = client.completions.create(**{**body, "prompt": tok.encode(before)})
                check(report, "gap 0: the text before the gap as token ids = as text",
                      as_ids.choices[0].text == whole.choices[0].text)
            print(f"--- gap {i} ---\n{before}\033[1m{whole.choices[0].text}\033[0m{after}", flush=True)

            def call(body=body):
                t0 = time.perf_counter()
                res = client.completions.create(**body)
                return res, time.perf_counter() - t0

            cases.append((f"gap {i} ", [("FIM", call)]))
        time_ways(report, args.repeats, cases, "gap")
    return report_checks(report, tmp, args.json)


if __name__ == "__main__":
    sys.exit(main())
