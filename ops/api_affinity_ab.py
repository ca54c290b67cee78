"""A/B of the API's conversation affinity (``SPECSPLIT_API_PROMPT_ROUTES``) on one fleet, in one run.

One fleet as people start it (``honcho start``, the repository's Procfile and .env, the default
real pair) with two target workers (``-c target=2``), plus a second API process on the same
orchestrator with the affinity off. Each chat10 prompt starts a two-turn conversation at each
door through the official ``openai`` client, streaming, greedy, without ``prompt_cache_key``:
the first turn, then the answer and a follow-up question (``--turns``). The doors' system prompts differ in
their first words, so neither door's prompts begin like the other's (no prefix shared across
doors); the door that goes first alternates by conversation. Per door and turn: time to the
first streamed text, the prompt's tokens and how many came from a prefix cache
(``usage.prompt_tokens_details.cached_tokens``).

    python ops/api_affinity_ab.py --json ops/results/api-affinity-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
FOLLOW_UPS = ("Now write a short test for it, and explain the test in one sentence.",
              "What could go wrong with it? Name two cases.", "Summarize the conversation in two sentences.")
SYSTEM = {"A": "Door A. You are a helpful assistant.", "B": "Door B. You are a helpful assistant."}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default="chat10", help="first turns: a named set or a JSONL file")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--targets", type=int, default=2, help="target workers")
    p.add_argument("--turns", type=int, default=2, help="turns a conversation (2 to 4); the last one is reported")
    p.add_argument("--json", dest="json_path")
    return p.parse_args(argv)


def turn(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return {"text": "".join(text), "first_token_s": first, "total_s": time.perf_counter() - t0,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens}


def wait_api(url: str, fleet, timeout_s: float = 900.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        fleet.check()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not become healthy")
        time.sleep(2)


def main(argv=None) -> int:
    a = parse(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import openai

    from specsplit.bench.fleetenv import fleet_defaults
    from specsplit.bench.honcho import HonchoFleet
    from specsplit.bench.systems import jsonl_prompts
    from specsplit.launch import free_ports
    from specsplit.models import ModelSettings

    firsts = jsonl_prompts(a.prompts)[:a.limit]
    tmp = Path(tempfile.mkdtemp(prefix="api-affinity-ab-"))
    fleet = HonchoFleet(tmp, ModelSettings().preset, fleet_defaults(None), concurrency=f"target={a.targets}",
                        SPECSPLIT_API_PROMPT_ROUTES="16384").start()
    (b_port,) = free_ports(1)
    fleet.beside("api", "b", SPECSPLIT_API_PORT=str(b_port), SPECSPLIT_API_PROMPT_ROUTES="0")
    urls = {"A": fleet.api_url, "B": f"http://127.0.0.1:{b_port}"}
    rows: list[dict] = []
    try:
        for door, url in urls.items():
            wait_api(url, fleet)
            print(f"door {door} ready ({url})", flush=True)
        clients = {d: openai.OpenAI(base_url=f"{u}/v1", api_key="unused", timeout=600) for d, u in urls.items()}
        model = clients["A"].models.list().data[0].id
        for i, first in enumerate(firsts):
            for door in ("A", "B") if i % 2 == 0 else ("B", "A"):
                messages = [{"role": "system", "content": SYSTEM[door]}, {"role": "user", "content": first}]
                one = two = turn(clients[door], model, messages, a.max_tokens)
                for follow_up in FOLLOW_UPS[:a.turns - 1]:
                    messages += [{"role": "assistant", "content": two["text"]}, {"role": "user", "content": follow_up}]
                    two = turn(clients[door], model, messages, a.max_tokens)
                rows.append({"conversation": i, "door": door, **{f"turn1_{k}": v for k, v in one.items() if k != "text"},
                             **{f"last_{k}": v for k, v in two.items() if k != "text"}})
                print(f"conversation {i} door {door}: turn {a.turns} {two['prompt_tokens']} prompt tokens, "
                      f"{two['cached_tokens']} cached, first text after {two['first_token_s']:.3f} s "
                      f"(turn 1: {one['first_token_s']:.3f} s)", flush=True)
    finally:
        fleet.stop()

    def door_rows(d: str) -> list[dict]:
        return [r for r in rows if r["door"] == d]

    summary = {d: {"last_first_token_s": statistics.median(r["last_first_token_s"] for r in door_rows(d)),
                   "turn1_first_token_s": statistics.median(r["turn1_first_token_s"] for r in door_rows(d)),
                   "last_cached_fraction": sum(r["last_cached_tokens"] for r in door_rows(d))
                   / sum(r["last_prompt_tokens"] for r in door_rows(d)),
                   "last_hits": sum(r["last_cached_tokens"] > 0 for r in door_rows(d))} for d in urls}
    n = len(firsts)
    print(f"\n| door | affinity | turn {a.turns}: cached / prompt tokens | turn {a.turns} hits | turn {a.turns} first text "
          "(median s) | turn 1 first text (median s) |\n|---|---|---|---|---|---|")
    for d, on in (("A", "on"), ("B", "off")):
        s = summary[d]
        print(f"| {d} | {on} | {s['last_cached_fraction']:.0%} | {s['last_hits']}/{n} | "
              f"{s['last_first_token_s']:.3f} | {s['turn1_first_token_s']:.3f} |")
    if a.json_path:
        from specsplit.bench.api import machine_info

        out = {"machine": machine_info(), "args": vars(a), "summary": summary, "rows": rows}
        Path(a.json_path).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
