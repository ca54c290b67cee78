"""API processes beside the fleet's own, started as `specsplit api` is (the fleet's .env and
routers): API keys, a refused public bind, no orchestrator (503), another tokenizer than the
fleet's (refused at startup), an orchestrator's overload (429 with Retry-After)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest

from specsplit.launch import free_ports
from tests.api_fleet import LONG, api_error, api_fleet, api_health, api_process, stop_process, tiny_pair
from tests.conftest import wait_until

pytestmark = [pytest.mark.system, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny):  # tiny first: it provisions the pair the fleet loads
    yield from api_fleet(tmp_path_factory)


def test_api_keys_are_required_when_on(fleet, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# keys\nsk-one\n\nsk-two\n")
    proc, url = api_process(fleet, tmp_path, "keyed", SPECSPLIT_API_KEYS_FILE=str(keys))
    try:
        wait_until(lambda: api_health(url) == 200 or proc.poll() is not None, 120, "keyed API serves")
        body = {"model": "tiny-v1", "prompt": "hi", "max_tokens": 2}
        api_error(httpx.post(f"{url}/v1/completions", json=body, timeout=30), 401, code="invalid_api_key")
        api_error(httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-nope"},
                        timeout=30), 401)
        ok = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-two"}, timeout=60)
        assert ok.status_code == 200, ok.text
        # Anthropic's clients send the key as x-api-key, and read Anthropic's error body
        import anthropic

        client = anthropic.Anthropic(base_url=url, api_key="sk-one", max_retries=0, timeout=60)
        said = client.messages.create(model="tiny-v1", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert said.usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic.Anthropic(base_url=url, api_key="sk-nope", max_retries=0, timeout=60).messages.create(
                model="tiny-v1", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert refused.value.body["error"]["type"] == "authentication_error"
    finally:
        assert stop_process(proc) == 0


def test_binding_beyond_loopback_without_keys_is_refused(fleet, tmp_path):
    proc, _ = api_process(fleet, tmp_path, "public", SPECSPLIT_API_HOST="0.0.0.0")
    assert proc.wait(timeout=60) == 2
    assert "requires API keys" in (tmp_path / "public.log").read_text()


def test_no_orchestrator_is_503(fleet, tmp_path):
    dead = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    proc, url = api_process(fleet, tmp_path, "orphan", SPECSPLIT_ORCHESTRATOR=dead)
    try:
        wait_until(lambda: api_health(url) == 503, 60, "the API answers 503")
        wait_until(lambda: "loading" not in httpx.get(f"{url}/health", timeout=5).text, 60, "tokenizer loaded")
        api_error(httpx.post(f"{url}/v1/completions", json={"model": "tiny-v1", "prompt": "hi"}, timeout=30), 503)
    finally:
        assert stop_process(proc) == 0


def test_another_tokenizer_is_refused_naming_both(fleet, tiny, tmp_path):
    _, tok, paths = tiny
    other = tmp_path / "other"
    shutil.copytree(paths.target, other, ignore=shutil.ignore_patterns("*.safetensors"))
    data = json.loads((other / "tokenizer.json").read_text())
    data["added_tokens"].append({**data["added_tokens"][-1], "id": data["added_tokens"][-1]["id"] + 1,
                                 "content": "<|not-the-fleet's|>"})
    (other / "tokenizer.json").write_text(json.dumps(data))
    proc, _ = api_process(fleet, tmp_path, "other", SPECSPLIT_TARGET_MODEL=str(other))
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
    proc, url = api_process(fleet, tmp_path, "small", SPECSPLIT_ORCHESTRATOR=f"tcp://127.0.0.1:{port}")
    try:
        wait_until(lambda: api_health(url) == 200, 120, "the API on the small orchestrator serves")
        long = {"model": "tiny-v1", **LONG}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # (kept: a dropped iterator closes the connection)
            next(lines)
            refused = httpx.post(f"{url}/v1/completions", json={**long, "stream": False}, timeout=30)
            api_error(refused, 429, code="rate_limit_exceeded")
            assert refused.headers["retry-after"] == "1"
    finally:
        assert stop_process(proc) == 0
        stop_process(orch)
