"""Tool calling's parts without a fleet: the parser of the model's calls (every way its text may
be split into deltas gives one answer), the requests and histories the API takes or refuses, and
the prompt the Qwen2.5 template renders for them (tests/test_api.py runs it through a fleet)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specsplit.api import tools
from specsplit.api.protocol import ApiError, ChatCompletionRequest, parse
from specsplit.api.tools import CLOSE, OPEN, CallParser

TEMPLATE = Path(__file__).parent / "data" / "qwen2.5-chat-template.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def call(name: str, args: dict | str) -> str:
    body = {"name": name, "arguments": args}
    return f"{OPEN}\n{json.dumps(body)}\n{CLOSE}"


def parse_whole(text: str, prefill: str = "", single: bool = False, names=frozenset()):
    return parse_split(text, [len(text)], prefill, single, names)


def parse_split(text: str, cuts: list[int], prefill: str = "", single: bool = False, names=frozenset()):
    p = CallParser(prefill, single, frozenset(names))
    out, calls, last = [], [], 0
    for cut in [*cuts, len(text)]:
        t, c = p.feed(text[last:cut])
        out.append(t)
        calls += c
        last = cut
    t, c = p.finish()
    out.append(t)
    calls += c
    assert [c.index for c in calls] == list(range(len(calls)))
    return "".join(out), [(c.name, c.arguments) for c in calls]


# what the Qwen2.5 models write (the template's own format), and what the API must make of it
CASES = [
    ("Use `a[::-1]`.", ("Use `a[::-1]`.", [])),
    (call("get_weather", {"city": "Paris"}), ("", [("get_weather", '{"city": "Paris"}')])),
    ("Let me check.\n" + call("get_weather", {"city": "Paris"}),
     ("Let me check.", [("get_weather", '{"city": "Paris"}')])),
    (call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {"city": "Tokyo"}),
     ("", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"city": "Tokyo"}')])),
    (call("f", {}) + "\nDone.\n", ("Done.", [("f", "{}")])),
    (call("f", '{"x": 1}'), ("", [("f", '{"x": 1}')])),  # arguments written as a JSON string
    (call("f", {"s": "é 日本"}), ("", [("f", '{"s": "é 日本"}')])),
    # blocks that hold no call stay text, and so does an unfinished one
    (f"{OPEN}\nnot json\n{CLOSE}", (f"{OPEN}\nnot json\n{CLOSE}", [])),
    (f'{OPEN}{{"arguments": {{}}}}{CLOSE} x', (f'{OPEN}{{"arguments": {{}}}}{CLOSE} x', [])),
    (f'{OPEN}{{"name": "f", "arguments": 3}}{CLOSE}', (f'{OPEN}{{"name": "f", "arguments": 3}}{CLOSE}', [])),
    ('a\n' + f'{OPEN}\n{{"name": "f", "argu', ('a\n' + f'{OPEN}\n{{"name": "f", "argu', [])),
    # a block the answer ends in is a call when its body is one
    ('a\n' + f'{OPEN}\n{{"name": "f", "arguments": {{}}}}\n', ('a', [("f", "{}")])),
    ("if a < b and c <tool", ("if a < b and c <tool", [])),
    ("  leading and trailing  \n", ("  leading and trailing  \n", [])),
    ("x </tool_call> y", ("x </tool_call> y", [])),
]


@pytest.mark.parametrize("text,want", CASES)
def test_the_models_text_parses_to_its_calls(text, want):
    assert parse_whole(text) == want


@pytest.mark.parametrize("text,want", CASES)
def test_every_split_of_the_text_parses_the_same(text, want):
    for cut in range(len(text) + 1):
        assert parse_split(text, [cut]) == want, cut
    rng = random.Random(text)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        assert parse_split(text, cuts) == want, cuts


# what small models write instead (Qwen2.5-Coder-1.5B, greedy, ops/results/api-tools-real-pair-*.json):
# an answer that is nothing but a call object naming one of the tools is that call
BARE = [
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
     ("", [("get_weather", '{"city": "Paris"}')])),
    ('\n{"name": "get_weather", "arguments": {}}\n', ("", [("get_weather", "{}")])),
    ('```JSON\n{"name": "get_weather", "arguments": "{}"}```', ("", [("get_weather", "{}")])),
    # ... and nothing else is
    ('```json\n{"name": "reverse", "arguments": {}}\n```', ('```json\n{"name": "reverse", "arguments": {}}\n```', [])),
    ('```python\nprint({"name": "get_weather"})\n```', ('```python\nprint({"name": "get_weather"})\n```', [])),
    ('{"name": "get_weather", "arguments": {}} and more', ('{"name": "get_weather", "arguments": {}} and more', [])),
    ('```json\n{"a": 1}\n```', ('```json\n{"a": 1}\n```', [])),
    ("```", ("```", [])),
    ("``", ("``", [])),
    (" {", (" {", [])),
    ("Sure: " + call("get_weather", {}), ("Sure:", [("get_weather", "{}")])),
]


@pytest.mark.parametrize("text,want", BARE)
def test_an_answer_that_is_only_a_call_object_is_that_call(text, want):
    for cut in range(len(text) + 1):
        assert parse_split(text, [cut], names={"get_weather"}) == want, cut
    if want[1] and OPEN not in text:  # the same answer to a parser shown no tools is text
        assert parse_whole(text) == (text, [])


def test_text_is_held_back_only_while_the_answer_may_be_a_call_object():
    p = CallParser(names=frozenset({"f"}))
    assert p.feed("``") == ("", []) and p.feed("`py") == ("```py", [])
    p = CallParser(names=frozenset({"f"}))
    assert p.feed(" \n{") == ("", []) and p.feed('"name"') == ("", [])
    assert p.finish() == (' \n{"name"', [])


def test_text_without_a_call_comes_back_exactly():
    rng = random.Random(7)
    pieces = ["<", "tool", "_call", ">", "</", "\n", " ", "x", "{", "}", '"', "é", "<tool_call", "\t"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        if OPEN in text:
            continue
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 3)))
        assert parse_split(text, cuts) == (text, []), text


def test_a_forced_opening_shows_no_text_and_completes_the_call():
    assert parse_whole('f", "arguments": {"a": 1}}\n' + CLOSE, prefill=OPEN + '\n{"name": "') == \
        ("", [("f", '{"a": 1}')])
    named = f'{OPEN}\n{{"name": "get_time", "arguments": '
    assert parse_whole('{"city": "Tokyo"}}\n' + CLOSE, prefill=named) == ("", [("get_time", '{"city": "Tokyo"}')])
    # what the model wrote after a forced opening that makes no call is the turn's text, opening included
    assert parse_whole("oops", prefill=named) == (named + "oops", [])


def test_one_call_ends_the_answer_when_parallel_calls_are_off():
    p = CallParser(single=True)
    text, calls = p.feed(call("a", {}) + "\n" + call("b", {}))
    assert (text, [c.name for c in calls], p.ended) == ("", ["a"], True)
    assert p.feed("more") == ("", []) and p.finish() == ("", [])
    assert parse_whole("x " + call("a", {}) + call("b", {})) == ("x", [("a", "{}"), ("b", "{}")])


def test_calls_get_distinct_openai_ids():
    _, calls = CallParser().feed(call("a", {}) + call("b", {}))
    ids = [c.message()["id"] for c in calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert calls[1].delta() == {"index": 1, **calls[1].message()}
    assert calls[1].message()["function"] == {"name": "b", "arguments": "{}"}


# ---------------------------------------------------------------------------- requests
def chat(**kw) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def refused(param: str, **kw) -> str:
    with pytest.raises(ApiError) as e:
        req = chat(**kw)
        tools.plan(req)
        tools.turns(req)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    return e.value.message


def test_tool_choices_plan_what_the_turn_begins_with():
    assert tools.plan(chat()) is None and tools.plan(chat(tools=[])) is None
    assert tools.plan(chat(tools=[WEATHER], tool_choice="none")) is None
    auto = tools.plan(chat(tools=[WEATHER]))
    assert auto.prefill == "" and not auto.single and auto.tools == [WEATHER]
    assert tools.plan(chat(tools=[WEATHER], tool_choice="required")).prefill == OPEN + '\n{"name": "'
    named = tools.plan(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.prefill == f'{OPEN}\n{{"name": "get_weather", "arguments": '
    assert tools.plan(chat(tools=[WEATHER], parallel_tool_calls=False)).single
    # a function named like a choice is still a named choice
    auto_fn = {"type": "function", "function": {"name": "auto"}}
    assert tools.plan(chat(tools=[auto_fn], tool_choice={"type": "function", "function": {"name": "auto"}})).prefill \
        .endswith('"auto", "arguments": ')


def test_what_cannot_be_honoured_or_is_malformed_is_a_400_naming_it():
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    assert tools.plan(chat(tools=[strict], tool_choice="required")).grammar is not None
    assert tools.plan(chat(tools=[strict])).grammar is not None  # "auto": the lazy grammar
    assert tools.plan(chat(tools=[WEATHER])).grammar is None  # nothing strict: nothing constrained
    unenforceable = {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}
    assert "'f'" in refused("tools", tools=[unenforceable], tool_choice="required")
    assert "'f'" in refused("tools", tools=[strict, unenforceable])
    huge = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(100)}}}} for i in range(40)]
    assert "grammar over" in refused("tools", tools=huge, tool_choice="required")
    refused("tool_choice", tool_choice="required")
    refused("tool_choice", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    refused("tool_choice", tools=[WEATHER], tool_choice="sometimes")
    refused("tools", tools=[WEATHER, WEATHER])
    refused("tools", tools=[{"type": "function", "function": {"name": "has space"}}])
    refused("tools", tools=[{"type": "retrieval"}])
    refused("tools", tools=[WEATHER] * 129)
    refused("parallel_tool_calls", tools=[WEATHER], parallel_tool_calls="sometimes")
    refused("functions", functions=[WEATHER["function"]])


def test_required_and_named_calls_are_held_to_the_tools_schemas():
    """The grammar after a forced opening (llguidance, on the tiny tokenizer, whose tags are text):
    a call of one of the tools with fitting arguments passes, anything else does not."""
    import llguidance.hf
    from llguidance import LLMatcher

    from specsplit.engine.grammar import to_grammar
    from tests.api_fleet import tiny_pair

    hf = tiny_pair()[1].tok
    lltok = llguidance.hf.from_tokenizer(hf)
    time_fn = {"type": "function", "function": {"name": "get_time"}}

    def passes(plan, text: str) -> bool:
        m = LLMatcher(lltok, to_grammar(plan.grammar))
        ids = hf.encode(text, add_special_tokens=False)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    required = tools.plan(chat(tools=[WEATHER, time_fn], tool_choice="required"))
    one = 'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert passes(required, one)
    assert passes(required, one + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not passes(required, 'reverse", "arguments": {}}\n</tool_call>')  # not a tool
    assert not passes(required, 'get_weather", "arguments": {"town": "Paris"}}\n</tool_call>')  # no city
    single = tools.plan(chat(tools=[WEATHER, time_fn], tool_choice="required", parallel_tool_calls=False))
    assert passes(single, one) and not passes(single, one + '\n<tool_call>\n{"name": "get_time", "arguments": {}}')
    named = tools.plan(chat(tools=[WEATHER, time_fn], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert passes(named, '{"tz": 1}}\n</tool_call>') and not passes(named, '[]}\n</tool_call>')


def test_strict_functions_under_auto_hold_the_calls_and_leave_the_text_free():
    """"auto" with a strict function: a lazy grammar. Text is free but never spells the opening
    tag; each opening tag begins a call held to the tools' schemas. Both ways a tokenizer may
    have the tag: as text (the tiny one's) and as one added token (Qwen2.5's)."""
    import copy

    import llguidance.hf
    from llguidance import LLMatcher

    from specsplit.engine.grammar import to_grammar
    from tests.api_fleet import tiny_pair

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True,
                                               "parameters": {**WEATHER["function"]["parameters"],
                                                              "additionalProperties": False}}}
    time_fn = {"type": "function", "function": {"name": "get_time"}}
    text_tags = tiny_pair()[1].tok
    token_tags = copy.deepcopy(text_tags)
    token_tags.add_tokens([OPEN, CLOSE])
    one, two = call("get_weather", {"city": "Paris"}), "\n" + call("get_time", {})
    for hf in (text_tags, token_tags):
        special = frozenset(hf.get_added_vocab())
        lltok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
        for parallel in (True, False):
            plan = tools.plan(chat(tools=[strict, time_fn], parallel_tool_calls=parallel), special)
            assert plan.strict and plan.prefill == "" and (OPEN in special) == (f" {OPEN} " in plan.grammar.text)
            grammar = to_grammar(plan.grammar)

            def passes(text: str, hf=hf, lltok=lltok, grammar=grammar) -> bool:
                m = LLMatcher(lltok, grammar, log_level=0)
                ids = hf.encode(text, add_special_tokens=False)
                return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

            for text in ("Sunny, 18C.", "", "if a < b > c: <tool", one, "Let me check.\n" + one, one + "\nDone.",
                         '{"name": "get_weather", "arguments": {"town": 1}}'):  # a bare object is text here
                assert passes(text), (parallel, text)
            assert passes(one + two) == parallel and passes("x " + one + two) == parallel
            for text in (call("get_weather", {"town": "Paris"}), call("reverse", {}), f"I write {OPEN} as text",
                         one[:-1] + " " + CLOSE):
                assert not passes(text), text


def test_under_a_strict_function_a_bare_call_object_counts_only_when_it_fits():
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    plan = tools.plan(chat(tools=[strict]))
    for text, want in (('{"name": "get_weather", "arguments": {"city": "Paris"}}', [("get_weather", '{"city": "Paris"}')]),
                       ('```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```',
                        [("get_weather", '{"city": "Oslo"}')]),
                       ('{"name": "get_weather", "arguments": {"town": "Paris"}}', []),
                       ('{"name": "get_weather", "arguments": {"city": 7}}', []),
                       ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"} x"}', [])):
        p = plan.parser()
        content, calls = p.feed(text)
        rest, more = p.finish()
        assert [(c.name, c.arguments) for c in calls + more] == want, text
        assert (content + rest == "") == bool(want), text


def history(*extra: dict) -> list[dict]:
    args = json.dumps({"city": "Paris"})
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            *extra]


def test_a_tool_message_must_answer_a_call_before_it():
    ok = chat(tools=[WEATHER], messages=history({"role": "tool", "tool_call_id": "call_1", "content": "18C"}))
    assert tools.turns(ok)[-1] == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}
    assert "call_9" in refused("messages", messages=history({"role": "tool", "tool_call_id": "call_9", "content": "x"}))
    refused("messages", messages=history({"role": "user", "content": "and?"},
                                         {"role": "tool", "tool_call_id": "call_1", "content": "x"}))
    refused("messages", messages=[{"role": "tool", "tool_call_id": "call_1", "content": "x"}])
    refused("messages", messages=history({"role": "tool", "content": "no id"}))
    refused("messages", messages=[{"role": "user", "content": "x", "tool_call_id": "call_1"}])
    refused("messages", messages=[{"role": "user", "content": "x", "tool_calls": []}])
    bad = history()
    bad[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    assert "not JSON" in refused("messages", messages=bad)


def test_the_qwen_template_renders_tools_calls_and_results_as_the_model_was_trained(tmp_path):
    from specsplit.api.tokenizer import ServedTokenizer
    from tests.api_fleet import tiny_pair

    _, _, paths = tiny_pair()
    tok = ServedTokenizer(paths.target, TEMPLATE.read_text())
    assert tools.template_takes_tools(tok.chat_template)
    assert not tools.template_takes_tools(ServedTokenizer(paths.target).chat_template)
    req = chat(tools=[WEATHER], messages=history({"role": "tool", "tool_call_id": "call_1", "content": "18C"}))
    plan = tools.plan(req)
    ids = tok.encode_chat(tools.turns(req), tools=plan.tools)
    want = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
            "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
            "signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) +
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
            "<args-json-object>}}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
            '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")
    assert tok.tok.decode(ids) == want
    named = tools.plan(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    forced = tok.encode_chat(tools.turns(req), tools=named.tools, prefill=named.prefill)
    assert tok.tok.decode(forced) == want + named.prefill


def test_calls_reach_the_openai_client_in_its_shapes_whole_and_streamed():
    """The response and the event stream the API builds for a choice with calls, read by the
    ``openai`` package's own types and stream accumulator."""
    import asyncio

    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from schemas import SamplingSpec
    from specsplit.api.generation import Delta, Done, Generation, Job
    from specsplit.api.metrics import ApiMetrics
    from specsplit.api.server import Responder, stream_events

    calls = tuple(CallParser().feed(call("get_weather", {"city": "Paris"}) + call("get_time", {"city": "Oslo"}))[1])
    done = Done(0, "", "tool_calls", 0, 30, 24, {}, 0, calls[1:])
    responder = Responder(True, "m")
    whole = ChatCompletion.model_validate(responder.full({0: done}, {0: ""}, {0: list(calls)}))
    msg = whole.choices[0].message
    assert msg.content is None and whole.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls] == \
        [(c.id, c.name, c.arguments) for c in calls]

    gen = Generation(None, lambda ids: "", [Job(0, [1], 8, SamplingSpec())], [], ApiMetrics())
    gen.events.put_nowait(Delta(0, "", calls[:1]))
    gen.events.put_nowait(done)
    req = parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True})

    async def events() -> list[bytes]:
        return [e async for e in stream_events(gen, await gen.next(), responder, req, lambda: None)]

    state = ChatCompletionStreamState()
    for event in asyncio.run(events()):
        data = event.decode().removeprefix("data: ").strip()
        if data != "[DONE]":
            state.handle_chunk(ChatCompletionChunk.model_validate_json(data))
    snapshot = state.current_completion_snapshot.choices[0]
    assert snapshot.finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in snapshot.message.tool_calls] == \
        [(c.id, c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("single,ended_by,want", [(False, "stop", "tool_calls"), (False, "length", "length"),
                                                  (True, None, "tool_calls")])
def test_a_choice_with_calls_finishes_as_openai_says(single, ended_by, want):
    """Tokens in, as the fleet streams them: the calls come out as they close; an answer that made
    calls and ended by itself has finish_reason "tool_calls" (one cut short keeps "length"); with
    ``parallel_tool_calls: false`` the first call ends the choice at once."""
    from schemas import SamplingSpec
    from specsplit.api.generation import Delta, Done, Generation, Job
    from specsplit.api.metrics import ApiMetrics
    from specsplit.api.tokenizer import ServedTokenizer
    from specsplit.client import GenerationResult
    from tests.api_fleet import tiny_pair

    tok = ServedTokenizer(tiny_pair()[2].target)
    plan = tools.plan(chat(tools=[WEATHER], parallel_tool_calls=not single))
    text = "Sure.\n" + call("get_weather", {"city": "Paris"}) + "\n" + call("get_weather", {"city": "Oslo"})
    ids = tok.encode(text)
    gen = Generation(None, tok.decode, [Job(0, [1], 64, SamplingSpec(), tools=plan)], [], ApiMetrics())
    (c,) = gen.choices
    for i in range(0, len(ids), 3):
        gen._on_tokens(c, ids[i:i + 3])
        if c.stopped:
            break
    res = GenerationResult("s", [1], list(c.streamed), ended_by) if ended_by else None
    gen._finish(c, res)
    events = []
    while not gen.events.empty():
        events.append(gen.events.get_nowait())
    assert isinstance(events[-1], Done) and all(isinstance(e, Delta) for e in events[:-1])
    assert "".join(e.text for e in events) == "Sure."
    made = [json.loads(k.arguments)["city"] for e in events for k in e.calls]
    assert made == (["Paris"] if single else ["Paris", "Oslo"])
    assert events[-1].finish_reason == want
    assert (len(c.streamed) < len(ids)) == single  # the first call ended it: the rest was never asked for


def test_chat_template_kwargs_reach_the_template():
    """A request's ``chat_template_kwargs`` are the template's variables (vLLM's and SGLang's
    parameter); the names the server sets itself are a 400."""
    from specsplit.api.tokenizer import ServedTokenizer
    from tests.api_fleet import tiny_pair

    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    tok = ServedTokenizer(tiny_pair()[2].target, template)
    turns = [{"role": "user", "content": "hi"}]
    assert tok.tok.decode(tok.encode_chat(turns, variables={"enable_thinking": True})).endswith("<think>")
    assert not tok.tok.decode(tok.encode_chat(turns, variables={"enable_thinking": False})).endswith("<think>")
    req = chat(chat_template_kwargs={"enable_thinking": True})
    assert req.chat_template_kwargs == {"enable_thinking": True}
    for name in ("tools", "add_generation_prompt", "messages", "tokenize", "chat_template"):
        with pytest.raises(ApiError) as err:
            chat(chat_template_kwargs={name: 1})
        assert err.value.param == "chat_template_kwargs"
