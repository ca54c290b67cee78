"""Tool calls and JSON output on the real pair, checked with the official ``openai`` client:
``honcho start`` of the repository's Procfile and .env (the default preset, free ports), then,
at temperature 0, each answer against the fleet target's own greedy decoding of the same prompt
ids (its engine in this process, int8 as the worker runs it: a quantized target is its own
reference). Tool calls, parsed by the API's own parser:

- "auto": a question a tool answers (a call expected), then the tool's result sent back (a text
  answer expected), and a question no tool answers;
- "required", a named function, "none", and ``parallel_tool_calls: false`` on a question that
  asks for two calls;
- "auto" with strict functions (a lazy grammar: free text, calls held to the schemas), on a
  question a tool answers and on one no tool answers;
- each streamed (the client's own stream accumulator) and whole.

JSON output (``response_format``): a JSON schema and ``json_object``, each equal to the target's
greedy decoding masked to the schema (the same engine, one token a round), valid JSON, and timed
against the same question answered without a format. vLLM's constraints (``structured_outputs``:
a choice, a regex, a GBNF grammar, a schema with compact JSON; ``guided_choice``; SGLang's
``ebnf``): each the target's greedy decoding masked to its grammar. ``--parts`` picks among
``tools``, ``json`` and ``vllm``.

Prints each check and writes a JSON report with every answer.

    python ops/api_structured_real_pair.py --json ops/results/api-structured-real-pair-qwen-coder.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.api_real_pair import check, new_report, report_checks, served_fleet

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
STRICT = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
TWO = [{"role": "user", "content": "What's the weather in Paris and in Tokyo?"}]
CHAT = [{"role": "user", "content": "Write a Python one-liner that reverses a string."}]

# (name, messages, extra request fields); "answer" is filled in from the first case's call
CASES = [
    ("auto: a question a tool answers", ASK, {}),
    ("auto: the tool's result sent back", None, {}),
    ("auto: a question no tool answers", CHAT, {}),
    ("required", CHAT, {"tool_choice": "required"}),
    ("named get_time", ASK, {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
    ("none", ASK, {"tool_choice": "none"}),
    ("parallel_tool_calls false", TWO, {"parallel_tool_calls": False}),
    ("auto, strict: a question a tool answers", ASK, {"tools": STRICT}),
    ("auto, strict: a question no tool answers", CHAT, {"tools": STRICT}),
]


class Reference:
    """The fleet target's engine alone, greedy, with the worker's settings (as api_real_pair's)."""

    def __init__(self) -> None:
        from specsplit.bench.fleetenv import environ_with, fleet_defaults
        from specsplit.bench.load import BatchedTarget
        from specsplit.config import WorkerSettings
        from specsplit.models import ModelSettings

        with environ_with(fleet_defaults(REPO / ".env")):
            self.target = BatchedTarget(WorkerSettings(), ModelSettings())

    def greedy(self, tok, ids: list[int], max_new: int) -> list[int]:
        return self.target.level([ids], 1, max_new, tok.stop_token_ids).done[0].token_ids

    def masked_greedy(self, tok, ids: list[int], max_new: int, grammar) -> list[int]:
        """Greedy decoding masked to ``grammar``: a one-node tree a round on the worker's engine."""
        from schemas import CacheSync, ErrorReply, VerifyRequest
        from specsplit.orchestrator.state import root_only

        committed, cached, out = list(ids), 0, []
        for rnd in range(max_new):
            sync = CacheSync(base_len=cached, append_token_ids=committed[cached:-1], prompt_len=len(ids))
            reply = self.target.engine.handle(VerifyRequest(session_id=f"masked-{id(grammar)}", round=rnd, sync=sync,
                                                            tree=root_only(committed[-1]), grammar=grammar))
            assert not isinstance(reply, ErrorReply), reply
            cached = reply.cache_len
            committed.append(reply.bonus_token_id)
            out.append(reply.bonus_token_id)
            if reply.bonus_token_id in tok.stop_token_ids:
                break
        return out


def expect(tok, ids: list[int], generated: list[int], body: dict) -> dict:
    """What the API must answer for a greedy generation: the API's parser over its text."""
    from specsplit.api import protocol, tools

    plan = tools.plan(protocol.parse(protocol.ChatCompletionRequest, body), tok.added_tokens)
    text = tok.decode(generated)
    if plan is None:
        return {"content": text, "calls": []}
    parser = plan.parser()
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    content, calls = content + rest, calls + more
    return {"content": content or (None if calls else content), "calls": [(c.name, c.arguments) for c in calls]}


def answer(msg) -> dict:
    calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    return {"content": msg.content, "calls": calls}


def run_case(sync, ref: Reference, tok, model: str, name: str, messages: list, extra: dict, max_new: int, report: dict) -> dict:
    from specsplit.api import protocol, tools

    body = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": max_new, "temperature": 0, **extra}
    req = protocol.parse(protocol.ChatCompletionRequest, body)
    plan = tools.plan(req, tok.added_tokens)
    ids = tok.encode_chat(tools.turns(req), tools=plan.tools if plan else None, prefill=plan.prefill if plan else "")
    # "required", a named function and strict functions hold the calls to the tools' schemas:
    # masked greedy decoding
    generated = ref.masked_greedy(tok, ids, max_new, plan.grammar) if plan and plan.grammar else \
        ref.greedy(tok, ids, max_new)
    want = expect(tok, ids, generated, body)
    t0 = time.perf_counter()
    whole = sync.chat.completions.create(**{k: v for k, v in body.items()})
    wall = time.perf_counter() - t0
    got = answer(whole.choices[0].message)
    from openai import LengthFinishReasonError

    try:
        with sync.chat.completions.stream(**body) as stream:  # the client's own accumulator
            for _ in stream:
                pass
            final = stream.current_completion_snapshot  # (its final one refuses "length")
    except LengthFinishReasonError as e:  # so does its stream, with strict tools
        final = e.completion
    streamed = answer(final.choices[0].message)
    streamed["content"] = streamed["content"] or None  # the stream's first delta carries content ""
    check(report, f"{name}: = the target's greedy answer, parsed", got == want, finish=whole.choices[0].finish_reason,
          answer=got, prompt_tokens=whole.usage.prompt_tokens, wall_s=round(wall, 2))
    check(report, f"{name}: streamed = whole", streamed == got, streamed=streamed)
    check(report, f"{name}: prompt tokens = the template's", whole.usage.prompt_tokens == len(ids))
    return {"response": whole, "answer": got, "finish": whole.choices[0].finish_reason}


PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "languages"], "additionalProperties": False}
DESCRIBE = [{"role": "user", "content": "Describe a fictional software engineer: name, age and languages."}]
WHERE = [{"role": "user", "content": "Where is the Eiffel Tower? Answer with the city and the country."}]


