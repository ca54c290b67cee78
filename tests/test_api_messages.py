"""Anthropic's Messages API as people use it: ``honcho start`` of the repository's Procfile and
.env (tiny fp32 pair, free ports; the API serving the Qwen2.5 chat template, which takes tools),
the official ``anthropic`` client's ``client.messages`` (whole, streamed, the stream helper,
``count_tokens``), curl for a stream's raw events, raw HTTP for the refusals.

Oracles: a message's text is the target's greedy decoding of its conversation through the chat
template (``system`` a system turn; a final assistant message the beginning of the assistant's
turn, which the answer continues); with tools, its calls and text are the chat endpoint's for the
same conversation (which tests/test_api_structured.py checks against greedy decoding masked to
the tools' grammar); token counts are the chat endpoint's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.api_fleet import api_fleet, expected, openai_client, post_json, tiny_pair
from tests.test_api_tools import TEMPLATE

pytestmark = [pytest.mark.system, pytest.mark.slow]

SYSTEM, ASK = "You are terse.", "Count: one two"
GREEDY = {"temperature": 0}  # (the anthropic SDK's own arguments no longer include the sampling parameters)
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
          "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
TOOL = {"name": "get_weather", "description": "Weather in a city.", "input_schema": SCHEMA}
CHAT_TOOL = {"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                              "parameters": SCHEMA}}


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


def client_for(fleet) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fleet["url"], api_key="unused", max_retries=0, timeout=120)


def greedy(tiny, served, turns: list[dict], n: int, prefill: str = "") -> tuple[str, list[int]]:
    ids = expected(tiny[0], served, served.encode_chat(turns, prefill=prefill), n)
    return served.decode(ids), ids


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_text_whole_streamed_and_counted_is_the_targets_greedy_answer(fleet, tiny, served):
    client = client_for(fleet)
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    want, ids = greedy(tiny, served, turns, 24)
    ended = ids[-1] in served.stop_token_ids
    kw = {"model": "tiny-v1", "system": SYSTEM, "messages": [{"role": "user", "content": ASK}], "max_tokens": 24,
          "extra_body": GREEDY}
    whole = client.messages.create(**kw)
    assert text_of(whole) == want and whole.type == "message" and whole.role == "assistant"
    assert whole.id.startswith("msg_") and [b.type for b in whole.content] == ["text"]
    assert whole.stop_reason == ("end_turn" if ended else "max_tokens") and whole.stop_sequence is None
    chat = openai_client(fleet).chat.completions.create(model="tiny-v1", messages=turns, max_tokens=24,
                                                        temperature=0)
    assert chat.choices[0].message.content == want
    u = whole.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens and u.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(model="tiny-v1", system=SYSTEM, messages=kw["messages"])
    assert counted.input_tokens == chat.usage.prompt_tokens

    events = list(client.messages.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]  # (the SDK skips pings)
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == want
    assert events[-2].delta.stop_reason == whole.stop_reason and events[-2].usage.output_tokens == u.output_tokens

    # the SDK's stream helper (its own accumulator of the events)
    with client.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == want
        final = stream.get_final_message()
    assert text_of(final) == want and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == u.output_tokens

    # a stop sequence ends it, named
    stop = want[len(want) // 2:len(want) // 2 + 3]
    cut = client.messages.create(**kw, stop_sequences=[stop, "never-said"])
    assert (text_of(cut), cut.stop_reason, cut.stop_sequence) == (want[:want.index(stop)], "stop_sequence", stop)


def test_a_final_assistant_message_is_continued(fleet, tiny, served):
    client = client_for(fleet)
    turns = [{"role": "user", "content": ASK}]
    plain, _ = greedy(tiny, served, turns, 12)
    prefill = "Sure, " if not plain.startswith("Sure, ") else "Well, "
    want, _ = greedy(tiny, served, turns, 12, prefill)
    messages = [*turns, {"role": "assistant", "content": prefill}]
    got = client.messages.create(model="tiny-v1", messages=messages, max_tokens=12, extra_body=GREEDY)
    assert text_of(got) == want
    with client.messages.stream(model="tiny-v1", messages=messages, max_tokens=12, extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == want
    counted = client.messages.count_tokens(model="tiny-v1", messages=messages).input_tokens
    assert counted == len(served.encode_chat(turns, prefill=prefill))
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == counted


def test_tool_use_and_its_result_are_the_chat_endpoints(fleet):
    client, chat_client = client_for(fleet), openai_client(fleet)
    ask = {"role": "user", "content": "Weather in Paris?"}
    kw = {"model": "tiny-v1", "extra_body": GREEDY}
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    used = client.messages.create(**kw, messages=[ask], tools=[TOOL], tool_choice=choice, max_tokens=64)
    chat = chat_client.chat.completions.create(
        model="tiny-v1", temperature=0, messages=[ask], tools=[CHAT_TOOL], parallel_tool_calls=False, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    uses = [b for b in used.content if b.type == "tool_use"]
    made = chat.choices[0].message.tool_calls or []
    assert uses and [(b.name, b.input) for b in uses] == [(t.function.name, json.loads(t.function.arguments))
                                                          for t in made]
    assert used.stop_reason == "tool_use" and all(b.id.startswith("toolu_") for b in uses)
    assert text_of(used) == (chat.choices[0].message.content or "")

    # the tool's result: the answer is the chat endpoint's for the same conversation
    turn = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in used.content]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18C"}]}
    after = client.messages.create(**kw, messages=[ask, turn, result], tools=[TOOL], max_tokens=16)
    history = [ask, {"role": "assistant", "content": chat.choices[0].message.content, "tool_calls": [
        {"id": uses[0].id, "type": "function", "function": {"name": "get_weather",
                                                            "arguments": json.dumps(uses[0].input)}}]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "18C"}]
    reply = chat_client.chat.completions.create(model="tiny-v1", temperature=0, messages=history, tools=[CHAT_TOOL],
                                                max_tokens=16).choices[0]
    assert text_of(after) == (reply.message.content or "")
    assert [(b.name, b.input) for b in after.content if b.type == "tool_use"] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in reply.message.tool_calls or ()]

    # streamed: the call's input arrives as JSON deltas the SDK puts back together
    with client.messages.stream(**kw, messages=[ask], tools=[TOOL], tool_choice=choice, max_tokens=64) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(b.name, b.input) for b in uses]


def test_curl_streams_the_typed_events(fleet):
    body = {"model": "tiny-v1", "messages": [{"role": "user", "content": ASK}], "max_tokens": 8, "stream": True,
            "temperature": 0}  # (Anthropic's default is 1: a sampled answer may end sooner)
    out = subprocess.run(["curl", "-sSN", "--max-time", "120", f"{fleet['url']}/v1/messages", "-H",
                          "Content-Type: application/json", "-H", "anthropic-version: 2023-06-01",
                          "-d", json.dumps(body)], capture_output=True, text=True, timeout=180, check=True).stdout
    blocks = [b.splitlines() for b in out.strip().split("\n\n")]
    assert all(len(b) == 2 and b[0].startswith("event: ") and b[1].startswith("data: ") for b in blocks), out[:500]
    data = [json.loads(b[1][6:]) for b in blocks]
    assert [b[0][7:] for b in blocks] == [d["type"] for d in data]
    assert [d["type"] for d in data[:2]] == ["message_start", "ping"] and data[-1]["type"] == "message_stop"
    assert data[-2]["type"] == "message_delta" and data[-2]["usage"]["output_tokens"] == 8
    assert data[-2]["delta"]["stop_reason"] == "max_tokens"


def test_what_cannot_be_honoured_is_anthropics_400(fleet):
    client = client_for(fleet)
    ask = [{"role": "user", "content": ASK}]
    for kw, param in (({"extra_body": {"container": "c1"}}, "container"),
                      ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
                      ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
                          "type": "url", "url": "https://x/y.png"}}]}]}, "messages"),
                      ({"extra_body": {"top_k": -1}}, "top_k")):
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(**{"model": "tiny-v1", "messages": ask, "max_tokens": 4, **kw})
        assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
        assert err.value.body["error"]["message"].startswith(param), err.value.body
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-nope", messages=ask, max_tokens=4)
    assert err.value.body["error"]["type"] == "not_found_error"
    for body, status in (([1, 2], 400), ({"model": "tiny-v1", "messages": ask}, 400)):
        resp = post_json(fleet, "/v1/messages", body)
        assert resp.status_code == status and resp.json()["type"] == "error", resp.text


def test_a_budget_past_the_context_runs_to_the_context(fleet):
    """Agents send max_tokens of 32K and more: the answer is the chat endpoint's with the budget
    the context leaves, and a budget that runs out there ends with model_context_window_exceeded."""
    client = client_for(fleet)
    limit = httpx.get(f"{fleet['url']}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    ask = [{"role": "user", "content": ASK}]
    room = limit - client.messages.count_tokens(model="tiny-v1", messages=ask).input_tokens
    got = client.messages.create(model="tiny-v1", messages=ask, max_tokens=10**6, extra_body=GREEDY)
    chat = openai_client(fleet).chat.completions.create(model="tiny-v1", messages=ask, max_tokens=room,
                                                        temperature=0).choices[0]
    assert text_of(got) == chat.message.content and got.usage.output_tokens <= room
    assert got.stop_reason == ("model_context_window_exceeded" if chat.finish_reason == "length" else "end_turn")
    short = client.messages.create(model="tiny-v1", messages=ask, max_tokens=2, extra_body=GREEDY)
    assert short.stop_reason in ("max_tokens", "end_turn")


def _claude_code_request(prompt: str, **fields) -> tuple[str, dict, dict]:
    """tests/data/claude-code-request.json (the shape of Claude Code's first request) for the
    tiny fleet: (path, headers, body)."""
    doc = json.loads((Path(__file__).parent / "data" / "claude-code-request.json").read_text())
    body = {**doc["body"], "model": "tiny-v1", **fields}
    body["messages"] = json.loads(json.dumps(body["messages"]).replace('"PROMPT"', json.dumps(prompt)))
    return doc["path"], doc["headers"], body


def _sse(text: str) -> list[dict]:
    blocks = [b.splitlines() for b in text.strip().split("\n\n")]
    return [json.loads(b[1][6:]) for b in blocks if len(b) == 2 and b[1].startswith("data: ")]


def test_claude_codes_request_is_answered_as_its_conversation(fleet):
    """Claude Code's request as it sends it (streamed, to ``/v1/messages?beta=true``, with its
    beta headers, adaptive thinking, effort, context management, a system message after the
    user's, a JSON user id and 32,000 tokens asked): answered, and the answer is the chat
    endpoint's for the conversation alone (greedy; its tools and system turns shown alike)."""
    path, headers, body = _claude_code_request("Count: one two", temperature=0, max_tokens=24)
    resp = httpx.post(f"{fleet['url']}{path}", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    events = _sse(resp.text)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop", resp.text[:300]
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    system = "".join(b["text"] for b in body["system"])
    user = "".join(b["text"] for b in body["messages"][0]["content"])
    turns = [{"role": "system", "content": system}, {"role": "user", "content": user},
             {"role": "system", "content": body["messages"][1]["content"]}]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in body["tools"]]
    chat = openai_client(fleet).chat.completions.create(model="tiny-v1", messages=turns, tools=tools, max_tokens=24,
                                                        temperature=0)
    assert text == (chat.choices[0].message.content or "") and not chat.choices[0].message.tool_calls
    usage = events[-2]["usage"]
    assert usage["output_tokens"] == chat.usage.completion_tokens
    counted = client_for(fleet).messages.count_tokens(**{k: body[k] for k in ("model", "messages", "system", "tools")})
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_a_prompt_past_the_context_is_anthropics_prompt_is_too_long(fleet):
    """Agents compact their conversation on Anthropic's own words for it."""
    client = client_for(fleet)
    limit = httpx.get(f"{fleet['url']}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    long = [{"role": "user", "content": "one two " * limit}]
    n = client.messages.count_tokens(model="tiny-v1", messages=long).input_tokens
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="tiny-v1", messages=long, max_tokens=32000)
    said = f"prompt is too long: {n} tokens > {limit - 1} maximum"
    assert err.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": said}}


def test_anthropics_client_lists_the_served_model(fleet):
    client = client_for(fleet)
    listed = client.models.list()
    limit = httpx.get(f"{fleet['url']}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    assert [(m.id, m.type, m.max_input_tokens) for m in listed.data] == [("tiny-v1", "model", limit)]
    assert client.models.retrieve("tiny-v1").display_name == "tiny-v1"
    with pytest.raises(anthropic.NotFoundError) as err:
        client.models.retrieve("claude-nope")
    assert err.value.body["error"]["type"] == "not_found_error"
    # OpenAI's clients (no anthropic-version) still get OpenAI's shapes there
    assert openai_client(fleet).models.list().data[0].id == "tiny-v1"


@pytest.mark.parametrize("role", ["target", "orchestrator"])
def test_a_stream_survives_a_kill_of_its_target_worker_or_orchestrator(fleet, tiny, served, role):
    """kill -9 of the process serving a streamed message, mid-answer: the events go on, and the
    text is the target's greedy answer, none lost, none twice."""
    from tests.api_fleet import stream_killing

    turns = [{"role": "user", "content": "Tell me a long story."}]  # its greedy answer runs past 300 tokens
    want, ids = greedy(tiny, served, turns, 300)
    assert ids[-1] not in served.stop_token_ids
    body = {"model": "tiny-v1", "messages": turns, "max_tokens": 300, "temperature": 0, "stream": True}
    events = stream_killing(fleet, body, role, path="/v1/messages")
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == want
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-1]["type"] == "message_stop"
