"""The HTTP API as people use it: ``honcho start`` of the repository's Procfile and .env (the
``api`` line included; tiny fp32 pair, free ports), the official ``openai`` client (sync, async,
streaming) and raw HTTP for the error cases. Greedy answers are checked against plain greedy
decoding of the target; every error against OpenAI's status and body."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket

import httpx
import pytest

from specsplit.launch import scrape
from tests.api_fleet import (
    LONG,
    MAX_BODY,
    WORKER_METRICS,
    api_error,
    api_fleet,
    api_health,
    expected,
    moved_off_a_stalled_worker,
    openai_client,
    orchestrator_cancelled,
    post_json,
    rss_kb,
    scrape_api,
    target_sessions,
    tiny_pair,
    worker_sessions,
)
from tests.conftest import wait_until
from tests.honcho_fleet import honcho_log

pytestmark = [pytest.mark.system, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny):  # tiny first: it provisions the pair the fleet loads
    yield from api_fleet(tmp_path_factory)


# ---------------------------------------------------------------------------- answers
def test_models_and_health(fleet):
    assert api_health(fleet["url"]) == 200
    models = openai_client(fleet).models.list()
    assert [m.id for m in models.data] == ["tiny-v1"]
    assert openai_client(fleet).models.retrieve("tiny-v1").id == "tiny-v1"  # GET /v1/models/{model}
    for other in ("gpt-4", "org/tiny-v1", ""):
        api_error(httpx.get(f"{fleet['url']}/v1/models/{other}", timeout=10), 404, param="model")


def test_completion_greedy_equals_target_and_stream_equals_whole(fleet, tiny):
    model, tok, _ = tiny
    client = openai_client(fleet)
    for seed in range(3):
        rng = random.Random(seed)
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(3, 20))]
        want = expected(model, tok, prompt, 40)
        whole = client.completions.create(model="tiny-v1", prompt=prompt, max_tokens=40, temperature=0)
        choice = whole.choices[0]
        assert choice.text == tok.decode(want)
        assert whole.usage.completion_tokens == len(want) and whole.usage.prompt_tokens == len(prompt)
        assert choice.finish_reason == ("length" if len(want) == 40 else "stop")
        assert choice.model_extra["speculative"]["rounds"] >= 1
        chunks = list(client.completions.create(model="tiny-v1", prompt=prompt, max_tokens=40, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert chunks[-1].usage.completion_tokens == len(want)


def target_prefix_hits(fleet) -> float:
    """Tokens the fleet's two target workers copied from their prefix caches so far."""
    return sum(v for off in (400, 401) for k, v in scrape(f"http://127.0.0.1:{fleet['metrics'] + off}/metrics").items()
               if k.startswith("specsplit:worker_prefix_cache_hits"))


def test_a_repeated_context_is_answered_from_the_prefix_cache_and_the_same(fleet, tiny):
    """The same 150-token prompt three times in a row (a new session each, on either of the two
    targets): by the third a target holds it, so some answer reports 128 prompt tokens (two whole
    blocks of 64, the last prompt token is always forwarded) in usage.prompt_tokens_details,
    which the targets' metrics count too; every answer is the target's greedy decoding."""
    model, tok, _ = tiny
    client = openai_client(fleet)
    prompt = [random.Random(77).randrange(tok.vocab_size) for _ in range(150)]
    want = tok.decode(expected(model, tok, prompt, 16))
    before = target_prefix_hits(fleet)
    cached = []
    for i in range(3):
        if i == 2:  # streamed, with usage in its last chunk
            chunks = list(client.completions.create(model="tiny-v1", prompt=prompt, max_tokens=16, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
            text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
        else:
            res = client.completions.create(model="tiny-v1", prompt=prompt, max_tokens=16, temperature=0)
            text, usage = res.choices[0].text, res.usage
        assert text == want and usage.prompt_tokens == 150
        cached.append(usage.prompt_tokens_details.cached_tokens)
    assert set(cached) <= {0, 128} and 128 in cached, cached
    assert target_prefix_hits(fleet) - before == sum(cached)


def test_a_prompt_cache_key_keeps_a_conversation_on_the_worker_holding_it(fleet, tiny):
    """OpenAI's ``prompt_cache_key``: requests with the same key go to the same target, so after
    the first every one copies the context from its prefix cache (two targets: without the key,
    one time in two); the answers stay the target's greedy decoding."""
    model, tok, _ = tiny
    client = openai_client(fleet)
    rng = random.Random(12)
    words = ["def", "return", "value", "list", "for", "print", "while", "self"]
    messages = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(120))}]
    want = tok.decode(expected(model, tok, tok.encode_chat(messages), 8))
    cached = []
    for i in range(4):
        res = client.chat.completions.create(model="tiny-v1", messages=messages, max_tokens=8, temperature=0,
                                             prompt_cache_key="conversation-12")
        assert res.choices[0].message.content == want
        cached.append(res.usage.prompt_tokens_details.cached_tokens)
    held = (res.usage.prompt_tokens - 1) // 64 * 64
    assert held >= 128 and cached[1:] == [held] * 3, cached
    api_error(post_json(fleet, "/v1/chat/completions", {"model": "tiny-v1", "messages": messages,
                                                        "prompt_cache_key": ""}), 400, param="prompt_cache_key")


