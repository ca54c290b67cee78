"""OpenAI's Responses API as people use it: ``honcho start`` of the repository's Procfile and .env
(tiny fp32 pair, free ports; the API serving the Qwen2.5 chat template, which takes tools), the
official ``openai`` client's ``client.responses`` (whole, streamed, retrieve, delete), curl for
a stream's raw events, raw HTTP for the refusals.

Oracles: a response's text is the target's greedy decoding of its conversation (the chat
template's prompt; ``instructions`` a system turn, not carried over by ``previous_response_id``);
with tools, a response's calls and text are the chat endpoint's for the same conversation (which
tests/test_api_structured.py checks against greedy decoding masked to the tools' grammar).
"""

from __future__ import annotations

import json
import subprocess

import httpx
import openai
import pytest

from tests.api_fleet import api_error, api_fleet, expected, openai_client, post_json, tiny_pair
from tests.conftest import wait_until
from tests.test_api_tools import TEMPLATE

pytestmark = [pytest.mark.system, pytest.mark.slow]

SYSTEM, ASK, MORE = "You are terse.", "Count: one two", "And then?"
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city.", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                       "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny):  # tiny first: it provisions the pair the fleet loads
    yield from api_fleet(tmp_path_factory, SPECSPLIT_API_CHAT_TEMPLATE=str(TEMPLATE))


@pytest.fixture(scope="module")
def served(tiny):
    from specsplit.api.tokenizer import ServedTokenizer

    return ServedTokenizer(tiny[2].target, TEMPLATE.read_text())


def greedy_text(tiny, served, messages: list[dict], n: int) -> tuple[str, list[int]]:
    ids = expected(tiny[0], served, served.encode_chat(messages), n)
    return served.decode(ids), ids


