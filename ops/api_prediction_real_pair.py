"""Predicted outputs (OpenAI's ``prediction``) on the real pair, with the official ``openai``
client: ``honcho start`` of the repository's Procfile and .env (the default preset, free ports,
the cross-session n-gram cache off so that no answer is remembered between the requests
compared), greedy, against the int8 target's own plain decoding. Two tasks:

- an edit: rename a function in code given in the prompt, predicted by the code as given (prompt
  lookup already finds it in the prompt);
- a rewrite: answer a question again, predicted by the target's own answer with one word changed
  (the prompt holds none of it).

Each answer must equal the target's decoding with and without the prediction; then each task is
asked with and without it, alternating: tok/s and tokens a round side by side.

    python ops/api_prediction_real_pair.py --json ops/results/api-prediction-real-pair-qwen-coder-cpu2-amx.json
"""

from __future__ import annotations

import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.api_logprobs_real_pair import plain_decoding
from ops.api_real_pair import (
    check, new_report, report_checks, start_fleet, stop_fleet, time_ways, timed_run_args, wait_health,
)
from ops.api_structured_real_pair import Reference

CODE = '''def is_prime(n):
    """Return True if n is a prime number."""
    if n < 2:
        return False
    for i in range(2, int(n ** 0.5) + 1):
        if n % i == 0:
            return False
    return True


def primes_below(limit):
    """All the primes below limit, in order."""
    return [n for n in range(limit) if is_prime(n)]
'''
EDIT = [{"role": "user", "content": "Rename the function is_prime to check_prime everywhere in this code. Answer "
                                    f"with the whole code only, in a python block.\n\n```python\n{CODE}```"}]
REWRITE = [{"role": "user", "content": "Explain in one paragraph how a hash map handles collisions."}]


def main(argv=None) -> int:
    import httpx
    from openai import OpenAI

    args, tok = timed_run_args(__doc__, argv)
    report = new_report(max_new_tokens=args.max_new_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-api-prediction-"))
    proc, url = start_fleet(tmp, SPECSPLIT_LOOKUP_CACHE_KEYS="0")
    try:
        wait_health(url, proc)
        model = report["model"] = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        ref = Reference()
        tasks = {}
        for name, messages in (("edit", EDIT), ("rewrite", REWRITE)):
            want = tok.decode(plain_decoding(ref, tok, tok.encode_chat(messages), args.max_new_tokens, f"ref-{name}",
                                             logprobs=None)[0])
            words = want.split(" ")
            predicted = f"```python\n{CODE}```" if name == "edit" else \
                " ".join([*words[:len(words) // 2], "indeed", *words[len(words) // 2:]])
            tasks[name] = (messages, predicted)
            for way, extra in (("without", {}), ("with", {"prediction": {"type": "content", "content": predicted}})):
                res = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_new_tokens,
                                                     temperature=0, **extra)
                check(report, f"{name} {way} the prediction = the target's decoding",
                      res.choices[0].message.content == want, tokens=res.usage.completion_tokens,
                      answer=res.choices[0].message.content)
        def ask(messages, extra):
            t0 = time.perf_counter()
            res = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                 max_tokens=args.max_new_tokens, **extra)
            return res, time.perf_counter() - t0

        time_ways(report, args.repeats, [
            (f"{name} ", [("without", partial(ask, messages, {})),
                          ("with", partial(ask, messages, {"prediction": {"type": "content", "content": predicted}}))])
            for name, (messages, predicted) in tasks.items()], "task, prediction")
    finally:
        stop_fleet(proc)
    return report_checks(report, tmp, args.json)


if __name__ == "__main__":
    sys.exit(main())