def test_a_conversations_turns_find_the_last_turns_worker_without_a_key(fleet, tiny):
    """No ``prompt_cache_key``: the API routes a prompt that begins with a whole earlier one
    (a conversation's next turn) as that one went (specsplit.api.routes), so each second turn
    copies the first turn's context from the target's prefix cache. Four conversations on two
    targets: without the affinity all four would hit one time in 16. Greedy answers unchanged."""
    model, tok, _ = tiny
    client = openai_client(fleet)
    rng = random.Random(31)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "theta", "kappa"]
    for c in range(4):
        messages = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(90))}]
        first = client.chat.completions.create(model="tiny-v1", messages=messages, max_tokens=8, temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": " ".join(rng.choice(words) for _ in range(20))}]
        second = client.chat.completions.create(model="tiny-v1", messages=messages, max_tokens=8, temperature=0)
        assert second.choices[0].message.content == tok.decode(expected(model, tok, tok.encode_chat(messages), 8))
        held = (first.usage.prompt_tokens - 1) // 64 * 64  # the first turn's whole blocks, at least
        assert held >= 64 and second.usage.prompt_tokens_details.cached_tokens >= held, (c, first.usage, second.usage)


def test_chat_greedy_sync_async_stream_all_equal_the_target(fleet, tiny):
    from openai import AsyncOpenAI

    model, tok, _ = tiny
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count: one two"}]
    want = tok.decode(expected(model, tok, tok.encode_chat(messages), 32))
    whole = openai_client(fleet).chat.completions.create(model="tiny-v1", messages=messages, max_tokens=32,
                                                   temperature=0)
    assert whole.choices[0].message.content == want and whole.choices[0].message.role == "assistant"

    async def run():
        client = AsyncOpenAI(base_url=f"{fleet['url']}/v1", api_key="unused", max_retries=0, timeout=120)
        res = await client.chat.completions.create(model="tiny-v1", messages=messages, max_completion_tokens=32,
                                                   temperature=0)
        stream = await client.chat.completions.create(model="tiny-v1", messages=messages, max_tokens=32,
                                                      temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        return res.choices[0].message.content, text

    a, b = asyncio.run(run())
    assert a == want and b == want
    # vLLM's and SGLang's template variables (Qwen3's enable_thinking): rendered with the messages
    kw = {"enable_thinking": False, "custom_note": "x"}
    res = openai_client(fleet).chat.completions.create(model="tiny-v1", messages=messages, max_tokens=32,
                                                        temperature=0, extra_body={"chat_template_kwargs": kw})
    assert res.choices[0].message.content == tok.decode(expected(model, tok, tok.encode_chat(messages, variables=kw),
                                                                 32))
    api_error(post_json(fleet, "/v1/chat/completions", {"model": "tiny-v1", "messages": messages,
                                                        "chat_template_kwargs": {"add_generation_prompt": False}}),
              400, param="chat_template_kwargs")


def test_chat_continues_a_final_assistant_message_as_vllm_does(fleet, tiny):
    """vLLM's ``continue_final_message`` (with ``add_generation_prompt: false``): the answer is
    the target's greedy continuation of the assistant's turn begun with that message's text; and
    ``add_generation_prompt: false`` alone leaves the assistant's opening out of the prompt."""
    model, tok, _ = tiny
    messages = [{"role": "user", "content": "Count: one two"}]
    client = openai_client(fleet)
    for begun in ("Sure, ", "three"):
        res = client.chat.completions.create(
            model="tiny-v1", messages=[*messages, {"role": "assistant", "content": begun}], max_tokens=12,
            temperature=0, extra_body={"continue_final_message": True, "add_generation_prompt": False})
        ids = tok.encode_chat(messages, prefill=begun)
        assert res.choices[0].message.content == tok.decode(expected(model, tok, ids, 12))
        assert res.usage.prompt_tokens == len(ids)
    bare = client.chat.completions.create(model="tiny-v1", messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"add_generation_prompt": False})
    ids = tok.encode_chat(messages, opened=False)
    assert ids != tok.encode_chat(messages) and bare.usage.prompt_tokens == len(ids)
    assert bare.choices[0].message.content == tok.decode(expected(model, tok, ids, 12))
    for body, param in (({"continue_final_message": True}, "add_generation_prompt"),
                        ({"continue_final_message": True, "add_generation_prompt": False}, "messages"),
                        ({"continue_final_message": "yes"}, "continue_final_message")):
        api_error(post_json(fleet, "/v1/chat/completions", {"model": "tiny-v1", "messages": messages, **body}),
                  400, param=param)


def test_tokenize_and_detokenize_in_vllm_and_llama_server_shapes(fleet, tiny):
    """``POST /tokenize`` and ``/detokenize`` (curl's way: plain JSON bodies): the served
    tokenizer's ids for a text (vLLM's ``prompt``, llama-server's ``content``) or a conversation
    (the chat template's, as the chat endpoint encodes it), and back; bad bodies are 400s."""
    _, tok, _ = tiny
    text = "Count: one two <|im_end|>"

    def post(path, body, status=200):
        res = post_json(fleet, path, body)
        assert res.status_code == status, res.text
        return res.json()

    vllm = post("/tokenize", {"model": "tiny-v1", "prompt": text})
    assert vllm["tokens"] == tok.encode(text) and vllm["count"] == len(vllm["tokens"]) and vllm["max_model_len"] > 0
    assert post("/tokenize", {"content": text})["tokens"] == tok.encode_text(text)
    pieces = post("/tokenize", {"content": "one two", "with_pieces": True})["tokens"]
    assert "".join(p["piece"] for p in pieces) == "one two" and [p["id"] for p in pieces] == tok.encode_text("one two")
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
    assert post("/tokenize", {"messages": messages})["tokens"] == tok.encode_chat(messages)
    begun = [*messages, {"role": "assistant", "content": "Sure"}]
    assert post("/tokenize", {"messages": begun, "continue_final_message": True, "add_generation_prompt": False})[
        "tokens"] == tok.encode_chat(messages, prefill="Sure")  # as the chat endpoint prompts it
    back = post("/detokenize", {"model": "tiny-v1", "tokens": vllm["tokens"]})
    assert back["prompt"] == back["content"] == tok.tok.decode(vllm["tokens"])
    api_error(post_json(fleet, "/tokenize", {"prompt": "a", "content": "b"}), 400)
    api_error(post_json(fleet, "/tokenize", {"model": "gpt-4", "prompt": "a"}), 404, param="model")
    api_error(post_json(fleet, "/tokenize", {"prompt": "a", "bogus": 1}), 400, param="bogus")
    api_error(post_json(fleet, "/detokenize", {"tokens": [10**9]}), 400, param="tokens")
    api_error(post_json(fleet, "/detokenize", {"tokens": "abc"}), 400, param="tokens")


def test_stop_string_cuts_exactly_where_it_begins(fleet, tiny):
    model, tok, _ = tiny
    client = openai_client(fleet)
    prompt = [5, 17, 99, 3, 250]
    full = tok.decode(expected(model, tok, prompt, 48))
    assert len(full) > 12, full
    stop = full[len(full) // 2: len(full) // 2 + 3]
    want = full[:full.index(stop)]
    res = client.completions.create(model="tiny-v1", prompt=prompt, max_tokens=48, temperature=0, stop=[stop])
    assert res.choices[0].text == want and res.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny-v1", prompt=prompt, max_tokens=48, temperature=0, stop=stop, stream=True)]
    assert "".join(pieces) == want  # no first characters of the stop string, even in a stream
    # vLLM's include_stop_str_in_output: through the stop string's end, whole and streamed
    kept = full[:full.index(stop) + len(stop)]
    keep = {"include_stop_str_in_output": True}
    res = client.completions.create(model="tiny-v1", prompt=prompt, max_tokens=48, temperature=0, stop=[stop],
                                    extra_body=keep)
    assert res.choices[0].text == kept and res.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny-v1", prompt=prompt, max_tokens=48, temperature=0, stop=stop, stream=True, extra_body=keep)]
    assert "".join(pieces) == kept


def test_same_seed_same_sample_and_n_choices(fleet):
    client = openai_client(fleet)
    kw = dict(model="tiny-v1", prompt="hello there", max_tokens=24, temperature=0.9, top_p=0.95)
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    assert a.choices[0].text == b.choices[0].text
    two = client.completions.create(seed=99, n=2, **kw)
    assert sorted(c.index for c in two.choices) == [0, 1]
    again = client.completions.create(seed=99, n=2, **kw)
    assert [c.text for c in two.choices] == [c.text for c in again.choices]
    many = client.completions.create(prompt=["a b", "c d"], n=2, model="tiny-v1", max_tokens=4, temperature=0)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]


def test_64_concurrent_streams_complete_with_nothing_lost(fleet, tiny):
    model, tok, _ = tiny
    prompts = [[(7 * i + j) % tok.vocab_size for j in range(4 + i % 9)] for i in range(64)]
    wants = {i: tok.decode(expected(model, tok, p, 24)) for i, p in enumerate(prompts[:8])}

    async def one(client, i, p):
        stream = await client.completions.create(model="tiny-v1", prompt=p, max_tokens=24, temperature=0,
                                                 stream=True)
        text, finish = "", None
        async for c in stream:
            text += c.choices[0].text
            finish = c.choices[0].finish_reason or finish
        return i, text, finish

    async def run():
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=f"{fleet['url']}/v1", api_key="unused", max_retries=0, timeout=300,
                             http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=100), timeout=300))
        return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))

    results = asyncio.run(run())
    assert len(results) == 64 and all(f in ("stop", "length") for _, _, f in results)
    for i, text, _ in results:
        if i in wants:
            assert text == wants[i]


