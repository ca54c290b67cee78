"""Anthropic's Messages API's parts without a fleet: messages as chat turns (tool use, tool
results, the prefill), the refusals, the error body, and the events a generation's deltas make
(tests/test_api_messages.py runs them through a fleet with Anthropic's client)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specsplit.api.generation import Delta, Done
from specsplit.api.message_events import MessageBuilder
from specsplit.api.messages import api_error_body, chat_request, conversation, parse_request
from specsplit.api.protocol import ApiError
from specsplit.api.tools import ParsedCall

ASK = {"role": "user", "content": "hi"}


def _req(**kw):
    return parse_request({"model": "m", "max_tokens": 16, "messages": [ASK], **kw})


def test_messages_become_chat_turns_with_calls_results_and_a_prefill():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b",
                                                                        "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "c"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                                              {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                                         {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                          "content": [{"type": "text", "text": "two"}]},
                                         {"type": "text", "text": "go on"}]},
            {"role": "assistant", "content": "The answer is ("}]
    turns, prefill = conversation(_req(messages=msgs, system=[{"type": "text", "text": "sys"}]))
    calls = [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"id": "t2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    assert turns == [{"role": "system", "content": "sys"}, {"role": "user", "content": "ab"},
                     {"role": "assistant", "content": "c", "tool_calls": calls},
                     {"role": "tool", "tool_call_id": "t1", "content": "one"},
                     {"role": "tool", "tool_call_id": "t2", "content": "two"}, {"role": "user", "content": "go on"}]
    assert prefill == "The answer is ("
    assert conversation(_req())[1] == ""


def test_the_chat_request_carries_the_parameters():
    tool = {"name": "f", "description": "d", "input_schema": {"type": "object"}}
    chat, _ = chat_request(_req(tools=[tool, {**tool, "name": "g", "strict": True}], stop_sequences=["X"],
                                      tool_choice={"type": "any", "disable_parallel_tool_use": True}, temperature=0.5,
                                      top_k=5, metadata={"user_id": "u"}, system="s"))
    assert chat.budget == 16 and chat.stop == ["X"] and chat.temperature == 0.5 and chat.top_k == 5
    assert chat.user == "u" and chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert [t.function.strict for t in chat.tools] == [None, True] and chat.tools[0].function.description == "d"
    named, _ = chat_request(_req(tools=[tool], tool_choice={"type": "tool", "name": "f"}))
    assert named.tool_choice.function.name == "f" and named.parallel_tool_calls is None
    fmt, _ = chat_request(_req(output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}))
    assert fmt.response_format.json_schema.json_schema == {"type": "object"}
    assert chat_request(_req(thinking={"type": "disabled"}, service_tier="auto"))[0].budget == 16


# what Claude Code sends with every request besides the conversation (ops/data/claude-code-request.json)
AGENT_FIELDS = {"thinking": {"budget_tokens": 0, "type": "adaptive"}, "output_config": {"effort": "high"},
                "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                "diagnostics": {"request_id": "r1"}, "metadata": {"user_id": "user_" + "a" * 64 + "_session_1"},
                "cache_control": {"type": "ephemeral"}, "temperature": 1}
MCP_TOOL = "mcp__" + "a_long_server_name__" * 4 + "tool"  # 89 characters: past OpenAI's 64, within Anthropic's 128


def test_what_agents_send_besides_the_conversation_changes_nothing():
    """Claude Code's fields (adaptive thinking, effort, context management, diagnostics, cache
    scopes, eager streaming, deferred tools, tool references, long MCP names) are taken; the
    chat request is the conversation's alone."""
    tools = [{"name": MCP_TOOL, "description": "d", "input_schema": {"type": "object"}, "eager_input_streaming": True,
              "defer_loading": True, "input_examples": [{"x": 1}]},
             {"name": "Bash", "description": "b", "input_schema": {"type": "object"},
              "cache_control": {"type": "ephemeral", "scope": "global"}}]
    system = [{"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral", "scope": "global"}}]
    msgs = [{"role": "user", "content": "find the tool"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": "s"},
                                              {"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": [
                {"type": "tool_reference", "tool_name": MCP_TOOL}, {"type": "text", "text": "exit 1"}]}]},
            {"role": "system", "content": "a reminder"}]
    plain_tools = [{k: v for k, v in t.items() if k in ("name", "description", "input_schema")} for t in tools]
    plain_msgs = [*msgs[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                           "content": "exit 1"}]}, msgs[-1]]
    got, _ = chat_request(_req(messages=msgs, tools=tools, system=system, **AGENT_FIELDS))
    want, _ = chat_request(_req(messages=plain_msgs, tools=plain_tools, system="You are an agent.",
                                metadata=AGENT_FIELDS["metadata"], temperature=1))
    assert got == want and got.tools[0].function.name == MCP_TOOL
    for thinking in ({"type": "enabled", "budget_tokens": 2048}, {"budget_tokens": 8000}, {"type": "disabled"},
                     {"type": "adaptive", "display": "summarized"}):
        assert chat_request(_req(thinking=thinking))[0] == chat_request(_req())[0]


