"""The HTTP API on the real pair, checked with the official ``openai`` and ``anthropic`` clients:
``honcho start`` of the repository's Procfile and .env (the default preset, free ports), then sync,
async and streaming chat, completions, Responses and Anthropic's Messages at temperature 0 against
the fleet target's own greedy decoding of the same token ids (its engine in this process, int8 as
the worker runs it: a quantized target is its own reference), a stop string,
``previous_response_id``, a Messages prefill against a completion of the same ids, function calls'
round trips (Responses and Messages) against the chat endpoint's answers, a seeded sample twice,
and ``n=2``. Prints each check and writes a JSON report.

    python ops/api_real_pair.py --json ops/results/api-real-pair-qwen-coder.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MESSAGES = [
    [{"role": "user", "content": "Write a Python function that returns True when a number is prime."}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "What does a KV cache store?"}],
]


def start_fleet(tmp: Path, repo: Path = REPO, **settings: str) -> tuple[subprocess.Popen, str]:
    """``honcho start`` of ``repo``'s Procfile and .env on free ports (``settings``: SPECSPLIT_* over
    them); another ``repo`` (a worktree of another commit) runs its own code with this environment."""
    from specsplit.launch import free_ports

    names = ["draft_fe", "draft_be", "target_fe", "target_be", "orch", "api"]
    ports = dict(zip(names, free_ports(len(names))))
    addr = {k: f"tcp://127.0.0.1:{p}" for k, p in ports.items()}
    (tmp / "ports.env").write_text("\n".join([
        f"SPECSPLIT_DRAFT_ROUTER={addr['draft_fe']}", f"SPECSPLIT_DRAFT_BACKEND={addr['draft_be']}",
        f"SPECSPLIT_TARGET_ROUTER={addr['target_fe']}", f"SPECSPLIT_TARGET_BACKEND={addr['target_be']}",
        f"SPECSPLIT_ORCHESTRATOR={addr['orch']}", f"SPECSPLIT_API_PORT={ports['api']}", "SPECSPLIT_METRICS_PORT=0",
        *(f"{k}={v}" for k, v in settings.items()),
    ]) + "\n")
    for k, v in (line.split("=", 1) for line in (tmp / "ports.env").read_text().split()):
        os.environ[k] = v  # this process's producer and reference read the same settings
    log = open(tmp / "fleet.log", "wb")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    if repo != REPO:
        env["PYTHONPATH"] = str(repo)
    proc = subprocess.Popen([sys.executable, "-m", "honcho", "start", "-f", str(repo / "Procfile"),
                             "-e", f"{repo / '.env'},{tmp / 'ports.env'}", "-d", str(repo)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return proc, f"http://127.0.0.1:{ports['api']}"


def wait_health(url: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the fleet stopped")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError("the API did not serve in time")


def reference(tok, ids_list: list[list[int]], max_new: int) -> list[list[int]]:
    """The fleet target's engine alone, greedy, with the worker's settings (bench load's)."""
    from specsplit.bench.fleetenv import environ_with, fleet_defaults
    from specsplit.bench.load import BatchedTarget
    from specsplit.config import WorkerSettings
    from specsplit.models import ModelSettings

    with environ_with(fleet_defaults(REPO / ".env")):
        target = BatchedTarget(WorkerSettings(), ModelSettings())
    return [d.token_ids for d in target.level(ids_list, 1, max_new, tok.stop_token_ids).done]


def check(report: dict, name: str, ok: bool, **detail) -> None:
    report["checks"].append({"check": name, "ok": bool(ok), **detail})
    print(f"[{'ok' if ok else 'FAIL'}] {name}", flush=True)


async def run_checks(url: str, model: str, tok, refs: dict, max_new: int, report: dict) -> None:
    from openai import AsyncOpenAI, OpenAI

    sync = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    for i, messages in enumerate(MESSAGES):
        want = tok.decode(refs[i])
        t0 = time.perf_counter()
        whole = sync.chat.completions.create(model=model, messages=messages, max_tokens=max_new, temperature=0)
        wall = time.perf_counter() - t0
        text = whole.choices[0].message.content
        check(report, f"chat {i}: sync = target greedy", text == want, tokens=whole.usage.completion_tokens,
              wall_s=round(wall, 2), speculative=whole.choices[0].model_extra.get("speculative"))
        res = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_new, temperature=0)
        check(report, f"chat {i}: async = target greedy", res.choices[0].message.content == want)
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_new,
                                                      temperature=0, stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        check(report, f"chat {i}: streamed = non-streamed", streamed == text)
        ids = tok.encode_chat(messages)
        comp = sync.completions.create(model=model, prompt=ids, max_tokens=max_new, temperature=0)
        check(report, f"completion {i}: token ids = target greedy", comp.choices[0].text == want)
        pieces = [c.choices[0].text for c in sync.completions.create(model=model, prompt=ids, max_tokens=max_new,
                                                                     temperature=0, stream=True)]
        check(report, f"completion {i}: streamed = non-streamed", "".join(pieces) == want)
        words = [w for w in want.split() if len(w) >= 4]
        if words:
            stop = words[len(words) // 2]
            cut = sync.completions.create(model=model, prompt=ids, max_tokens=max_new, temperature=0, stop=[stop])
            check(report, f"completion {i}: stop {stop!r} cuts where it begins",
                  cut.choices[0].text == want[:want.index(stop)] and cut.choices[0].finish_reason == "stop")
        await responses_checks(sync, client, model, messages, want, max_new, i, report)
        messages_checks(url, sync, model, tok, messages, want, max_new, i, report)
    continuation_checks(sync, model, max_new, report)
    anthropic_tool_checks(url, sync, model, max_new, report)
    kw = dict(model=model, messages=MESSAGES[0], max_tokens=48, temperature=0.8, top_p=0.95)
    a = sync.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = sync.chat.completions.create(seed=7, **kw).choices[0].message.content
    check(report, "same seed, same sample", a == b)
    two = sync.chat.completions.create(seed=11, n=2, **kw)
    check(report, "n=2 gives two choices", sorted(c.index for c in two.choices) == [0, 1])


async def responses_checks(sync, client, model: str, messages: list[dict], want: str, max_new: int, i: int,
                           report: dict) -> None:
    """The Responses API on one conversation: a system turn as ``instructions``, the rest as
    ``input``; whole, async and streamed, each the target's greedy answer."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    kw = {"model": model, "input": [m for m in messages if m["role"] != "system"], "max_output_tokens": max_new,
          "temperature": 0, "instructions": system[0] if system else None}
    whole = sync.responses.create(**kw)
    check(report, f"responses {i}: sync = target greedy", whole.output_text == want,
          tokens=whole.usage.output_tokens, status=whole.status)
    res = await client.responses.create(**kw)
    check(report, f"responses {i}: async = target greedy", res.output_text == want)
    stream = await client.responses.create(**kw, stream=True)
    streamed = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
    check(report, f"responses {i}: streamed = target greedy", streamed == want)


GREEDY = {"temperature": 0}  # (the anthropic SDK's own arguments no longer include the sampling parameters)


def anthropic_client(url: str):
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=600)


def messages_checks(url: str, sync, model: str, tok, messages: list[dict], want: str, max_new: int, i: int,
                    report: dict) -> None:
    """Anthropic's Messages API on one conversation (a system turn as ``system``): whole and
    through the SDK's stream helper, each the target's greedy answer; ``count_tokens`` the
    template's count; a final assistant message continued as a completion of the same ids."""
    client = anthropic_client(url)
    system = [m["content"] for m in messages if m["role"] == "system"]
    kw = {"model": model, "messages": [m for m in messages if m["role"] != "system"], "max_tokens": max_new,
          "extra_body": GREEDY, **({"system": system[0]} if system else {})}
    whole = client.messages.create(**kw)
    text = "".join(b.text for b in whole.content if b.type == "text")
    check(report, f"messages {i}: sync = target greedy", text == want, tokens=whole.usage.output_tokens,
          stop_reason=whole.stop_reason)
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
    check(report, f"messages {i}: streamed = target greedy", streamed == want)
    counted = client.messages.count_tokens(**{k: v for k, v in kw.items() if k not in ("max_tokens", "extra_body")})
    check(report, f"messages {i}: count_tokens = the template's", counted.input_tokens == len(tok.encode_chat(messages)))
    prefill = want[:len(want) // 3]
    if prefill.strip():
        cont = client.messages.create(**{**kw, "messages": [*kw["messages"], {"role": "assistant", "content": prefill}]})
        ids = tok.encode_chat(messages, prefill=prefill)
        comp = sync.completions.create(model=model, prompt=ids, max_tokens=max_new, temperature=0)
        check(report, f"messages {i}: a prefill continued = a completion of the same ids",
              "".join(b.text for b in cont.content if b.type == "text") == comp.choices[0].text, prefill=prefill)


def anthropic_tool_checks(url: str, sync, model: str, max_new: int, report: dict) -> None:
    """A tool's round trip through the Messages API: its tool_use blocks, and the answer to their
    tool_result blocks, each the chat endpoint's for the same conversation (tools not strict, as
    Anthropic's)."""
    client = anthropic_client(url)
    tool = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    chat_tool = {"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                                  "parameters": tool["input_schema"]}}
    question = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    used = client.messages.create(model=model, messages=question, tools=[tool], max_tokens=max_new, extra_body=GREEDY)
    chat = sync.chat.completions.create(model=model, messages=question, tools=[chat_tool], max_tokens=max_new,
                                        temperature=0).choices[0].message
    uses = [b for b in used.content if b.type == "tool_use"]
    check(report, "messages: tool_use = chat's calls", [(b.name, b.input) for b in uses]
          == [(t.function.name, json.loads(t.function.arguments)) for t in chat.tool_calls or ()],
          calls=[(b.name, b.input) for b in uses], stop_reason=used.stop_reason)
    if uses:
        turn = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in used.content]}
        results = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "18 C, clear"}
                                               for b in uses]}
        after = client.messages.create(model=model, messages=[*question, turn, results], tools=[tool],
                                       max_tokens=max_new, extra_body=GREEDY)
        history = [*question, {"role": "assistant", "content": chat.content, "tool_calls": [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in uses]}, *({"role": "tool", "tool_call_id": b.id, "content": "18 C, clear"} for b in uses)]
        reply = sync.chat.completions.create(model=model, messages=history, tools=[chat_tool], max_tokens=max_new,
                                             temperature=0).choices[0].message
        text = "".join(b.text for b in after.content if b.type == "text")
        check(report, "messages: the tool_result answered = chat's", text == (reply.content or ""), text=text[:200])


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