# ---------------------------------------------------------------------------- errors
def test_error_bodies(fleet):
    ok = {"model": "tiny-v1", "prompt": "hi", "max_tokens": 2}
    api_error(post_json(fleet, "/v1/completions", b"{not json"), 400, code="invalid_json")
    api_error(post_json(fleet, "/v1/completions", b"[1, 2]"), 400)
    api_error(post_json(fleet, "/v1/completions", {**ok, "max_tokens": "many"}), 400, param="max_tokens")
    api_error(post_json(fleet, "/v1/completions", {**ok, "temperature": 7}), 400, param="temperature")
    api_error(post_json(fleet, "/v1/completions", {"model": "tiny-v1"}), 400, param="prompt")
    api_error(post_json(fleet, "/v1/completions", {**ok, "bogus": 1}), 400, param="bogus", code="unsupported_parameter")
    for name, value in [("logprobs", 21), ("logprobs", True), ("top_logprobs", 2), ("frequency_penalty", 2.5),
                        ("presence_penalty", -3), ("repetition_penalty", 0), ("logit_bias", {"x": 5}),
                        ("logit_bias", {"1": 101}), ("logit_bias", {"99999999": 1}),
                        ("echo", 1), ("best_of", 3), ("suffix", "x")]:
        api_error(post_json(fleet, "/v1/completions", {**ok, name: value}), 400, param=name)
    chat = {"model": "tiny-v1", "messages": [{"role": "user", "content": "hi"}]}
    for name, value in [("tools", [{"type": "function", "function": {"name": "f"}}]),  # its template takes none
                        ("response_format", {"type": "yaml"}), ("logprobs", 2), ("top_logprobs", 2)]:
        api_error(post_json(fleet, "/v1/chat/completions", {**chat, name: value}), 400, param=name)
    api_error(post_json(fleet, "/v1/chat/completions", {**chat, "messages": [{"role": "tool", "content": "x"}]}), 400,
         param="messages")
    api_error(post_json(fleet, "/v1/completions", {**ok, "prompt": [10**9]}), 400, param="prompt")
    api_error(post_json(fleet, "/v1/completions", {**ok, "max_tokens": 10**6}), 400, code="context_length_exceeded")
    api_error(post_json(fleet, "/v1/completions", {**ok, "model": "gpt-4"}), 404, param="model", code="model_not_found")
    api_error(httpx.get(f"{fleet['url']}/v1/nothing", timeout=10), 404)
    # defaults the OpenAI SDKs send are honoured exactly (they mean "off")
    fine = post_json(fleet, "/v1/completions", {**ok, "frequency_penalty": 0, "logprobs": None, "echo": False})
    assert fine.status_code == 200, fine.text