def test_text_whole_and_streamed_is_the_targets_greedy_answer(fleet, tiny, served):
    client = openai_client(fleet)
    want, ids = greedy_text(tiny, served, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}], 24)
    ended = ids[-1] in served.stop_token_ids
    kw = {"model": "tiny-v1", "instructions": SYSTEM, "input": ASK, "max_output_tokens": 24, "temperature": 0}
    whole = client.responses.create(**kw)
    assert whole.output_text == want and whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == ("completed" if ended else "incomplete")
    assert (whole.incomplete_details is None) == ended
    assert [i.type for i in whole.output] == ["message"] and whole.output[0].role == "assistant"
    chat = client.chat.completions.create(model="tiny-v1", messages=[{"role": "system", "content": SYSTEM},
                                                                     {"role": "user", "content": ASK}],
                                          max_completion_tokens=24, temperature=0)
    assert chat.choices[0].message.content == want
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                     chat.usage.completion_tokens)
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens

    events = list(client.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-4].text == want and events[-1].response.output_text == want
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens

    # the SDK's stream helper (its own accumulator of the events; a final response only from
    # response.completed, as with OpenAI's own incomplete streams)
    with client.responses.stream(**kw) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == want
        if ended:
            assert stream.get_final_response().output_text == want
    # a stop string (vLLM's extension) ends it: completed, whatever the budget left
    stop = want[len(want) // 2:len(want) // 2 + 3]
    with client.responses.stream(**kw, extra_body={"stop": [stop]}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == want[:want.index(stop)]


def test_previous_response_id_retrieve_and_delete(fleet, tiny, served):
    client = openai_client(fleet)
    first = client.responses.create(model="tiny-v1", instructions=SYSTEM, input=ASK, max_output_tokens=12,
                                    temperature=0)
    second = client.responses.create(model="tiny-v1", previous_response_id=first.id, input=MORE,
                                     max_output_tokens=12, temperature=0)
    # the instructions are not carried over; the first answer is an assistant turn
    turns = [{"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": MORE}]
    assert second.output_text == greedy_text(tiny, served, turns, 12)[0]
    assert second.previous_response_id == first.id
    # the same conversation sent whole, as stateless clients send it, answers the same
    again = client.responses.create(model="tiny-v1", input=turns, max_output_tokens=12, temperature=0)
    assert again.output_text == second.output_text

    # its input items, newest first by default, a page at a time
    listed = client.responses.input_items.list(again.id)
    assert [(i.role, i.content[0].text) for i in listed.data] == [(t["role"], t["content"]) for t in turns[::-1]]
    assert [i.content[0].type for i in listed.data] == ["input_text", "output_text", "input_text"]
    page = client.responses.input_items.list(again.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == [ASK, first.output_text] and page.has_more
    rest = client.responses.input_items.list(again.id, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == [MORE] and not rest.has_more
    assert [i.content[0].text for i in client.responses.input_items.list(first.id).data] == [ASK]

    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    api_error(post_json(fleet, "/v1/responses", {"model": "tiny-v1", "previous_response_id": first.id,
                                                 "input": MORE}), 400, param="previous_response_id")
    unstored = client.responses.create(model="tiny-v1", input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


SPACE = {"type": "namespace", "name": "weather_v1", "description": "Weather tools.",
         "tools": [TOOL]}
SPACE_CHAT_TOOL = {"type": "function", "function": {**CHAT_TOOL["function"], "name": "weather_v1__get_weather",
                                                    "description": "Weather tools.\n\nWeather in a city."}}


@pytest.mark.parametrize("space", [None, "weather_v1"])
def test_function_calls_and_their_outputs_are_the_chat_endpoints(fleet, space):
    """A function tool, or the same function in a ``namespace`` tool (as Codex CLI sends its
    sub-agent tools; the model is shown ``weather_v1__get_weather``): the calls are the chat
    endpoint's, a namespace's each a ``function_call`` with its ``namespace`` and ``name``; sent
    back with its output (whole, or after the stored response), the answer is the chat
    endpoint's; streamed, the arguments' events say the same."""
    client = openai_client(fleet)
    tool, chat_tool = (SPACE, SPACE_CHAT_TOOL) if space else (TOOL, CHAT_TOOL)

    def named(call) -> str:  # a call's function as the chat endpoint names it
        return f"{call.namespace}__{call.name}" if call.namespace else call.name

    ask = {"role": "user", "content": "Weather in Paris?"}
    kw = {"model": "tiny-v1", "temperature": 0}
    called = client.responses.create(**kw, input=[ask], tools=[tool], tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=64)
    chat = client.chat.completions.create(**kw, messages=[ask], tools=[chat_tool], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=64)
    calls = [i for i in called.output if i.type == "function_call"]
    made = chat.choices[0].message.tool_calls or []
    assert calls and [(c.namespace, named(c), json.loads(c.arguments)) for c in calls] == \
        [(space, t.function.name, json.loads(t.function.arguments)) for t in made]
    assert called.output_text == (chat.choices[0].message.content or "") and called.tools[0].type == tool["type"]

    # the call's output, after the stored response and sent whole: both answer as the chat endpoint
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C"}
    after = client.responses.create(**kw, previous_response_id=called.id, input=[result], tools=[tool],
                                    max_output_tokens=16)
    whole = client.responses.create(**kw, input=[ask, *[c.model_dump(exclude_none=True) for c in calls], result],
                                    tools=[tool], max_output_tokens=16)
    history = [ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.call_id, "type": "function", "function": {"name": named(c), "arguments": c.arguments}}
        for c in calls]}, {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18C"}]
    reply = client.chat.completions.create(**kw, messages=history, tools=[chat_tool], max_tokens=16).choices[0]
    for r in (after, whole):
        assert r.output_text == (reply.message.content or "")
        assert [(named(i), i.arguments) for i in r.output if i.type == "function_call"] == \
            [(t.function.name, t.function.arguments) for t in reply.message.tool_calls or ()]

    events = list(client.responses.create(**kw, input=[ask], tools=[tool], tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=64, stream=True))
    done = [(e.name, e.arguments) for e in events if e.type == "response.function_call_arguments.done"]
    assert done == [(c.name, c.arguments) for c in calls]


def test_logprobs_through_include_are_the_chat_endpoints(fleet):
    client = openai_client(fleet)
    messages = [{"role": "user", "content": ASK}]
    res = client.responses.create(model="tiny-v1", input=ASK, max_output_tokens=6, temperature=0, top_logprobs=2,
                                  include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model="tiny-v1", messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    got = [(e.token, round(e.logprob, 5), [(t.token, round(t.logprob, 5)) for t in e.top_logprobs])
           for e in res.output[0].content[0].logprobs]
    want = [(e.token, round(e.logprob, 5), [(t.token, round(t.logprob, 5)) for t in e.top_logprobs])
            for e in chat.choices[0].logprobs.content]
    assert got == want and len(got) == res.usage.output_tokens - (res.status == "completed")
    events = list(client.responses.create(model="tiny-v1", input=ASK, max_output_tokens=6, temperature=0,
                                          top_logprobs=2, include=["message.output_text.logprobs"], stream=True))
    streamed = [(e.token, round(e.logprob, 5)) for ev in events if ev.type == "response.output_text.delta"
                for e in ev.logprobs]
    assert streamed == [(t, lp) for t, lp, _ in want]
    plain = client.responses.create(model="tiny-v1", input=ASK, max_output_tokens=6, temperature=0, top_logprobs=2)
    assert plain.output[0].content[0].logprobs == []  # only with include


def test_curl_streams_the_typed_events(fleet):
    body = {"model": "tiny-v1", "input": ASK, "max_output_tokens": 8, "stream": True}
    out = subprocess.run(["curl", "-sSN", "--max-time", "120", f"{fleet['url']}/v1/responses", "-H",
                          "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=180, check=True).stdout
    blocks = [b.splitlines() for b in out.strip().split("\n\n")]
    assert all(len(b) == 2 and b[0].startswith("event: ") and b[1].startswith("data: ") for b in blocks), out[:500]
    data = [json.loads(b[1][6:]) for b in blocks]
    assert [b[0][7:] for b in blocks] == [d["type"] for d in data]
    assert data[0]["type"] == "response.created" and data[-1]["type"] in ("response.completed", "response.incomplete")
    assert "[DONE]" not in out


def test_what_cannot_be_honoured_is_a_400_naming_it(fleet):
    def refused(body: dict, param: str, code: str | None = None, status: int = 400) -> None:
        api_error(post_json(fleet, "/v1/responses", {"model": "tiny-v1", "input": ASK, **body}), status, param, code)

    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]
    refused({"input": image}, "input", "unsupported_parameter")
    refused({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "unsupported_parameter")
    refused({"tools": [{"type": "web_search"}]}, "tools", "unsupported_parameter")
    refused({"background": True, "store": False}, "background")
    refused({"truncation": "auto"}, "truncation", "unsupported_parameter")
    refused({"reasoning": {"effort": "high"}}, "reasoning.effort", "unsupported_parameter")
    refused({"n": 2}, "n", "unsupported_parameter")
    refused({"max_output_tokens": 0}, "max_output_tokens")
    refused({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text")
    refused({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input")
    refused({"previous_response_id": "resp_nope"}, "previous_response_id", "previous_response_not_found")
    api_error(post_json(fleet, "/v1/responses", {"model": "tiny-v1"}), 400, "input")
    api_error(post_json(fleet, "/v1/responses", [1, 2]), 400)
    for path in ("resp_nope", "resp_nope/input_items", "resp_nope?stream=true"):
        api_error(httpx.get(f"{fleet['url']}/v1/responses/{path}", timeout=30), 404, code="not_found")
    api_error(post_json(fleet, "/v1/responses/resp_nope/cancel", {}), 404, code="not_found")
    kept = openai_client(fleet).responses.create(model="tiny-v1", input=ASK, max_output_tokens=1).id
    api_error(post_json(fleet, f"/v1/responses/{kept}/cancel", {}), 400)  # not a background response
    api_error(httpx.get(f"{fleet['url']}/v1/responses/{kept}?stream=true", timeout=30), 400, "stream")
    for query, param in (("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"), ("after=msg_no", "after")):
        api_error(httpx.get(f"{fleet['url']}/v1/responses/{kept}/input_items?{query}", timeout=30), 400, param)


LONG = "Tell me a long story."  # the tiny target's greedy answer runs past 512 tokens


def test_background_responses_poll_stream_again_and_cancel(fleet, tiny, served):
    """``background: true``: the response is answered queued and goes on in the API; polled, it
    ends as the target's greedy answer; its events stream again from the start or after any
    sequence number; streamed at creation it is the same; cancelled mid-way it keeps a prefix of
    the greedy answer, ``cancelled``."""
    client = openai_client(fleet)
    want, _ = greedy_text(tiny, served, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}], 24)
    kw = {"model": "tiny-v1", "instructions": SYSTEM, "input": ASK, "max_output_tokens": 24, "temperature": 0}
    bg = client.responses.create(**kw, background=True)
    assert bg.background and bg.status in ("queued", "in_progress")
    ends = ("completed", "incomplete")
    wait_until(lambda: client.responses.retrieve(bg.id).status in ends, 120, "the background response ends")
    final = client.responses.retrieve(bg.id)
    assert final.output_text == want and final.usage.output_tokens >= 1
    assert [i.content[0].text for i in client.responses.input_items.list(bg.id).data] == [ASK]

    events = list(client.responses.retrieve(bg.id, stream=True))
    assert [e.type for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert events[-1].type == f"response.{final.status}" and events[-1].response.output_text == want
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    later = list(client.responses.retrieve(bg.id, stream=True, starting_after=4))
    assert [e.sequence_number for e in later] == list(range(5, len(events)))
    streamed = list(client.responses.create(**kw, background=True, stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == want

    # cancelled mid-way: what it wrote is a prefix of the greedy answer
    long_want, ids = greedy_text(tiny, served, [{"role": "user", "content": LONG}], 512)
    assert len(ids) == 512 and ids[-1] not in served.stop_token_ids
    running = client.responses.create(model="tiny-v1", input=LONG, max_output_tokens=512, temperature=0,
                                      background=True)
    api_error(post_json(fleet, "/v1/responses", {"model": "tiny-v1", "input": "more", "previous_response_id":
                                                 running.id}), 400, "previous_response_id")  # still running
    stopped = client.responses.cancel(running.id)
    assert stopped.status == "cancelled", stopped.status
    got = client.responses.retrieve(running.id)
    assert got.status == "cancelled" and long_want.startswith(got.output_text) and len(got.output_text) < len(long_want)
    assert client.responses.cancel(running.id).status == "cancelled"  # again: the same
    client.responses.delete(running.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)
