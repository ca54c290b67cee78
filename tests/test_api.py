"""The HTTP API as people use it: ``honcho start`` of the repository's Procfile and .env (the
``api`` line included; tiny fp32 pair, free ports), the official ``openai`` client (sync, async,
streaming) and raw HTTP for the error cases. Greedy answers are checked against plain greedy
decoding of the target; every error against OpenAI's status and body."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from specsplit.launch import free_ports, port_is_free, scrape
from tests.conftest import greedy_reference, wait_until
from tests.honcho_fleet import honcho_fleet, honcho_log, stop_honcho

pytestmark = [pytest.mark.system, pytest.mark.slow]
MAX_BODY = 65536
# the tiny target's greedy answer to this prompt runs 2,915 tokens before its end token: a
# generation that is still streaming when a test acts on it
LONG = {"prompt": [5, 17, 99, 3, 250], "max_tokens": 2900, "temperature": 0, "stream": True}


def _metrics_base() -> int:
    """A base port whose target and draft metrics ports (base + 300 / 400, instances 1-2) are free."""
    for _ in range(100):
        base = random.randrange(20000, 40000)
        if all(port_is_free(base + off) for off in (100, 200, 300, 301, 400, 401)):
            return base
    raise RuntimeError("no free metrics ports")


@pytest.fixture(scope="module")
def tiny():
    from specsplit.api.tokenizer import ServedTokenizer
    from specsplit.models import ModelSettings, load_model, resolve_model_paths

    paths = resolve_model_paths(ModelSettings(preset="tiny"))
    model, _ = load_model(paths.target)
    return model, ServedTokenizer(paths.target), paths


SLOW_CLIENT_S = 4  # the fleet's header and body timeouts


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny):
    tmp = tmp_path_factory.mktemp("api")
    base = _metrics_base()
    proc, ports, env = honcho_fleet(tmp, "draft=1,target=2,orchestrator=1,api=1", SPECSPLIT_ORCHESTRATOR_COUNT="1",
                                    SPECSPLIT_API_MAX_BODY_BYTES=str(MAX_BODY), SPECSPLIT_METRICS_PORT=str(base),
                                    SPECSPLIT_RPC_TIMEOUT_S="60",
                                    # the slow-client test waits these out (defaults 10 and 30 s)
                                    SPECSPLIT_API_HEADER_TIMEOUT_S=str(SLOW_CLIENT_S),
                                    SPECSPLIT_API_BODY_TIMEOUT_S=str(SLOW_CLIENT_S))
    url = f"http://127.0.0.1:{ports['api']}"
    try:
        wait_until(lambda: _health(url) == 200 or proc.poll() is not None, 240, "the API serves")
        assert proc.poll() is None, honcho_log(tmp)[-3000:]
        yield {"url": url, "tmp": tmp, "proc": proc, "env": env, "ports": ports, "metrics": base}
    finally:
        stop_honcho(proc)


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _model(fleet) -> str:
    return httpx.get(f"{fleet['url']}/v1/models", timeout=5).json()["data"][0]["id"]


def expected(model, tok, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of the target, ended at the first stop id (included), as the fleet ends it."""
    ids, _ = greedy_reference(model, prompt, n)
    for i, t in enumerate(ids):
        if t in tok.stop_token_ids:
            return ids[:i + 1]
    return ids


def _client(fleet, **kw):
    from openai import OpenAI

    return OpenAI(base_url=f"{fleet['url']}/v1", api_key="unused", max_retries=0, timeout=120, **kw)


# ---------------------------------------------------------------------------- answers
def test_models_and_health(fleet):
    assert _health(fleet["url"]) == 200
    models = _client(fleet).models.list()
    assert [m.id for m in models.data] == ["tiny-v1"]


def test_completion_greedy_equals_target_and_stream_equals_whole(fleet, tiny):
    model, tok, _ = tiny
    client = _client(fleet)
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


def test_chat_greedy_sync_async_stream_all_equal_the_target(fleet, tiny):
    from openai import AsyncOpenAI

    model, tok, _ = tiny
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count: one two"}]
    want = tok.decode(expected(model, tok, tok.encode_chat(messages), 32))
    whole = _client(fleet).chat.completions.create(model="tiny-v1", messages=messages, max_tokens=32,
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


def test_stop_string_cuts_exactly_where_it_begins(fleet, tiny):
    model, tok, _ = tiny
    client = _client(fleet)
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


def test_same_seed_same_sample_and_n_choices(fleet):
    client = _client(fleet)
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
def _post(fleet, path: str, body, **kw) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{fleet['url']}{path}", content=data, headers={"content-type": "application/json"},
                      timeout=60, **kw)


