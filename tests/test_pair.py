"""``specsplit pair``: a draft and a target worker in one process (``specsplit.workers.run_pair``),
started as the docs say for one GPU (``honcho start -f Procfile.gpu``; here on CPU, tiny fp32
pair): answers equal to the target's greedy decoding, the draft drafting and growing through the
same process that verifies, and a kill -9 of that process costs resends, not answers."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests import test_crash_only
from tests.conftest import greedy_cached, wait_until
from tests.honcho_fleet import honcho_fleet, honcho_log, stop_honcho, worker_pid
from tests.test_crash_only import _produce

pytestmark = [pytest.mark.system, pytest.mark.slow]

target_model = test_crash_only.target_model  # the tiny target (a module-scoped fixture), as the crash tests load it
PROMPTS = [f"def f{i}(x): return x * {i}" + " + 1" * (i % 3) for i in range(6)]
NEW_TOKENS = 120


def _rounds(log: str, after: float = 0.0) -> list[str]:
    """The orchestrator's round_done lines stamped after ``after`` (epoch seconds)."""
    from tests.test_crash_only import _stamp

    return [ln for ln in log.splitlines() if "round_done" in ln and _stamp(ln, "round_done") > after]


@pytest.mark.timeout(900)  # ~60 s on an idle 2-core box; the ceiling is for a starved one
def test_pair_fleet_from_procfile_gpu_is_exact_and_survives_kill9_of_the_pair(tmp_path, target_model):
    proc, _, env = honcho_fleet(tmp_path, "pair=1,orchestrator=1", procfile="Procfile.gpu",
                                SPECSPLIT_ORCHESTRATOR_COUNT="1")
    try:
        # one process, admitted by both routers (each logs it, and the worker loop too: 2 + 2)
        wait_until(lambda: honcho_log(tmp_path).count("worker_admitted") >= 4
                   and "orchestrator_started" in honcho_log(tmp_path), 300, "fleet ready")
        log = honcho_log(tmp_path)
        assert "identity=draft-pair.1" in log and "identity=target-pair.1" in log, log[-3000:]
        # one session at a time, so the rounds draft (several at once decode plainly on this pair)
        producer = _produce(tmp_path, env, PROMPTS, max_new_tokens=NEW_TOKENS, rounds=24, concurrency=1)
        assert producer.poll() is None, "the run ended before the kill"
        pid = worker_pid(proc.pid, "pair.1")
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        rc = producer.wait(timeout=480)
        assert rc == 0, (tmp_path / "produce.err").read_text()[-3000:]
        assert proc.poll() is None, "honcho stopped the fleet:\n" + honcho_log(tmp_path)[-3000:]
        rows = sorted((json.loads(line) for line in (tmp_path / "produce.out").read_text().splitlines()),
                      key=lambda r: r["index"])
        assert len(rows) == len(PROMPTS)
        for r in rows:
            ref, _ = greedy_cached(target_model, r["prompt_token_ids"], len(r["token_ids"]))
            assert r["token_ids"] == ref, r["index"]
            assert r["finish_reason"] == "stop" or r["new_tokens"] == NEW_TOKENS
        log = honcho_log(tmp_path)
        assert "role_died" in log and worker_pid(proc.pid, "pair.1") != pid
        # the process that verifies also drafted, before the kill and after its restart
        drafted = [ln for ln in _rounds(log) if not re.search(r"\bdrafted=0\b", ln)]
        after = [ln for ln in _rounds(log, killed_at) if not re.search(r"\bdrafted=0\b", ln)]
        print(f"{len(_rounds(log))} rounds, {len(drafted)} drafted, {len(after)} of them after the kill; "
              f"resumes {sum(r['resumes'] for r in rows)}")
        assert len(drafted) > len(after) > 0, (len(drafted), len(after))
    finally:
        stop_honcho(proc)
    assert proc.returncode in (0, 143), honcho_log(tmp_path)[-3000:]
    stopped = [ln for ln in honcho_log(tmp_path).splitlines() if "role_stopped" in ln]
    assert any("role=pair" in ln and "rc=0" in ln for ln in stopped), "\n".join(stopped)


def _pair_in_thread(monkeypatch, draft_router, target_router):
    """``run_pair`` of the tiny preset on a thread against two in-process routers; (thread, the
    stop event, its return codes)."""
    import threading

    from specsplit.config import WorkerSettings
    from specsplit.models import ModelSettings
    from specsplit.transport.testing import TEST_SECRET
    from specsplit.workers import run_pair

    monkeypatch.setenv("SPECSPLIT_FLEET_SECRET", TEST_SECRET.decode())
    settings = WorkerSettings(draft_backend=draft_router.backend, target_backend=target_router.backend,
                              threads=1, prefill_threads=1, heartbeat_s=0.2)
    stop, codes = threading.Event(), []
    thread = threading.Thread(target=lambda: codes.append(run_pair(settings, ModelSettings(preset="tiny"), stop=stop)),
                              daemon=True)
    thread.start()
    return thread, stop, codes


def test_a_stop_ends_both_roles_of_a_pair(monkeypatch):
    """Both roles join their routers; one stop drains both and the pair returns 0."""
    from specsplit.transport.testing import RouterThread

    with RouterThread("draft") as draft, RouterThread("target") as target:
        thread, stop, codes = _pair_in_thread(monkeypatch, draft, target)
        draft.wait_live(1, 120)
        target.wait_live(1, 120)
        stop.set()
        thread.join(90)
        assert codes == [0] and not thread.is_alive()
        draft.wait_live(0, 15)
        target.wait_live(0, 15)


def test_a_role_refused_by_its_router_ends_the_pair(monkeypatch):
    """The draft's router refuses it (another fleet's secret): the draft role ends with 2, which
    stops the target role too (admitted meanwhile, or not), and the pair returns 2, the code a
    supervisor does not restart (a configuration to fix, not a crash)."""
    from specsplit.transport.testing import RouterThread

    with RouterThread("draft", secret=b"another-fleet-secret-0123456789abc") as draft, \
            RouterThread("target") as target:
        thread, _, codes = _pair_in_thread(monkeypatch, draft, target)
        thread.join(120)
        assert codes == [2] and not thread.is_alive()
        assert not draft.live_workers()
        target.wait_live(0, 15)