def continuation_checks(sync, model: str, max_new: int, report: dict) -> None:
    """``previous_response_id`` and a function call's round trip, each the chat endpoint's answer
    to the same conversation (its tools shown the same way)."""
    ask = {"role": "user", "content": "And the same in JavaScript?"}
    first = sync.responses.create(model=model, input=MESSAGES[0], max_output_tokens=max_new, temperature=0)
    more = sync.responses.create(model=model, previous_response_id=first.id, input=[ask], max_output_tokens=max_new,
                                 temperature=0)
    chat = sync.chat.completions.create(model=model, max_tokens=max_new, temperature=0, messages=[
        *MESSAGES[0], {"role": "assistant", "content": first.output_text}, ask])
    check(report, "responses: previous_response_id = chat with the whole conversation",
          more.output_text == chat.choices[0].message.content, tokens=more.usage.output_tokens,
          cached_tokens=more.usage.input_tokens_details.cached_tokens, input_tokens=more.usage.input_tokens)
    question = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    called = sync.responses.create(model=model, input=question, tools=[WEATHER], max_output_tokens=max_new,
                                   temperature=0)
    tool = {"type": "function", "function": {**{k: v for k, v in WEATHER.items() if k != "type"}, "strict": True}}
    chat = sync.chat.completions.create(model=model, messages=question, tools=[tool], max_tokens=max_new,
                                        temperature=0).choices[0].message
    calls = [c for c in called.output if c.type == "function_call"]
    check(report, "responses: function calls = chat's", [(c.name, c.arguments) for c in calls]
          == [(t.function.name, t.function.arguments) for t in chat.tool_calls or ()],
          calls=[(c.name, c.arguments) for c in calls])
    if calls:
        result = [{"type": "function_call_output", "call_id": c.call_id, "output": "18 C, clear"} for c in calls]
        after = sync.responses.create(model=model, previous_response_id=called.id, input=result, tools=[WEATHER],
                                      max_output_tokens=max_new, temperature=0)
        history = [*question, {"role": "assistant", "content": chat.content, "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]}, *({"role": "tool", "tool_call_id": c.call_id, "content": "18 C, clear"} for c in calls)]
        reply = sync.chat.completions.create(model=model, messages=history, tools=[tool], max_tokens=max_new,
                                             temperature=0).choices[0].message
        again = [(c.name, c.arguments) for c in after.output if c.type == "function_call"]
        check(report, "responses: the call's output answered = chat's", after.output_text == (reply.content or "")
              and again == [(t.function.name, t.function.arguments) for t in reply.tool_calls or ()],
              text=after.output_text[:200], calls=again)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    from specsplit.api.tokenizer import ServedTokenizer
    from specsplit.models import ModelSettings, resolve_model_paths

    tok = ServedTokenizer(resolve_model_paths(ModelSettings()).target)
    prompts = [tok.encode_chat(m) for m in MESSAGES]
    report = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "checks": [],
              "date": time.strftime("%Y-%m-%d"), "max_new_tokens": args.max_new_tokens}
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-api-real-"))
    proc, url = start_fleet(tmp)
    try:
        refs = dict(enumerate(reference(tok, prompts, args.max_new_tokens)))
        wait_health(url, proc)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        report["model"] = model
        asyncio.run(run_checks(url, model, tok, refs, args.max_new_tokens, report))
    finally:
        stop_fleet(proc)
    return report_checks(report, tmp, args.json)


def timed_run_args(doc: str, argv) -> tuple[argparse.Namespace, object]:
    """The arguments of a script that checks answers, then times them each way (``--repeats``),
    and the default preset's served tokenizer."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each question, each way")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    from specsplit.api.tokenizer import ServedTokenizer
    from specsplit.models import ModelSettings, resolve_model_paths

    return args, ServedTokenizer(resolve_model_paths(ModelSettings()).target)


def time_ways(report: dict, repeats: int, cases, header: str) -> None:
    """Times each case's ways, alternating their order run by run: ``cases`` is
    [(label prefix, [(way, call)])], ``call()`` returns (a chat completion, its wall seconds).
    ``report["timings"]``: mean tok/s and tokens a round per label; printed as a table."""
    import statistics

    timings: dict[str, dict[str, list[float]]] = {}
    for r in range(repeats):
        for prefix, ways in cases:
            for way, call in (ways if r % 2 == 0 else ways[::-1]):
                res, wall = call()
                spec = res.choices[0].model_extra.get("speculative") or {}
                t = timings.setdefault(f"{prefix}{way}", {"tok_s": [], "per_round": []})
                t["tok_s"].append(res.usage.completion_tokens / wall)
                t["per_round"].append(spec.get("mean_accepted_length") or 0.0)
    report["timings"] = {k: {m: round(statistics.mean(v), 3) for m, v in t.items()} for k, t in timings.items()}
    print(f"\n| {header} | tok/s | tokens a round |\n|---|---|---|")
    for k, t in report["timings"].items():
        print(f"| {k} | {t['tok_s']} | {t['per_round']} |")


def new_report(**extra) -> dict:
    """A real-pair report's header: the machine, the date, and ``extra``."""
    return {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "checks": [],
            "date": time.strftime("%Y-%m-%d"), **extra}


@contextlib.contextmanager
def served_fleet(prefix: str, report: dict, **settings: str):
    """The default fleet under honcho (``settings``: SPECSPLIT_* over its .env), healthy: yields
    (the API's url, an ``openai`` client, the fleet's folder), the served model's name in
    ``report``; stopped on the way out."""
    from openai import OpenAI

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    proc, url = start_fleet(tmp, **settings)
    try:
        wait_health(url, proc)
        report["model"] = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        yield url, OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600), tmp
    finally:
        stop_fleet(proc)


def stop_fleet(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


def report_checks(report: dict, tmp: Path, path: str | None) -> int:
    """Prints the tally, writes the report (when ``path``); 0 when every check passed."""
    ok = all(c["ok"] for c in report["checks"])
    print(f"{sum(c['ok'] for c in report['checks'])}/{len(report['checks'])} checks passed (fleet log: {tmp})")
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