def _err(resp: httpx.Response, status: int, param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_error_bodies(fleet):
    ok = {"model": "tiny-v1", "prompt": "hi", "max_tokens": 2}
    _err(_post(fleet, "/v1/completions", b"{not json"), 400, code="invalid_json")
    _err(_post(fleet, "/v1/completions", b"[1, 2]"), 400)
    _err(_post(fleet, "/v1/completions", {**ok, "max_tokens": "many"}), 400, param="max_tokens")
    _err(_post(fleet, "/v1/completions", {**ok, "temperature": 7}), 400, param="temperature")
    _err(_post(fleet, "/v1/completions", {"model": "tiny-v1"}), 400, param="prompt")
    _err(_post(fleet, "/v1/completions", {**ok, "bogus": 1}), 400, param="bogus", code="unsupported_parameter")
    for name, value in [("logprobs", 2), ("frequency_penalty", 0.5), ("presence_penalty", 1), ("logit_bias", {"1": 5}),
                        ("echo", True), ("best_of", 3), ("suffix", "x")]:
        _err(_post(fleet, "/v1/completions", {**ok, name: value}), 400, param=name)
    chat = {"model": "tiny-v1", "messages": [{"role": "user", "content": "hi"}]}
    for name, value in [("tools", [{"type": "function", "function": {"name": "f"}}]),
                        ("response_format", {"type": "json_object"}), ("logprobs", True)]:
        _err(_post(fleet, "/v1/chat/completions", {**chat, name: value}), 400, param=name)
    _err(_post(fleet, "/v1/chat/completions", {**chat, "messages": [{"role": "tool", "content": "x"}]}), 400,
         param="messages")
    _err(_post(fleet, "/v1/completions", {**ok, "prompt": [10**9]}), 400, param="prompt")
    _err(_post(fleet, "/v1/completions", {**ok, "max_tokens": 10**6}), 400, code="context_length_exceeded")
    _err(_post(fleet, "/v1/completions", {**ok, "model": "gpt-4"}), 404, param="model", code="model_not_found")
    _err(httpx.get(f"{fleet['url']}/v1/nothing", timeout=10), 404)
    # defaults the OpenAI SDKs send are honoured exactly (they mean "off")
    fine = _post(fleet, "/v1/completions", {**ok, "frequency_penalty": 0, "logprobs": None, "echo": False})
    assert fine.status_code == 200, fine.text


def test_body_over_the_limit_is_refused_before_it_is_read(fleet):
    big = b'{"model": "tiny-v1", "prompt": "' + b"a" * (MAX_BODY + 10) + b'"}'
    _err(_post(fleet, "/v1/completions", big), 413)

    def chunks():  # no Content-Length: counted while read
        yield b'{"model": "tiny-v1", "prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"a" * 1024
        yield b'"}'

    _err(httpx.post(f"{fleet['url']}/v1/completions", content=chunks(), timeout=30), 413)


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


def _scrape_api(fleet) -> dict:
    return scrape(f"{fleet['url']}/metrics")


_WORKER_METRICS = (300, 400, 401)  # the workers' metrics ports, as offsets from the fleet's base


def _worker_sessions(fleet, offsets=_WORKER_METRICS) -> float:
    total = 0.0
    for off in offsets:
        total += sum(v for k, v in scrape(f"http://127.0.0.1:{fleet['metrics'] + off}/metrics").items()
                     if k.startswith("specsplit:worker_sessions"))
    return total


def _orchestrator_cancelled(fleet) -> float:
    """Sessions the orchestrator (its metrics port: base + 200) ended as cancelled."""
    page = scrape(f"http://127.0.0.1:{fleet['metrics'] + 200}/metrics")
    return page['specsplit:sessions_finished_total{finish_reason="cancelled"}']


def test_client_disconnect_cancels_the_session_everywhere(fleet):
    body = {"model": "tiny-v1", **LONG}
    cancelled_before = _orchestrator_cancelled(fleet)
    with httpx.stream("POST", f"{fleet['url']}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert _scrape_api(fleet)["specsplit:num_requests_running"] >= 1
    # on events, not within a time: the orchestrator ended the session as cancelled (run out, it
    # would be "length": LONG is thousands of tokens from done), then the workers dropped it
    wait_until(lambda: _orchestrator_cancelled(fleet) > cancelled_before, 60, "the orchestrator cancelled it")
    wait_until(lambda: _scrape_api(fleet)["specsplit:num_requests_running"] == 0, 60, "running back to 0")
    try:
        wait_until(lambda: _worker_sessions(fleet) == 0, 60, "no session left on the workers")
    except TimeoutError:  # name where, and whether a worker left and came back meanwhile
        held = {port: _worker_sessions(fleet, (port,)) for port in _WORKER_METRICS}
        moves = [line for line in honcho_log(fleet["tmp"]).splitlines()
                 if "worker_expired" in line or "inflight_failed" in line or "worker_admitted" in line]
        raise AssertionError(f"sessions left by metrics port offset: {held}; worker moves: {moves[-20:]}") from None
    assert _scrape_api(fleet)['specsplit:request_success_total{finished_reason="abort"}'] >= 1


def _target_sessions(fleet, slot: int) -> float:
    return _worker_sessions(fleet, (400 + slot - 1,))


@contextlib.contextmanager
def _moved_off_a_stalled_worker(fleet):
    """A LONG stream whose target worker is SIGSTOPped until the router expires it and the other
    worker serves the session (events, not times). Yields (stalled slot, other slot, resume,
    leave): ``resume()`` SIGCONTs the stalled worker (also done on the way out), ``leave()``
    closes the stream as a client that goes away (also done on the way out)."""
    from tests.honcho_fleet import worker_pid

    wait_until(lambda: _worker_sessions(fleet) == 0, 60, "no session from earlier tests")
    stalled: list[int] = []

    def resume() -> None:
        while stalled:
            os.kill(stalled.pop(), signal.SIGCONT)

    try:
        with httpx.stream("POST", f"{fleet['url']}/v1/completions", json={"model": "tiny-v1", **LONG},
                          timeout=120) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert any(next(lines).startswith("data: {") for _ in range(6))
            home = wait_until(lambda: next((n for n in (1, 2) if _target_sessions(fleet, n) == 1), None), 60,
                              "a target worker holds the session")
            stalled.append(worker_pid(fleet["proc"].pid, f"target.{home}"))
            os.kill(stalled[0], signal.SIGSTOP)
            wait_until(lambda: _target_sessions(fleet, 3 - home) == 1, 60, "the other worker serves the session")
            yield home, 3 - home, resume, resp.close
    finally:
        resume()


def test_a_stalled_worker_back_leaves_no_session_behind(fleet):
    """A target worker that stalls past the routers' liveness window (a long pause, a starved
    CPU) has its session served by the other meanwhile, then comes back: the session then has a
    cache on both. Its end frees both (the router copies END_SESSION to every live worker).
    Driven by events: the orchestrator is paused until the stalled worker is admitted again, so
    the session cannot end before then, however fast this machine is."""
    from tests.honcho_fleet import worker_pid

    router = f"http://127.0.0.1:{fleet['metrics'] + 100}/metrics"
    expired = scrape(router)['specsplit:router_workers_expired_total{service="target"}']
    with _moved_off_a_stalled_worker(fleet) as (home, other, resume, _):
        assert scrape(router)['specsplit:router_workers_expired_total{service="target"}'] == expired + 1
        orch = worker_pid(fleet["proc"].pid, "orchestrator.1")
        os.kill(orch, signal.SIGSTOP)  # the session waits here until the stalled worker is back
        try:
            resume()
            wait_until(lambda: scrape(router)['specsplit:router_workers_live{service="target"}'] == 2, 60,
                       "the stalled worker admitted again")
            assert _target_sessions(fleet, home) == _target_sessions(fleet, other) == 1  # a cache on each
        finally:
            os.kill(orch, signal.SIGCONT)
    # the client left: the session ends as cancelled, and its caches go from both workers
    wait_until(lambda: _worker_sessions(fleet) == 0, 60, "no session left on either worker")
    assert scrape(router)['specsplit:router_end_session_copies_total{service="target"}'] >= 1


def test_a_session_that_ends_while_its_worker_is_away_is_ended_there_when_it_is_back(fleet):
    """As above, but the session ends while the stalled worker is still away: the router keeps
    the END_SESSION for the expired worker and sends it when the worker is admitted again."""
    router = f"http://127.0.0.1:{fleet['metrics'] + 100}/metrics"
    with _moved_off_a_stalled_worker(fleet) as (_, other, resume, leave):
        leave()  # the session ends while its first worker is still stopped
        wait_until(lambda: _target_sessions(fleet, other) == 0, 60, "the session ended on the other worker")
        resume()
    wait_until(lambda: scrape(router)['specsplit:router_workers_live{service="target"}'] == 2, 60,
               "the stalled worker admitted again")
    wait_until(lambda: _worker_sessions(fleet) == 0, 60, "no session left on either worker")


# ---------------------------------------------------------------------------- more API processes
def _api_process(fleet, tmp: Path, name: str, **settings) -> tuple[subprocess.Popen, str]:
    port = free_ports(1)[0]
    env = {**fleet["env"], "SPECSPLIT_API_PORT": str(port), "SPECSPLIT_SUPERVISE": "false", **settings}
    log = open(tmp / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "specsplit", "api"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=10)


def test_api_keys_are_required_when_on(fleet, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# keys\nsk-one\n\nsk-two\n")
    proc, url = _api_process(fleet, tmp_path, "keyed", SPECSPLIT_API_KEYS_FILE=str(keys))
    try:
        wait_until(lambda: _health(url) == 200 or proc.poll() is not None, 120, "keyed API serves")
        body = {"model": "tiny-v1", "prompt": "hi", "max_tokens": 2}
        _err(httpx.post(f"{url}/v1/completions", json=body, timeout=30), 401, code="invalid_api_key")
        _err(httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-nope"},
                        timeout=30), 401)
        ok = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-two"}, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        assert _stop(proc) == 0


def test_binding_beyond_loopback_without_keys_is_refused(fleet, tmp_path):
    proc, _ = _api_process(fleet, tmp_path, "public", SPECSPLIT_API_HOST="0.0.0.0")
    assert proc.wait(timeout=60) == 2
    assert "requires API keys" in (tmp_path / "public.log").read_text()


def test_no_orchestrator_is_503(fleet, tmp_path):
    dead = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    proc, url = _api_process(fleet, tmp_path, "orphan", SPECSPLIT_ORCHESTRATOR=dead)
    try:
        wait_until(lambda: _health(url) == 503, 60, "the API answers 503")
        wait_until(lambda: "loading" not in httpx.get(f"{url}/health", timeout=5).text, 60, "tokenizer loaded")
        _err(httpx.post(f"{url}/v1/completions", json={"model": "tiny-v1", "prompt": "hi"}, timeout=30), 503)
    finally:
        assert _stop(proc) == 0


def test_another_tokenizer_is_refused_naming_both(fleet, tiny, tmp_path):
    _, tok, paths = tiny
    other = tmp_path / "other"
    shutil.copytree(paths.target, other, ignore=shutil.ignore_patterns("*.safetensors"))
    data = json.loads((other / "tokenizer.json").read_text())
    data["added_tokens"].append({**data["added_tokens"][-1], "id": data["added_tokens"][-1]["id"] + 1,
                                 "content": "<|not-the-fleet's|>"})
    (other / "tokenizer.json").write_text(json.dumps(data))
    proc, _ = _api_process(fleet, tmp_path, "other", SPECSPLIT_TARGET_MODEL=str(other))
    assert proc.wait(timeout=120) == 2
    log = (tmp_path / "other.log").read_text()
    assert "tokenizer_mismatch" in log and tok.fingerprint in log


def test_orchestrator_overload_is_429_with_retry_after(fleet, tmp_path):
    """A second orchestrator on the same routers admitting one session at a time: a second
    request while the first runs is refused, and the API answers 429 at once."""
    port = free_ports(1)[0]
    env = {**fleet["env"], "SPECSPLIT_ORCHESTRATOR_BIND": f"tcp://127.0.0.1:{port}",
           "SPECSPLIT_ORCHESTRATOR_MAX_SESSIONS": "1", "SPECSPLIT_ORCHESTRATOR_ACTIVE_SESSIONS": "1",
           "SPECSPLIT_METRICS_PORT": "0", "SPECSPLIT_SUPERVISE": "false"}
    log = open(tmp_path / "orch.log", "wb")
    orch = subprocess.Popen([sys.executable, "-m", "specsplit", "orchestrator"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    proc, url = _api_process(fleet, tmp_path, "small", SPECSPLIT_ORCHESTRATOR=f"tcp://127.0.0.1:{port}")
    try:
        wait_until(lambda: _health(url) == 200, 120, "the API on the small orchestrator serves")
        long = {"model": "tiny-v1", **LONG}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # (kept: a dropped iterator closes the connection)
            next(lines)
            refused = httpx.post(f"{url}/v1/completions", json={**long, "stream": False}, timeout=30)
            _err(refused, 429, code="rate_limit_exceeded")
            assert refused.headers["retry-after"] == "1"
    finally:
        assert _stop(proc) == 0
        _stop(orch)


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise LookupError(pid)


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
    before = _rss_kb(pid)
    samples = []
    for k in range(3):
        assert asyncio.run(burst(500, k)) == 500
        samples.append(_rss_kb(pid))
    print(f"API RSS after 500 requests {before} kB, after 1000/1500/2000: {samples} kB")
    assert max(samples) <= before * 1.05, (before, samples)
    wait_until(lambda: _scrape_api(fleet)["specsplit:num_requests_running"] == 0, 10, "nothing left running")