def test_body_over_the_limit_is_refused_before_it_is_read(fleet):
    big = b'{"model": "tiny-v1", "prompt": "' + b"a" * (MAX_BODY + 10) + b'"}'
    api_error(post_json(fleet, "/v1/completions", big), 413)

    def chunks():  # no Content-Length: counted while read
        yield b'{"model": "tiny-v1", "prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"a" * 1024
        yield b'"}'

    api_error(httpx.post(f"{fleet['url']}/v1/completions", content=chunks(), timeout=30), 413)


def test_slow_headers_and_body_time_out(fleet):
    port = fleet["ports"]["api"]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        s.settimeout(120)  # a hang guard far above the server's timeout
        assert s.recv(1024) == b""  # closed by the server, not by our timeout (that raises)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\"")
        s.settimeout(60)
        assert b" 408 " in s.recv(4096).split(b"\r\n")[0]


def test_client_disconnect_cancels_the_session_everywhere(fleet):
    body = {"model": "tiny-v1", **LONG}
    cancelled_before = orchestrator_cancelled(fleet)
    with httpx.stream("POST", f"{fleet['url']}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert scrape_api(fleet)["specsplit:num_requests_running"] >= 1
    # on events, not within a time: the orchestrator ended the session as cancelled (run out, it
    # would be "length": LONG is thousands of tokens from done), then the workers dropped it
    wait_until(lambda: orchestrator_cancelled(fleet) > cancelled_before, 60, "the orchestrator cancelled it")
    wait_until(lambda: scrape_api(fleet)["specsplit:num_requests_running"] == 0, 60, "running back to 0")
    try:
        wait_until(lambda: worker_sessions(fleet) == 0, 60, "no session left on the workers")
    except TimeoutError:  # name where, and whether a worker left and came back meanwhile
        held = {port: worker_sessions(fleet, (port,)) for port in WORKER_METRICS}
        moves = [line for line in honcho_log(fleet["tmp"]).splitlines()
                 if "worker_expired" in line or "inflight_failed" in line or "worker_admitted" in line]
        raise AssertionError(f"sessions left by metrics port offset: {held}; worker moves: {moves[-20:]}") from None
    assert scrape_api(fleet)['specsplit:request_success_total{finished_reason="abort"}'] >= 1


def test_a_stalled_worker_back_leaves_no_session_behind(fleet):
    """A target worker that stalls past the routers' liveness window (a long pause, a starved
    CPU) has its session served by the other meanwhile, then comes back: the session then has a
    cache on both. Its end frees both (the router copies END_SESSION to every live worker).
    Driven by events: the orchestrator is paused until the stalled worker is admitted again, so
    the session cannot end before then, however fast this machine is."""
    from tests.honcho_fleet import worker_pid

    router = f"http://127.0.0.1:{fleet['metrics'] + 100}/metrics"
    expired = scrape(router)['specsplit:router_workers_expired_total{service="target"}']
    with moved_off_a_stalled_worker(fleet) as (home, other, resume, _):
        assert scrape(router)['specsplit:router_workers_expired_total{service="target"}'] == expired + 1
        orch = worker_pid(fleet["proc"].pid, "orchestrator.1")
        os.kill(orch, signal.SIGSTOP)  # the session waits here until the stalled worker is back
        try:
            resume()
            wait_until(lambda: scrape(router)['specsplit:router_workers_live{service="target"}'] == 2, 60,
                       "the stalled worker admitted again")
            assert target_sessions(fleet, home) == target_sessions(fleet, other) == 1  # a cache on each
        finally:
            os.kill(orch, signal.SIGCONT)
    # the client left: the session ends as cancelled, and its caches go from both workers
    wait_until(lambda: worker_sessions(fleet) == 0, 60, "no session left on either worker")
    assert scrape(router)['specsplit:router_end_session_copies_total{service="target"}'] >= 1


def test_a_session_that_ends_while_its_worker_is_away_is_ended_there_when_it_is_back(fleet):
    """As above, but the session ends while the stalled worker is still away: the router keeps
    the END_SESSION for the expired worker and sends it when the worker is admitted again."""
    router = f"http://127.0.0.1:{fleet['metrics'] + 100}/metrics"
    with moved_off_a_stalled_worker(fleet) as (_, other, resume, leave):
        leave()  # the session ends while its first worker is still stopped
        wait_until(lambda: target_sessions(fleet, other) == 0, 60, "the session ended on the other worker")
        resume()
    wait_until(lambda: scrape(router)['specsplit:router_workers_live{service="target"}'] == 2, 60,
               "the stalled worker admitted again")
    wait_until(lambda: worker_sessions(fleet) == 0, 60, "no session left on either worker")


@pytest.mark.timeout(600)
def test_api_rss_is_flat_over_2000_requests(fleet):
    """After a warm-up of 500 requests (allocator pools, caches filled), 1,500 more requests of
    every kind (chat, completions, streams, errors) leave the API process's RSS within 5 %."""
    from tests.honcho_fleet import worker_pid

    pid = worker_pid(fleet["proc"].pid, "api.1")
    bodies = [
        ("/v1/completions", {"model": "tiny-v1", "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0}),
        ("/v1/completions", {"model": "tiny-v1", "prompt": "hi", "max_tokens": 4, "stream": True}),
        ("/v1/chat/completions", {"model": "tiny-v1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                                  "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"model": "tiny-v1", "prompt": "hi", "logprobs": 3}),  # 400
    ]

    async def burst(n: int, offset: int) -> int:
        sem, ok = asyncio.Semaphore(16), 0
        async with httpx.AsyncClient(base_url=fleet["url"], timeout=60) as client:
            async def one(i: int) -> None:
                nonlocal ok
                path, body = bodies[(i + offset) % len(bodies)]
                async with sem:
                    resp = await client.post(path, json=body)
                ok += resp.status_code in (200, 400)
            await asyncio.gather(*(one(i) for i in range(n)))
        return ok

    assert asyncio.run(burst(500, 0)) == 500
    before = rss_kb(pid)
    samples = []
    for k in range(3):
        assert asyncio.run(burst(500, k)) == 500
        samples.append(rss_kb(pid))
    print(f"API RSS after 500 requests {before} kB, after 1000/1500/2000: {samples} kB")
    assert max(samples) <= before * 1.05, (before, samples)
    wait_until(lambda: scrape_api(fleet)["specsplit:num_requests_running"] == 0, 10, "nothing left running")
