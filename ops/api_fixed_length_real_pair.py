"""``ignore_eos`` and ``min_tokens`` on the real pair, as serving benchmarks send them:
``honcho start`` of the repository's Procfile and .env (the default preset, free ports), then,
at temperature 0, against the fleet target's own plain decoding (its engine in this process,
int8 as the worker runs it, one token a round):

- each question with ``min_tokens`` 24 tokens past its natural answer's end: the target's
  decoding with the end tokens masked for that many tokens (``openai`` client, chat, whole and
  streamed);
- vLLM's serving benchmark request (``POST /v1/completions`` with ``ignore_eos``, streamed with
  usage, its other fields at their defaults; the chat's prompt as token ids): exactly
  ``max_tokens`` tokens, the target's decoding with no end token ending it.

    python ops/api_fixed_length_real_pair.py --json ops/results/api-fixed-length-real-pair-qwen-coder-cpu2-amx.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.api_logprobs_real_pair import QUESTIONS
from ops.api_real_pair import check, new_report, report_checks, served_fleet, timed_run_args
from ops.api_structured_real_pair import Reference


def decoding(ref: Reference, ids: list[int], max_new: int, sid: str, stops: list[int], min_tokens: int) -> list[int]:
    """The target engine's plain greedy decoding, the ``stops`` masked for the first
    ``min_tokens`` tokens and ending it (included) after them."""
    from schemas import CacheSync, ErrorReply, SamplingSpec, VerifyRequest
    from specsplit.orchestrator.state import root_only

    committed, cached, out = list(ids), 0, []
    for rnd in range(max_new):
        sampling = SamplingSpec(masked_token_ids=stops if len(out) < min_tokens and stops else None)
        sync = CacheSync(base_len=cached, append_token_ids=committed[cached:-1], prompt_len=len(ids))
        reply = ref.target.engine.handle(VerifyRequest(session_id=sid, round=rnd, sync=sync, sampling=sampling,
                                                       tree=root_only(committed[-1])))
        assert not isinstance(reply, ErrorReply), reply
        cached = reply.cache_len
        committed.append(reply.bonus_token_id)
        out.append(reply.bonus_token_id)
        if reply.bonus_token_id in stops:
            break
    return out


def main(argv=None) -> int:
    import httpx

    args, tok = timed_run_args(__doc__, argv)
    stops = list(tok.stop_token_ids)
    report = new_report(max_new_tokens=args.max_new_tokens)
    with served_fleet("specsplit-api-fixed-length-", report) as (url, sync, tmp):
        model = report["model"]
        ref = Reference()
        for i, messages in enumerate(QUESTIONS):
            ids = tok.encode_chat(messages)
            natural = decoding(ref, ids, args.max_new_tokens, f"nat-{i}", stops, 0)
            m = min(len(natural) + 24, args.max_new_tokens)
            want = decoding(ref, ids, args.max_new_tokens, f"min-{i}", stops, m)
            text = tok.decode(want)
            body = dict(model=model, messages=messages, max_tokens=args.max_new_tokens, temperature=0,
                        extra_body={"min_tokens": m})
            whole = sync.chat.completions.create(**body)
            check(report, f"q{i}: min_tokens {m} (natural end at {len(natural)}) = the target's decoding with the "
                          "end tokens masked there", whole.choices[0].message.content == text
                  and whole.usage.completion_tokens == len(want), tokens=whole.usage.completion_tokens,
                  answer=whole.choices[0].message.content)
            streamed = "".join(c.choices[0].delta.content or "" for c in sync.chat.completions.create(**body, stream=True)
                               if c.choices)
            check(report, f"q{i}: min_tokens streamed = whole", streamed == whole.choices[0].message.content)
            # vLLM's benchmark_serving request for the openai-completions backend
            # (the prompt as token ids, as its random and sharegpt datasets may send it: the chat's,
            # whose answer ends at an end token that ignore_eos must pass)
            payload = {"model": model, "prompt": ids, "temperature": 0.0, "best_of": 1,
                       "max_tokens": args.max_new_tokens, "logprobs": None, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True}
            want = decoding(ref, ids, args.max_new_tokens, f"eos-{i}", [], 0)
            parts, usage = [], None
            with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=600) as res:
                for line in res.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage") or usage
                        parts += [c["text"] for c in chunk["choices"]]
            check(report, f"q{i}: ignore_eos runs to max_tokens = the target's decoding without an end",
                  res.status_code == 200 and usage and usage["completion_tokens"] == args.max_new_tokens
                  and "".join(parts) == tok.decode(want), tokens=usage and usage["completion_tokens"],
                  ends_passed=sum(t in stops for t in want))
    return report_checks(report, tmp, args.json)


if __name__ == "__main__":
    sys.exit(main())
