"""The fleet tests/test_api.py runs against (``honcho start`` of the Procfile and .env, the
``api`` line included, tiny fp32 pair, free ports) and the helpers its tests share: metrics, raw
HTTP, OpenAI error bodies, more API processes. test_api.py wraps ``tiny_pair`` and ``api_fleet``
in module-scoped fixtures, so it still starts one fleet."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from specsplit.launch import ephemeral_low, free_ports, handed_out, port_is_free, reserve, scrape
from tests.conftest import greedy_reference, wait_until
from tests.honcho_fleet import honcho_fleet, honcho_log, stop_honcho

MAX_BODY = 65536
# the tiny target's greedy answer to this prompt runs 2,915 tokens before its end token: a
# generation that is still streaming when a test acts on it
LONG = {"prompt": [5, 17, 99, 3, 250], "max_tokens": 2900, "temperature": 0, "stream": True}


def metrics_base() -> int:
    """A base port whose target and draft metrics ports (base + 300 / 400, instances 1-2) are free,
    all below the kernel's ephemeral range: a port in it may become a connection's local port
    between this check and the worker's bind ~15 s later (seen in CI: the draft's metrics port
    taken, its scrape refused)."""
    top = max(ephemeral_low() - 500, 10500)
    for _ in range(100):
        base = random.randrange(10000, top)
        if all(port_is_free(base + off) for off in (100, 200, 300, 301, 400, 401)) \
                and not any(handed_out(p) for p in range(base, base + 500)):
            reserve(range(base, base + 500))  # (no fleet's address drawn after it falls among them)
            return base
    raise RuntimeError("no free metrics ports")


def tiny_pair():
    """(the tiny target model, its served tokenizer, the pair's paths)."""
    from specsplit.api.tokenizer import ServedTokenizer
    from specsplit.models import ModelSettings, load_model, resolve_model_paths

    paths = resolve_model_paths(ModelSettings(preset="tiny"))
    model, _ = load_model(paths.target)
    return model, ServedTokenizer(paths.target), paths


SLOW_CLIENT_S = 4  # the fleet's header and body timeouts


def api_fleet(tmp_path_factory, **settings: str):
    """The fleet (``settings``: SPECSPLIT_* over its own), yielded as {url, tmp, proc, env, ports,
    metrics}; stopped on the way out."""
    tmp = tmp_path_factory.mktemp("api")
    base = metrics_base()
    proc, ports, env = honcho_fleet(tmp, "draft=1,target=2,orchestrator=1,api=1", SPECSPLIT_ORCHESTRATOR_COUNT="1",
                                    SPECSPLIT_API_MAX_BODY_BYTES=str(MAX_BODY), SPECSPLIT_METRICS_PORT=str(base),
                                    SPECSPLIT_RPC_TIMEOUT_S="60",
                                    # the slow-client test waits these out (defaults 10 and 30 s)
                                    SPECSPLIT_API_HEADER_TIMEOUT_S=str(SLOW_CLIENT_S),
                                    SPECSPLIT_API_BODY_TIMEOUT_S=str(SLOW_CLIENT_S), **settings)
    url = f"http://127.0.0.1:{ports['api']}"
    try:
        wait_until(lambda: api_health(url) == 200 or proc.poll() is not None, 240, "the API serves")
        assert proc.poll() is None, honcho_log(tmp)[-3000:]
        yield {"url": url, "tmp": tmp, "proc": proc, "env": env, "ports": ports, "metrics": base}
    finally:
        stop_honcho(proc)


def api_health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def served_model(fleet) -> str:
    return httpx.get(f"{fleet['url']}/v1/models", timeout=5).json()["data"][0]["id"]


def expected(model, tok, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of the target, ended at the first stop id (included), as the fleet ends it."""
    ids, _ = greedy_reference(model, prompt, n)
    for i, t in enumerate(ids):
        if t in tok.stop_token_ids:
            return ids[:i + 1]
    return ids


def openai_client(fleet, **kw):
    from openai import OpenAI

    return OpenAI(base_url=f"{fleet['url']}/v1", api_key="unused", max_retries=0, timeout=120, **kw)


def post_json(fleet, path: str, body, **kw) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{fleet['url']}{path}", content=data, headers={"content-type": "application/json"},
                      timeout=60, **kw)


def api_error(resp: httpx.Response, status: int, param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def scrape_api(fleet) -> dict:
    return scrape(f"{fleet['url']}/metrics")


WORKER_METRICS = (300, 400, 401)  # the workers' metrics ports, as offsets from the fleet's base


def worker_sessions(fleet, offsets=WORKER_METRICS) -> float:
    """Sessions the workers at ``offsets`` hold; NaN while one of them does not answer (a worker
    killed by an earlier test, not yet restarted), so waits on a count keep waiting."""
    total = 0.0
    for off in offsets:
        try:
            page = scrape(f"http://127.0.0.1:{fleet['metrics'] + off}/metrics", timeout_s=5.0)
        except OSError:
            return float("nan")
        total += sum(v for k, v in page.items() if k.startswith("specsplit:worker_sessions"))
    return total


def orchestrator_cancelled(fleet) -> float:
    """Sessions the orchestrator (its metrics port: base + 200) ended as cancelled."""
    page = scrape(f"http://127.0.0.1:{fleet['metrics'] + 200}/metrics")
    return page['specsplit:sessions_finished_total{finish_reason="cancelled"}']


def target_sessions(fleet, slot: int) -> float:
    return worker_sessions(fleet, (400 + slot - 1,))


def stream_killing(fleet, body: dict, role: str, path: str = "/v1/completions") -> list[dict]:
    """Once no session is left from earlier tests, stream ``body`` from ``path`` (/v1/completions,
    llama-server's /infill and /completion, or /v1/messages), and once 40 characters have come kill -9 the
    process serving it: its target worker (``role`` "target", found by its session count), the
    draft worker ("draft": the fleet has one) or the orchestrator. Returns every chunk's choice
    (llama-server's: the chunk, its text in ``content``; the Messages API's: the event),
    once the API serves again (a restarted orchestrator may not have heard from a target worker
    yet: the next request would be a 503); fails when the answer ended before the kill."""
    from tests.honcho_fleet import worker_pid

    wait_until(lambda: target_sessions(fleet, 1) + target_sessions(fleet, 2) == 0, 60, "no session from earlier tests")
    choices, text, killed = [], "", None
    with httpx.stream("POST", f"{fleet['url']}{path}", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            choices.append(chunk["choices"][0] if "choices" in chunk else chunk)
            # a completion's text, llama-server's content, or an Anthropic text delta's text
            text += choices[-1].get("text", choices[-1].get("content", (chunk.get("delta") or {}).get("text", "")))
            if killed is None and len(text) > 40:
                if role == "target":
                    home = wait_until(lambda: next((n for n in (1, 2) if target_sessions(fleet, n) == 1), None), 60,
                                      "a target worker holds the session")
                    killed = worker_pid(fleet["proc"].pid, f"target.{home}")
                else:
                    killed = worker_pid(fleet["proc"].pid, "draft.1" if role == "draft" else "orchestrator.1")
                os.kill(killed, signal.SIGKILL)
    assert killed is not None, "the answer ended before the kill"
    wait_until(lambda: api_health(fleet["url"]) == 200, 120, "the API serves again after the kill")
    return choices


@contextlib.contextmanager
def moved_off_a_stalled_worker(fleet):
    """A LONG stream whose target worker is SIGSTOPped until the router expires it and the other
    worker serves the session (events, not times). Yields (stalled slot, other slot, resume,
    leave): ``resume()`` SIGCONTs the stalled worker (also done on the way out), ``leave()``
    closes the stream as a client that goes away (also done on the way out)."""
    from tests.honcho_fleet import worker_pid

    wait_until(lambda: worker_sessions(fleet) == 0, 60, "no session from earlier tests")
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
            home = wait_until(lambda: next((n for n in (1, 2) if target_sessions(fleet, n) == 1), None), 60,
                              "a target worker holds the session")
            stalled.append(worker_pid(fleet["proc"].pid, f"target.{home}"))
            os.kill(stalled[0], signal.SIGSTOP)
            wait_until(lambda: target_sessions(fleet, 3 - home) == 1, 60, "the other worker serves the session")
            yield home, 3 - home, resume, resp.close
    finally:
        resume()


def api_process(fleet, tmp: Path, name: str, **settings) -> tuple[subprocess.Popen, str]:
    port = free_ports(1)[0]
    env = {**fleet["env"], "SPECSPLIT_API_PORT": str(port), "SPECSPLIT_SUPERVISE": "false", **settings}
    log = open(tmp / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "specsplit", "api"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, f"http://127.0.0.1:{port}"


def stop_process(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=10)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise LookupError(pid)
