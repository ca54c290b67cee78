"""The Responses API's parts without a fleet: the store's bounds, the input as chat turns, and
the events a generation's deltas make (tests/test_api_responses.py runs them through a fleet)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from specsplit.api.background import BackgroundRuns
from specsplit.api.generation import Delta, Done
from specsplit.api.protocol import ApiError
from specsplit.api.response_events import Builder
from specsplit.api.responses import chat_request, input_messages, listed_items, parse_request
from specsplit.api.stored import ResponseStore
from specsplit.api.tools import ParsedCall


def test_the_store_keeps_the_newest_within_its_count_and_bytes():
    store = ResponseStore(3, 10_000)
    for i in range(5):
        assert store.put(f"r{i}", {"n": i}, [{"role": "user", "content": "x"}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4").response == {"n": 4}
    store.get("r2")  # used: kept past a newer one
    store.put("r5", {"n": 5}, [])
    assert store.get("r2") is not None and store.get("r3") is None
    big = ResponseStore(100, 2_000)
    for i in range(10):
        big.put(f"b{i}", {"text": "y" * 500}, [])
    assert big.bytes <= 2_000 and len(big) == 3 and big.get("b9") is not None
    assert not big.put("huge", {"text": "z" * 5_000}, []) and big.get("huge") is None
    assert big.delete("b9") and not big.delete("b9") and big.get("b9") is None
    assert not ResponseStore(0, 1_000).put("r", {}, [])


def test_input_items_become_chat_turns():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "c", "annotations": []}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}]
    calls = [{"id": c, "type": "function", "function": {"name": n, "arguments": "{}"}} for c, n in (("c1", "f"),
                                                                                                    ("c2", "g"))]
    assert input_messages(items) == [{"role": "user", "content": "ab"},
                                     {"role": "assistant", "content": "c", "tool_calls": calls},
                                     {"role": "tool", "tool_call_id": "c1", "content": "one"},
                                     {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    req = parse_request({"model": "m", "input": "hi", "instructions": "sys", "max_output_tokens": 7,
                         "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                         "include": ["message.output_text.logprobs"], "top_logprobs": 3,
                         "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}})
    chat, turns = chat_request(req, [{"role": "user", "content": "before"}])
    assert [m.role for m in chat.messages] == ["system", "user", "user"] and turns[0]["content"] == "before"
    assert chat.budget == 7 and chat.logprobs_asked == 3 and chat.tools[0].function.strict is True
    assert chat.response_format.json_schema.json_schema == {"type": "object"}


def test_input_items_are_listed_with_ids_and_parts():
    listed = listed_items([{"role": "assistant", "content": "a"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                                   "arguments": "{}", "id": "fc_given"}])
    assert listed[0]["type"] == "message" and listed[0]["id"].startswith("msg_") and listed[0]["status"] == "completed"
    assert listed[0]["content"] == [{"type": "output_text", "text": "a"}] and listed[1]["id"] == "fc_given"
    assert listed_items("hi")[0]["content"] == [{"type": "input_text", "text": "hi"}] and listed_items(None) == []


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"tools": [{"type": "file_search"}]}, "tools"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["everything"]}, "include"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"max_output_tokens": 5, "temperature": 3}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "bad name"}}}, "text"),
    # texts a response would echo, or a tokenizer read, that are no Unicode (lone surrogates)
    ({"user": "\ud800"}, "user"), ({"metadata": {"k": "\udfff"}}, "metadata"), ({"instructions": "a\ud800"},
                                                                               "instructions"),
])
def test_what_cannot_be_honoured_is_refused_naming_it(body, param):
    with pytest.raises(ApiError) as err:
        chat_request(parse_request({"model": "m", "input": "hi", **body}), [])
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_events_are_numbered_and_the_response_holds_what_they_said():
    b = Builder(parse_request({"model": "m", "input": "x"}), "m", lambda t: ("t", b"t"))
    events = b.start() + b.feed(Delta(0, "Hel")) + b.feed(Delta(0, "lo", (ParsedCall(0, "f", '{"a": 1}', "call_1"),)))
    events += b.feed(Done(0, "!", "length", 0, 3, 4, {}, cached_tokens=2))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert kinds[-1] == "response.incomplete" and b.incomplete == {"reason": "max_output_tokens"}
    out = b.response()["output"]
    assert [i["type"] for i in out] == ["message", "function_call", "message"]
    assert [out[0]["content"][0]["text"], out[2]["content"][0]["text"]] == ["Hello", "!"]
    assert out[1]["call_id"] == "call_1" and out[2]["status"] == "incomplete"
    assert b.response()["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 2},
                                     "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0},
                                     "total_tokens": 7}
    assert b.assistant_turn() == {"role": "assistant", "content": "Hello!", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    empty = Builder(parse_request({"model": "m", "input": "x"}), "m", None)
    assert empty.feed(Done(0, "", "stop", 0, 3, 1, {}))[-1]["response"]["output"][0]["content"][0]["text"] == ""
    assert empty.status == "completed"


def _done(text: str) -> Done:
    return Done(0, text, "stop", 0, 3, 2, {})


class _Scripted:
    """A generation's event source for the background runs' bookkeeping alone (the fleet's own
    runs: tests/test_api_responses.py): its events, then a wait that only a cancel ends."""

    def __init__(self, events, hang: bool = False) -> None:
        self.events, self.hang = list(events), hang

    async def next(self):
        if self.events:
            return self.events.pop(0)
        if self.hang:
            await asyncio.sleep(3600)
        return None


def test_background_runs_stream_again_cancel_and_forget_the_oldest():
    async def main():
        runs, kept, freed = BackgroundRuns(kept=2), [], []
        req = parse_request({"model": "m", "input": "hi", "background": True})
        b = Builder(req, "m", lambda t: ("x", b"x"))
        assert b.status == "queued" and b.response()["background"] is True
        run = runs.start(b, _Scripted([Delta(0, "Hel"), Delta(0, "lo"), _done("!")]), lambda: freed.append(1),
                         lambda: kept.append(b.status))
        events = [e async for e in run.follow(-1)]
        kinds = [e["type"] for e in events]
        assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
        assert kinds[-1] == "response.completed" and [e["sequence_number"] for e in events] == list(range(len(events)))
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello!"
        assert [e["sequence_number"] async for e in run.follow(3)] == list(range(4, len(events)))
        assert run.done and kept == ["completed"] and freed == [1]

        slow = Builder(req, "m", None)
        hung = runs.start(slow, _Scripted([Delta(0, "partial")], hang=True), lambda: freed.append(2),
                          lambda: kept.append(slow.status))
        await asyncio.sleep(0.05)
        assert not hung.done and slow.status == "in_progress"
        assert await runs.cancel(slow.id) is hung and hung.done and slow.status == "cancelled"
        assert slow.response()["output"][0]["status"] == "incomplete" and kept[-1] == "cancelled"
        assert await runs.cancel("resp_none") is None
        third = Builder(req, "m", None)
        runs.start(third, _Scripted([_done("x")]), lambda: None, lambda: None)
        await asyncio.sleep(0.05)
        assert len(runs) == 2 and runs.get(b.id) is None  # the oldest finished forgotten
        await runs.forget(third.id)
        assert runs.get(third.id) is None and len(runs) == 1

    asyncio.run(main())


def test_codex_clis_request_is_its_conversation():
    """The shape of OpenAI's Codex CLI's request (0.171.0, ``web_search = "disabled"`` and
    ``features.multi_agent = false``: function tools only): its bookkeeping (``client_metadata``),
    ``reasoning.summary``, ``include`` of encrypted reasoning, ``store: false`` and
    ``prompt_cache_key`` are taken; the chat request is the conversation's alone."""
    tool = {"type": "function", "name": "exec_command", "description": "Runs a command.", "strict": False,
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                           "additionalProperties": False}}
    items = [{"type": "message", "id": "msg_1", "role": "developer",
              "content": [{"type": "input_text", "text": "You are a coding agent."}]},
             {"type": "message", "id": "msg_2", "role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}]
    body = {"model": "m", "stream": True, "input": items, "tools": [tool], "tool_choice": "auto",
            "parallel_tool_calls": True, "store": False, "prompt_cache_key": "k1"}
    codex = {**body, "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
             "client_metadata": {"x-codex-window-id": "w:0", "root_turn_id": "t1",
                                 "x-codex-turn-metadata": '{"turn_id": "t1", "sandbox": "seccomp"}'}}
    got, turns = chat_request(parse_request(codex), [])
    want, _ = chat_request(parse_request(body), [])
    assert got == want and [t["role"] for t in turns] == ["developer", "user"]
    assert got.tools[0].function.name == "exec_command" and got.prompt_cache_key == "k1"
    with pytest.raises(ApiError) as err:
        parse_request({**codex, "client_metadata": {str(i): "x" for i in range(65)}})
    assert err.value.param == "client_metadata"


CODEX = json.loads((Path(__file__).parent / "data" / "codex-request.json").read_text())["body"]


def test_codex_clis_default_request_shows_its_namespace_functions():
    """Codex CLI 0.171.0's request with its default features (``tests/data/codex-request.json``,
    texts shortened): its ``multi_agent_v1`` namespace's functions are shown to the model as
    ``multi_agent_v1__<name>``, the namespace's description before each function's own; its other
    function tools as they were; the conversation its four messages."""
    chat, turns = chat_request(parse_request(CODEX), [])
    names = [t.function.name for t in chat.tools]
    space = next(t for t in CODEX["tools"] if t["type"] == "namespace")
    inner = [f["name"] for f in space["tools"]]
    assert [n for n in names if "__" in n] == [f"multi_agent_v1__{n}" for n in inner] and len(inner) == 5
    flat = [t["name"] for t in CODEX["tools"] if t["type"] == "function"]
    assert [n for n in names if "__" not in n] == flat
    spawn = next(t.function for t in chat.tools if t.function.name == "multi_agent_v1__spawn_agent")
    want = next(f for f in space["tools"] if f["name"] == "spawn_agent")
    assert spawn.description == f"{space['description']}\n\n{want['description']}"
    assert spawn.parameters == want["parameters"] and spawn.strict is False
    assert [t["role"] for t in turns] == ["developer", "developer", "user", "user"]
    # the response echoes the request's tools: a namespace as it came (no strict of its own)
    echoed = Builder(parse_request(CODEX), "m", None).response()["tools"]
    assert next(t for t in echoed if t["type"] == "namespace") == space


def test_a_call_to_a_namespace_function_comes_back_with_its_namespace():
    """The model calls ``multi_agent_v1__spawn_agent``: the item is OpenAI's ``function_call``
    with ``name: spawn_agent`` and ``namespace: multi_agent_v1`` (whole and in the stream's
    events); sent back as input, or continued from the stored turn, it is the same chat call."""
    b = Builder(parse_request(CODEX), "m", None)
    calls = (ParsedCall(0, "multi_agent_v1__spawn_agent", '{"message": "hi"}', "call_1"),
             ParsedCall(1, "exec_command", '{"cmd": "ls"}', "call_2"))
    events = b.start() + b.feed(Done(0, "", "tool_calls", 0, 3, 4, {}, calls=calls))
    out = [i for i in b.response()["output"] if i["type"] == "function_call"]
    assert [(i["name"], i.get("namespace")) for i in out] == [("spawn_agent", "multi_agent_v1"), ("exec_command", None)]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added" and e["item"]["type"] != "message"]
    assert [(i["name"], i.get("namespace")) for i in added] == \
        [("spawn_agent", "multi_agent_v1"), ("exec_command", None)]
    done = [e["name"] for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done == ["spawn_agent", "exec_command"]
    want = [{"id": "call_1", "type": "function", "function": {"name": "multi_agent_v1__spawn_agent",
                                                              "arguments": '{"message": "hi"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'}}]
    assert b.assistant_turn()["tool_calls"] == want
    assert input_messages(out)[0]["tool_calls"] == want


@pytest.mark.parametrize("space", [
    {"type": "namespace", "name": "a.b", "description": "", "tools": [{"type": "function", "name": "f"}]},
    {"type": "namespace", "name": "ns", "description": "", "tools": []},
    {"type": "namespace", "name": "ns", "description": "", "tools": [{"type": "custom", "name": "f"}]},
    {"type": "namespace", "name": "ns", "description": "", "tools": [
        {"type": "namespace", "name": "in", "description": "", "tools": [{"type": "function", "name": "f"}]}]},
    {"type": "namespace", "name": "ns", "description": "", "tools": [{"type": "function"}]},
    {"type": "namespace", "name": "ns", "description": "", "tools": [{"type": "function", "name": "f"}], "x": 1},
    {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f" * 126}]},  # 130 characters
])
def test_a_namespace_it_cannot_show_is_a_400_naming_tools(space):
    with pytest.raises(ApiError) as err:
        chat_request(parse_request({"model": "m", "input": "hi", "tools": [space]}), [])
    assert err.value.status == 400 and err.value.param == "tools", err.value.message


def test_a_namespace_function_and_a_function_of_its_qualified_name_are_two_of_one_name():
    tools = [{"type": "namespace", "name": "ns", "description": "d", "tools": [{"type": "function", "name": "f"}]},
             {"type": "function", "name": "ns__f"}]
    with pytest.raises(ApiError) as err:
        chat_request(parse_request({"model": "m", "input": "hi", "tools": tools}), [])
    assert err.value.param == "tools" and "same name" in err.value.message