def test_claude_codes_request_is_its_conversation():
    doc = json.loads((Path(__file__).parent / "data" / "claude-code-request.json").read_text())
    chat, prefill = chat_request(parse_request(doc["body"]))
    assert [m.role for m in chat.messages] == ["system", "user", "system"] and prefill == ""
    assert chat.messages[0].content.startswith("x-anthropic-billing-header")
    assert [t.function.name for t in chat.tools] == ["Bash", "Read"] and chat.budget == 32000


@pytest.mark.parametrize(("body", "param"), [
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking"),
    ({"thinking": {"type": "enabled", "budget_tokens": True}}, "thinking"),
    ({"thinking": {"type": "adaptive", "depth": 3}}, "thinking"),
    ({"thinking": {}}, "thinking"),
    ({"output_config": {"effort": 5}}, "output_config.effort"),
    ({"context_management": {"edits": "all"}}, "context_management"),
    ({"context_management": "x"}, "context_management"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"tools": [{"name": "f"}]}, "tools"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "defer_loading": "yes"}]}, "tools"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "allowed_callers": ["code_execution"]}]}, "tools"),
    ({"tools": [{"name": "f" * 129, "input_schema": {"type": "object"}}]}, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"container": "c1"}, "container"),
    ({"speed": "fast"}, "speed"),
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"stop_sequences": "X"}, "stop_sequences"),
    ({"metadata": {"user_id": 5}}, "metadata"),
    ({"metadata": {"other": "x"}}, "metadata"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": "prefill only"}]}, "messages"),
    ({"messages": [ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                            "input": {}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, "messages"),
    ({"messages": [ASK, {"role": "assistant", "content": "{"}],
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "output_config.format"),
    ({"top_p": 0}, "top_p"),
    ({"unknown": 1}, "unknown"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(body, param):
    with pytest.raises(ApiError) as err:
        chat_request(_req(**body))
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_errors_are_anthropics_body():
    body = api_error_body(ApiError(400, "must be at least 1", param="max_tokens"))
    assert body == {"type": "error", "error": {"type": "invalid_request_error",
                                               "message": "max_tokens: must be at least 1"}}
    kinds = {s: api_error_body(ApiError(s, "x"))["error"]["type"] for s in (401, 404, 413, 429, 500, 503)}
    assert kinds == {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                     429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def _done(text="", reason="stop", calls=(), stop_word=None, cached=3):
    return Done(0, text, reason, 0, 10, 7, {}, cached_tokens=cached, calls=tuple(calls), stop_word=stop_word)


def test_the_builder_streams_text_and_tool_use_blocks_in_order():
    b = MessageBuilder("m", 10)
    events = b.start() + b.feed(Delta(0, "Let me ")) + b.feed(Delta(0, "look."))
    events += b.feed(_done(calls=[ParsedCall(0, "f", '{"city": "Oslo"}')], reason="tool_calls"))
    kinds = [e["type"] for e in events]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    msg = b.message()
    assert msg["content"][0] == {"type": "text", "text": "Let me look."}
    use = msg["content"][1]
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_") and use["input"] == {"city": "Oslo"}
    assert json.loads(events[7]["delta"]["partial_json"]) == use["input"] and events[6]["content_block"]["input"] == {}
    assert msg["stop_reason"] == "tool_use" and msg["stop_sequence"] is None
    assert msg["usage"]["input_tokens"] == 7 and msg["usage"]["cache_read_input_tokens"] == 3
    assert msg["usage"]["output_tokens"] == 7 and events[-2]["usage"]["output_tokens"] == 7
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None


@pytest.mark.parametrize(("done", "reason", "seq"), [
    (_done(reason="length"), "max_tokens", None), (_done(stop_word="\n\n"), "stop_sequence", "\n\n"),
    (_done(), "end_turn", None)])
def test_stop_reasons_and_an_empty_answer(done, reason, seq):
    b = MessageBuilder("m", 10)
    events = b.feed(done)
    assert b.message()["content"] == [{"type": "text", "text": ""}]
    assert [e["type"] for e in events] == ["content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert (b.stop_reason, b.stop_sequence) == (reason, seq) == (events[2]["delta"]["stop_reason"],
                                                                 events[2]["delta"]["stop_sequence"])
