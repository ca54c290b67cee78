"""The fuzzer's HTTP target: 2,000 seeded hostile, malformed and valid requests against
``specsplit api`` in a tiny honcho fleet (small body limit and header / body timeouts, so slow
cases end fast). Every answer has a documented status and OpenAI's error body, nothing hangs,
the API never restarts, and afterwards /health is 200, no request is left running or waiting,
no 500 was counted and greedy answers are what they were. ``SPECSPLIT_FUZZ_SEED`` (default 16,
printed) and ``SPECSPLIT_FUZZ_HTTP_COUNT`` change the run. Plus the fuzzer's own checks: cases
rebuilt from (seed, index), expectations within the documented set, the oracle, the raw runner."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from specsplit.fuzz.http import ApiLimits, fuzz_api, loopback
from specsplit.fuzz.http_cases import DOCUMENTED, RAW, HttpCase, message_fields, response_fields, schema_fields
from specsplit.fuzz.http_families import FAMILIES, HttpGenerator
from specsplit.fuzz.http_run import Outcome, judge, run_raw
from tests.conftest import wait_until
from tests.honcho_fleet import honcho_fleet, honcho_log, stop_honcho, worker_pid

SEED = int(os.environ.get("SPECSPLIT_FUZZ_SEED", "16"))
COUNT = int(os.environ.get("SPECSPLIT_FUZZ_HTTP_COUNT", "2000"))
# the body timeout leaves a starved box room: a body sent whole in one write waited past 1 s for a
# CI run's busy event loop (a 408 where the case expected an answer), so it is 3 s, not the header's 1
LIMITS = ApiLimits(max_body_bytes=65536, header_timeout_s=1.0, body_timeout_s=3.0)
SETTINGS = {"SPECSPLIT_API_MAX_BODY_BYTES": str(LIMITS.max_body_bytes),
            "SPECSPLIT_API_HEADER_TIMEOUT_S": str(LIMITS.header_timeout_s),
            "SPECSPLIT_API_BODY_TIMEOUT_S": str(LIMITS.body_timeout_s)}
HANG_UP_FAMILIES = {"slow", "truncated", "disconnect"}


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_api_survives_two_thousand_fuzzed_requests(tmp_path):
    proc, ports, _ = honcho_fleet(tmp_path, "draft=1,target=1,orchestrator=1,api=1", SPECSPLIT_ORCHESTRATOR_COUNT="1",
                                  **SETTINGS)
    url = f"http://127.0.0.1:{ports['api']}"
    try:
        wait_until(lambda: _health(url) == 200 or proc.poll() is not None, 240, "the API serves")
        assert proc.poll() is None, honcho_log(tmp_path)[-3000:]
        api_pid = worker_pid(proc.pid, "api.1")
        rerun = " ".join(f"{k}={v}" for k, v in SETTINGS.items())
        print(f"http fuzz seed={SEED} count={COUNT} (set SPECSPLIT_FUZZ_SEED to change it; one case again: {rerun} "
              f"python -m specsplit.fuzz --target http --url URL --seed {SEED} --case I)")
        res = fuzz_api(url, SEED, COUNT, LIMITS, deadline_s=420)  # a hang guard: every case must run
        rep = res.report
        print(rep.summary(), res.timings)
        assert worker_pid(proc.pid, "api.1") == api_pid, "the API process restarted during the fuzz"
        failures = rep.failures + res.problems
        assert not failures, f"seed {SEED}: {len(failures)} kinds of failure:\n" + "\n".join(failures)
        assert rep.total == COUNT and set(rep.sent) == set(FAMILIES), rep.sent
        # the run reached generation, the server's limits and its timeouts, not only its parser
        assert rep.outcomes["200"] > COUNT // 10 and rep.outcomes["413"] and rep.outcomes["408"], rep.outcomes
        assert rep.outcomes["closed"] and rep.outcomes["hung_up"], rep.outcomes
        assert res.before == res.after and all(res.before)
    finally:
        stop_honcho(proc)


# ---------------------------------------------------------------------------- the fuzzer itself
def _gen(seed: int) -> HttpGenerator:
    return HttpGenerator(seed, model="m", max_body=LIMITS.max_body_bytes, header_timeout_s=1.0, body_timeout_s=1.0)


def test_cases_are_rebuilt_from_seed_and_index():
    a, b, c = _gen(7), _gen(7), _gen(8)
    first = [a.case(i) for i in range(300)]
    assert first == [b.case(i) for i in range(300)]
    assert [b.case(i) for i in reversed(range(300))] == first[::-1]  # whatever ran before
    assert first != [c.case(i) for i in range(300)]


def test_cases_expect_documented_statuses_and_cover_every_schema():
    g = _gen(3)
    cases = [g.case(i) for i in range(3000)]
    assert {c.family.split("/")[0] for c in cases} == set(FAMILIES)
    for c in cases:
        assert c.expect and c.expect <= DOCUMENTED and 500 not in c.expect, c
        assert c.bound_s > 0 and (c.transport == RAW) == bool(c.steps), c
        assert not c.may_close or c.family.split("/")[0] in HANG_UP_FAMILIES, c
    fuzzed = {c.family.split("/", 1)[1] for c in cases if c.family.startswith("wrong_type/")}
    assert set(schema_fields(chat=True)) | set(schema_fields(chat=False)) <= fuzzed
    # the Responses and Messages APIs' fields: each a seventh of the wrong types
    more = [g.case(i) for i in range(3000, 12000)]
    fuzzed |= {c.family.split("/", 1)[1] for c in more if c.family.startswith("wrong_type/")}
    assert set(response_fields()) <= fuzzed and set(message_fields()) <= fuzzed
    assert {c.path for c in cases if c.family == "valid/response"} == {"/v1/responses"}
    assert {c.path for c in cases if c.family == "valid/message"} == {"/v1/messages"}
    over = [c for c in cases if c.family.startswith("huge_field/array") and len(c.body) > LIMITS.max_body_bytes]
    assert over and all(c.expect == {413} for c in over)


def test_only_loopback_is_a_target():
    assert loopback("http://127.0.0.1:8000/v1") == ("127.0.0.1", 8000, "http://127.0.0.1:8000")
    for url in ("http://localhost:8000", "http://10.0.0.1:8000", "https://127.0.0.1:8000", "http://127.0.0.1"):
        with pytest.raises(ValueError):
            loopback(url)


def _out(status, body=b"", ctype="application/json", **kw) -> Outcome:
    return Outcome(status=status, headers={"content-type": ctype}, body=body, complete=True, **kw)


def test_oracle():
    err = b'{"error":{"message":"bad","type":"invalid_request_error","param":null,"code":null}}'
    case = HttpCase(0, "x/y", RAW, steps=(("send", b""),), expect=frozenset({400}))
    assert judge(case, _out(400, err), 1.0) == []
    assert judge(case, _out(500, err.replace(b"400", b"500")), 1.0)[0][0] == "status 500"
    assert judge(case, _out(404, err), 1.0)[0][0] == "status 404"  # documented, not this case's
    assert [p for p, _ in judge(case, _out(400, b"Invalid HTTP request received.", "text/plain"), 1.0)] == \
        ["error body not JSON"]
    assert judge(case, _out(400, b'{"detail":"x"}'), 1.0)[0][0] == "error body not OpenAI's shape"
    assert judge(case, Outcome(closed=True, headers_sent_s=0.01), 1.0)[0][0] == "closed unanswered"
    assert judge(case, Outcome(closed=True, headers_sent_s=1.5), 1.0) == []  # our headers came too late
    assert judge(case, Outcome(timed_out=True), 1.0)[0][0] == "hang"
    assert judge(case, _out(400, err, elapsed_s=99.0), 1.0)[0][0] == "hang"
    slow = HttpCase(0, "slow/body", RAW, steps=(("send", b""),), expect=frozenset({408}), may_close=True)
    assert judge(slow, Outcome(closed=True), 1.0) == []
    stream = HttpCase(0, "valid/completion", "httpx", expect=frozenset({200}), shape="completion", stream=True,
                      choices=1)
    chunk = b'data: {"object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"length"}]}\n\n'
    assert judge(stream, _out(200, chunk + b"data: [DONE]\n\n", "text/event-stream"), 1.0) == []
    assert judge(stream, _out(200, chunk, "text/event-stream"), 1.0)[0][0] == "stream without [DONE]"
    bad = judge(stream, _out(200, b'data: {"error":{}}\n\n', "text/event-stream"), 1.0)
    assert bad[0][0] == "event of the wrong shape"


def test_oracle_of_the_messages_api():
    case = HttpCase(0, "x/y", "httpx", path="/v1/messages", expect=frozenset({400}))
    theirs = b'{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: bad"}}'
    assert judge(case, _out(400, theirs), 1.0) == []
    ours = b'{"error":{"message":"bad","type":"invalid_request_error","param":null,"code":null}}'
    assert judge(case, _out(400, ours), 1.0)[0][0] == "error body not Anthropic's shape"
    ok = HttpCase(0, "valid/message", "httpx", path="/v1/messages", expect=frozenset({200}), shape="message")
    msg = {"type": "message", "content": [{"type": "text", "text": "a"}], "stop_reason": "max_tokens",
           "usage": {"input_tokens": 3, "output_tokens": 1}}
    assert judge(ok, _out(200, json.dumps(msg).encode()), 1.0) == []
    assert judge(ok, _out(200, json.dumps({**msg, "content": []}).encode()), 1.0)[0][0] == "answer of the wrong shape"
    assert judge(ok, _out(200, json.dumps({**msg, "stop_reason": "stop"}).encode()), 1.0)
    streamed = HttpCase(0, "valid/message", "httpx", path="/v1/messages", expect=frozenset({200}), shape="message",
                        stream=True)

    def events(*kinds: str) -> bytes:
        return b"".join(f'event: {k}\ndata: {{"type":"{k}"}}\n\n'.encode() for k in kinds)

    assert judge(streamed, _out(200, events("message_start", "ping", "message_stop"), "text/event-stream"), 1.0) == []
    assert judge(streamed, _out(200, events("message_start", "error"), "text/event-stream"), 1.0) == []
    assert judge(streamed, _out(200, events("message_start", "ping"), "text/event-stream"),
                 1.0)[0][0] == "stream without its end"
    assert judge(streamed, _out(200, b'event: ping\ndata: {"type":"pong"}\n\n', "text/event-stream"),
                 1.0)[0][0] == "event of the wrong shape"


def test_raw_runner_reads_answers_closes_and_silence():
    async def serve(reader, writer):
        line = await reader.readline()
        if b"/answer" in line:
            body = b'{"error":{"message":"m","type":"t","param":null,"code":null}}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked"
                         b"\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
            await writer.drain()
        elif b"/close" in line:
            writer.close()
            return
        await asyncio.sleep(30)  # silence

    async def run():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        outs = []
        # the silence's bound is what ends its case; the others' only guard a hang (they end on
        # the answer or the close, however slow the box)
        for path, bound_s in ((b"/answer", 30.0), (b"/close", 30.0), (b"/silent", 0.5)):
            case = HttpCase(0, "x/y", RAW, steps=(("send", b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n"),),
                            bound_s=bound_s)
            outs.append(await run_raw("127.0.0.1", port, case))
        server.close()
        return outs

    answer, closed, silent = asyncio.run(run())
    assert answer.status == 400 and answer.complete and b'"message":"m"' in answer.body
    assert closed.status is None and closed.closed and not closed.timed_out
    assert silent.timed_out