def run_json(sync, ref: Reference, tok, model: str, max_new: int, report: dict) -> None:
    from specsplit.api import protocol

    # the target builds its grammar tokenizer at the first grammar (~2 s): not in the timings
    sync.chat.completions.create(model=model, messages=WHERE, max_tokens=1, response_format={"type": "json_object"})
    for name, messages, fmt in (
            ("json_schema", DESCRIBE, {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}),
            ("json_object", WHERE, {"type": "json_object"})):
        body = {"model": model, "messages": messages, "max_tokens": max_new, "temperature": 0, "response_format": fmt}
        grammar = protocol.grammar_of(protocol.parse(protocol.ChatCompletionRequest, body).response_format)
        ids = tok.encode_chat(messages)
        want = tok.decode(ref.masked_greedy(tok, ids, max_new, grammar))
        t0 = time.perf_counter()
        whole = sync.chat.completions.create(**body)
        wall = time.perf_counter() - t0
        text = whole.choices[0].message.content
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        fits = isinstance(value, dict) and (name != "json_schema" or (set(value) == set(PERSON["properties"])
                                                                      and isinstance(value["age"], int)))
        spec = whole.choices[0].model_extra.get("speculative") or {}
        check(report, f"{name}: = the target's greedy answer masked to the schema", text == want, answer=text,
              finish=whole.choices[0].finish_reason, tokens=whole.usage.completion_tokens, wall_s=round(wall, 2),
              mean_accepted_length=spec.get("mean_accepted_length"))
        check(report, f"{name}: valid JSON that fits", fits)
        without = sync.chat.completions.create(model=model, messages=messages, max_tokens=max_new, temperature=0)
        free = without.choices[0].model_extra.get("speculative") or {}
        report.setdefault("without_a_format", {})[name] = {
            "answer": without.choices[0].message.content, "tokens": without.usage.completion_tokens,
            "mean_accepted_length": free.get("mean_accepted_length")}
        stream = sync.chat.completions.create(**body, stream=True)
        check(report, f"{name}: streamed = whole",
              "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text)


SENTIMENT = [{"role": "user", "content": "Is this review positive or negative? 'The battery died in a day.'"}]
STATES = [{"role": "user", "content": "List five US states, one per line, each line '- Name'."}]
SQL_ASK = [{"role": "user", "content": "Write a SQL query for the names of users older than 30 in the users table."}]
VLLM = [  # (name, messages, extra body: vLLM's constraints as its clients send them, SGLang's)
    ("structured_outputs.choice", SENTIMENT, {"structured_outputs": {"choice": ["positive", "negative"]}}),
    ("structured_outputs.regex", STATES, {"structured_outputs": {"regex": r"(- [A-Z][a-z]+( [A-Z][a-z]+)?\n){5}"}}),
    ("structured_outputs.grammar (GBNF)", SQL_ASK, {"structured_outputs": {"grammar": (
        'root ::= "SELECT " ident (", " ident)* " FROM " ident (" WHERE " ident " " ("<" | ">" | "=") " " [0-9]+)? ";"'
        '\nident ::= [a-z_]+')}}),
    ("structured_outputs.json + disable_any_whitespace", DESCRIBE,
     {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}),
    ("guided_choice (before vLLM 0.12)", SENTIMENT, {"guided_choice": ["positive", "negative"]}),
    ("ebnf (SGLang's)", SQL_ASK, {"ebnf": 'root ::= "SELECT name FROM users WHERE age > " [0-9]+ ";"'}),
]


def run_vllm(sync, ref: Reference, tok, model: str, max_new: int, report: dict) -> None:
    """vLLM's (and SGLang's) constraints through the ``openai`` client's extra_body: each answer
    the target's greedy decoding masked to the constraint's grammar, streamed = whole."""
    import re

    from specsplit.api import protocol
    from specsplit.api.structured import constraint_of

    for name, messages, extra in VLLM:
        body = {"model": model, "messages": messages, "max_tokens": max_new, "temperature": 0, **extra}
        _, grammar = constraint_of(protocol.parse(protocol.ChatCompletionRequest, body))
        want = tok.decode(ref.masked_greedy(tok, tok.encode_chat(messages), max_new, grammar))
        kwargs = {"model": model, "messages": messages, "max_tokens": max_new, "temperature": 0, "extra_body": extra}
        whole = sync.chat.completions.create(**kwargs)
        text = whole.choices[0].message.content
        spec = whole.choices[0].model_extra.get("speculative") or {}
        check(report, f"{name}: = the target's greedy answer masked to it", text == want, answer=text,
              finish=whole.choices[0].finish_reason, tokens=whole.usage.completion_tokens,
              mean_accepted_length=spec.get("mean_accepted_length"))
        if grammar.kind == "regex":
            check(report, f"{name}: the whole answer matches", re.fullmatch(grammar.text, text) is not None)
        elif "choice" in json.dumps(extra):
            check(report, f"{name}: one of the choices", text in ("positive", "negative"))
        stream = sync.chat.completions.create(**kwargs, stream=True)
        check(report, f"{name}: streamed = whole",
              "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text)
    # a regex past llguidance's limits over this vocabulary: refused, naming why; the fleet goes on
    import openai

    t0 = time.perf_counter()
    try:
        sync.chat.completions.create(model=model, messages=SENTIMENT, max_tokens=8, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "(a{1000}){1000}"}})
        refused = None
    except openai.BadRequestError as exc:
        refused = str(exc)
    check(report, "a regex past the grammar engine's limits: a 400 naming its error", refused is not None
          and "grammar" in refused, error=refused, wall_s=round(time.perf_counter() - t0, 2))
    again = sync.chat.completions.create(model=model, messages=SENTIMENT, max_tokens=8, temperature=0,
                                         extra_body={"structured_outputs": {"choice": ["positive", "negative"]}})
    check(report, "then the fleet answers as before", again.choices[0].message.content in ("positive", "negative"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--parts", default="tools,json,vllm", help="of tools, json, vllm: which checks to run")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    from specsplit.api.tokenizer import ServedTokenizer
    from specsplit.models import ModelSettings, resolve_model_paths

    tok = ServedTokenizer(resolve_model_paths(ModelSettings()).target)
    report = new_report(max_new_tokens=args.max_new_tokens)
    with served_fleet("specsplit-api-structured-", report) as (_, sync, tmp):
        model = report["model"]
        ref = Reference()
        if "vllm" in parts:
            run_vllm(sync, ref, tok, model, args.max_new_tokens, report)
        if "json" in parts:
            run_json(sync, ref, tok, model, max(args.max_new_tokens, 160), report)
        if "tools" not in parts:
            return report_checks(report, tmp, args.json)
        results: dict[str, dict] = {}
        for name, messages, extra in CASES:
            if messages is None:  # the first case's call, answered
                msg = results[CASES[0][0]]["response"].choices[0].message
                calls = msg.tool_calls or []
                messages = ASK + [{"role": "assistant", "content": msg.content,
                                   "tool_calls": [c.model_dump() for c in calls]}]
                messages += [{"role": "tool", "tool_call_id": c.id,
                              "content": json.dumps({"city": "Paris", "temperature_c": 18, "sky": "overcast"})}
                             for c in calls]
            results[name] = run_case(sync, ref, tok, model, name, messages, extra, args.max_new_tokens, report)
        calls = {name: [c[0] for c in r["answer"]["calls"]] for name, r in results.items()}
        check(report, "auto: the weather question is a call to get_weather", calls[CASES[0][0]][:1] == ["get_weather"])
        # what the model makes of the tool's result is its own choice: recorded, not checked
        report["after_the_result"] = results[CASES[1][0]]["answer"]
        check(report, "required makes a call", bool(calls["required"]))
        check(report, "named get_time is a call to get_time", calls["named get_time"][:1] == ["get_time"])
        check(report, "none makes no call", not calls["none"])
        check(report, "auto, strict: the weather question is a call to get_weather",
              calls["auto, strict: a question a tool answers"][:1] == ["get_weather"])
        check(report, "parallel_tool_calls false makes one call", len(calls["parallel_tool_calls false"]) == 1
              and results["parallel_tool_calls false"]["finish"] == "tool_calls")
    return report_checks(report, tmp, args.json)


if __name__ == "__main__":
    sys.exit(main())
