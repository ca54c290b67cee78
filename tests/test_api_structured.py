"""Tool calls and JSON output as people use them: ``honcho start`` of the repository's Procfile
and .env (the ``api`` line included; tiny fp32 pair, two targets, free ports), the API serving
the Qwen2.5 chat template (SPECSPLIT_API_CHAT_TEMPLATE: the tiny model's own takes no tools), the
draft masking its proposals to each grammar (SPECSPLIT_DRAFT_GRAMMAR), the official ``openai``
client.

- Tools: for each tool choice the prompt is the template's (a forced opening included) and the
  answer, whole and streamed (the client's own accumulator), is the API's parser over the
  target's greedy text.
- ``response_format``: the answer equals greedy decoding of the target masked to the schema
  (tests/test_grammar.py's oracle), whole and streamed, and stays so when the process of the
  target serving it is killed -9 mid-stream (the other target rebuilds the grammar's state from
  the resend). Schemas the grammar engine cannot take, and JSON output with tools, are a 400.
- vLLM's ``structured_outputs`` (and ``guided_*``): choices, a regex, a GBNF grammar and a JSON
  schema, each answer the target's greedy decoding masked to its grammar.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.api_fleet import api_error, api_fleet, expected, openai_client, post_json, stream_killing, tiny_pair
from tests.test_api_tools import TEMPLATE, WEATHER, history

pytestmark = [pytest.mark.system, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny):  # tiny first: it provisions the pair the fleet loads
    # the draft masks its proposals to the grammars too (off by default): every answer below, the
    # kills included, goes through its matchers
    yield from api_fleet(tmp_path_factory, SPECSPLIT_API_CHAT_TEMPLATE=str(TEMPLATE), SPECSPLIT_DRAFT_GRAMMAR="true")


@pytest.fixture(scope="module")
def served(tiny):
    from specsplit.api.tokenizer import ServedTokenizer

    return ServedTokenizer(tiny[2].target, TEMPLATE.read_text())


@pytest.fixture(scope="module")
def book(tiny):
    from specsplit.engine.grammar import GrammarBook

    model, tok, paths = tiny
    return GrammarBook.for_model(tok.tok, paths.target, model.config.vocab_size)


# a tool whose arguments the grammar leaves few choices (compact JSON, a city from a list): the
# tiny random model completes a call within a few tokens once "required" or a name forces one
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}


STRICT = {"type": "function", "function": {**WEATHER["function"], "strict": True}}


def test_tools_are_the_targets_greedy_answer_parsed(fleet, tiny, served, book):
    """"required", a named function and "auto" with a strict function hold the calls to the
    tools' schemas: their reference is greedy decoding masked to the plan's grammar ("required"
    and a name: their answers are calls)."""
    from specsplit.api import protocol, tools
    from tests.test_grammar import masked_greedy

    model, _, _ = tiny
    client = openai_client(fleet)
    named = {"type": "function", "function": {"name": "get_weather"}}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "18C"}
    for extra in ({}, {"tool_choice": "required"}, {"tool_choice": named}, {"tool_choice": "none"},
                  {"parallel_tool_calls": False, "messages": history(result)},
                  {"tool_choice": "required", "tools": [CITY], "max_tokens": 64, "parallel_tool_calls": False},
                  {"tool_choice": named, "tools": [CITY], "max_tokens": 64},
                  {"tools": [STRICT], "max_tokens": 40}):  # "auto", strict: free text, calls held
        body = {"model": "tiny-v1", "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": [WEATHER], "max_tokens": 12, "temperature": 0, **extra}
        req = protocol.parse(protocol.ChatCompletionRequest, body)
        plan = tools.plan(req, served.added_tokens)
        ids = served.encode_chat(tools.turns(req), tools=plan and plan.tools, prefill=plan.prefill if plan else "")
        held = extra.get("tool_choice") in ("required", named) or extra.get("tools") == [STRICT]
        assert (plan is not None and plan.grammar is not None) == held
        n = body["max_tokens"]
        generated = masked_greedy(model, book, ids, n, served.stop_token_ids, plan.grammar) \
            if plan and plan.grammar else expected(model, served, ids, n)
        parser = plan.parser() if plan else tools.CallParser()
        content, calls = parser.feed(served.decode(generated))
        rest, more = parser.finish()
        want = (content + rest, [(c.name, c.arguments) for c in calls + more])
        if body["tools"] == [CITY]:
            assert [name for name, _ in want[1]] == ["get_weather"] and not want[0], want
            assert json.loads(want[1][0][1])["city"] in ("Paris", "Oslo")
        ended = generated[-1] in served.stop_token_ids or parser.single and want[1]
        finish = ("tool_calls" if want[1] else "stop") if ended else "length"
        whole = client.chat.completions.create(**body)
        assert whole.usage.prompt_tokens == len(ids), extra
        try:
            with client.chat.completions.stream(**body) as stream:  # the client's own accumulator
                for _ in stream:
                    pass
                streamed = stream.current_completion_snapshot  # (its final one refuses "length")
        except openai.LengthFinishReasonError as e:  # so does its stream, with strict tools
            streamed = e.completion
        for res in (whole, streamed):
            msg = res.choices[0].message
            got = (msg.content or "", [(c.function.name, c.function.arguments) for c in msg.tool_calls or []])
            assert got == want, extra
            assert res.choices[0].finish_reason == finish, extra


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "tags": {
    "type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["n", "tags"], "additionalProperties": False}


def test_json_output_is_the_targets_greedy_answer_masked_to_the_schema(fleet, tiny, served, book):
    from tests.test_grammar import masked_greedy

    model, _, _ = tiny
    client = openai_client(fleet)
    messages = [{"role": "user", "content": "Describe it as JSON."}]
    ids = served.encode_chat(messages)
    for fmt, schema in (({"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}},
                         SCHEMA), ({"type": "json_object"}, {"type": "object"})):
        want = masked_greedy(model, book, ids, 64, served.stop_token_ids, schema)
        text = served.decode(want)
        res = client.chat.completions.create(model="tiny-v1", messages=messages, max_tokens=64, temperature=0,
                                             response_format=fmt)
        assert res.choices[0].message.content == text and res.usage.completion_tokens == len(want)
        stream = client.chat.completions.create(model="tiny-v1", messages=messages, max_tokens=64, temperature=0,
                                                response_format=fmt, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
        if want[-1] in served.stop_token_ids:
            value = json.loads(text)
            assert isinstance(value, dict) and (schema is not SCHEMA or set(value) == {"n", "tags"})
    bad = {"model": "tiny-v1", "messages": messages}
    api_error(post_json(fleet, "/v1/chat/completions", {**bad, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}), 400, param="response_format")
    api_error(post_json(fleet, "/v1/chat/completions", {**bad, "response_format": {"type": "json_schema"}}), 400,
              param="response_format")
    api_error(post_json(fleet, "/v1/chat/completions", {**bad, "tools": [WEATHER],
                                                        "response_format": {"type": "json_object"}}), 400,
              param="response_format")


def test_vllm_structured_outputs_are_the_targets_greedy_answer_masked(fleet, tiny, served, book):
    """vLLM's ``structured_outputs`` and its older ``guided_*`` fields, sent as code written for
    vLLM sends them (the ``openai`` client's extra_body), on both endpoints: each answer, whole
    and streamed, is greedy decoding of the target masked to the constraint's grammar; two
    constraints at once, or one with tools, are a 400 naming the parameter."""
    import re

    from llguidance.gbnf_to_lark import any_to_lark

    from schemas import GrammarSpec
    from tests.test_grammar import masked_greedy

    model, _, _ = tiny
    client = openai_client(fleet)
    messages = [{"role": "user", "content": "Pick one."}]
    regex, gbnf = r"[0-9]{3}-[a-z]{2,5}", 'root ::= "yes" | "no" | "maybe" " not"?'
    cases = [
        ("chat", {"structured_outputs": {"choice": ["red", "green", "blue"]}},
         GrammarSpec(kind="lark", text='start: "red" | "green" | "blue"')),
        ("completions", {"structured_outputs": {"regex": regex}}, GrammarSpec(kind="regex", text=regex)),
        ("chat", {"guided_grammar": gbnf}, GrammarSpec(kind="lark", text=any_to_lark(gbnf))),
        ("completions", {"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
         GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))),
    ]
    for endpoint, extra, grammar in cases:
        ids = served.encode_chat(messages) if endpoint == "chat" else served.encode("Code:")
        want = masked_greedy(model, book, ids, 48, served.stop_token_ids, grammar)
        text = served.decode(want)
        for stream in (False, True):
            if endpoint == "chat":
                res = client.chat.completions.create(model="tiny-v1", messages=messages, max_tokens=48, temperature=0,
                                                     extra_body=extra, stream=stream)
                got = "".join(c.choices[0].delta.content or "" for c in res if c.choices) if stream else \
                    res.choices[0].message.content
            else:
                res = client.completions.create(model="tiny-v1", prompt="Code:", max_tokens=48, temperature=0,
                                                extra_body=extra, stream=stream)
                got = "".join(c.choices[0].text for c in res if c.choices) if stream else res.choices[0].text
            assert got == text, (extra, stream)
        ended = want[-1] in served.stop_token_ids
        if ended and grammar.kind == "regex":
            assert re.fullmatch(regex, text)
        elif ended and grammar.kind == "json_schema":
            assert set(json.loads(text)) == {"n", "tags"}
        elif "choice" in json.dumps(extra):
            assert ended and text in ("red", "green", "blue")
    bad = {"model": "tiny-v1", "messages": messages}
    api_error(post_json(fleet, "/v1/chat/completions", {**bad, "guided_regex": "a+",
                                                        "response_format": {"type": "json_object"}}), 400,
              param="response_format")
    api_error(post_json(fleet, "/v1/chat/completions", {**bad, "tools": [WEATHER],
                                                        "structured_outputs": {"choice": ["a"]}}), 400,
              param="structured_outputs")
    api_error(post_json(fleet, "/v1/completions", {"model": "tiny-v1", "prompt": "x",
                                                   "structured_outputs": {"regex": "("}}), 400,
              param="structured_outputs")


COLOURS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 120, "maxItems": 120,
           "x-guidance": {"whitespace_flexible": False}}


@pytest.mark.parametrize("role", ["target", "draft", "orchestrator"])
def test_json_output_survives_a_kill(fleet, tiny, served, book, role):
    """A long constrained answer (120 items, compact JSON) streams while a process serving it is
    killed -9. The target's: the other target takes the session (a resend from an empty cache,
    the grammar's state rebuilt from it). The orchestrator's: the API resumes the generation on
    its successor, the output so far sent as prompt with ``output_from`` where the output began,
    so the grammar holds from there. The draft's (the fleet's only one, masking its proposals to the
    grammar): its successor rebuilds its matcher from the resend. Each way the answer is the
    oracle's."""
    from tests.test_grammar import masked_greedy

    model, _, _ = tiny
    prompt = served.encode("Colours:")
    want = masked_greedy(model, book, prompt, 900, served.stop_token_ids, COLOURS)
    assert want[-1] in served.stop_token_ids and len(want) > 200
    body = {"model": "tiny-v1", "prompt": prompt, "max_tokens": 900, "temperature": 0, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "colours", "schema": COLOURS}}}
    text = "".join(c["text"] for c in stream_killing(fleet, body, role))
    assert text == served.decode(want)
    assert len(json.loads(text)) == 120
