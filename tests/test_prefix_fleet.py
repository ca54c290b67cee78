"""The prefix cache in a fleet started as people start it (``honcho start``, the Procfile, the
.env; tiny fp32 pair, two target workers): prompts that earlier sessions began are answered from
the targets' prefix caches (``specsplit produce --json`` says how many tokens), and stay the
target's greedy decoding though the process of a target serving them is killed -9 mid-stream and
their sessions are rebuilt on the other one (from its prefix cache where it holds them)."""

from __future__ import annotations

import json
import os
import random
import re
import signal

import pytest

from tests.conftest import greedy_reference, wait_until
from tests.honcho_fleet import honcho_fleet, honcho_log, stop_honcho, worker_pid
from tests.test_crash_only import _produce, _serving_target_slot

pytestmark = [pytest.mark.system, pytest.mark.slow]


def _rows(tmp) -> list[dict]:
    return [json.loads(line) for line in (tmp / "produce.out").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_cached_prefixes_through_honcho_survive_a_kill_and_stay_exact(tmp_path):
    from specsplit.models import ModelSettings, load_model, resolve_model_paths

    proc, _, env = honcho_fleet(tmp_path, "draft=1,target=2,orchestrator=1,api=0", SPECSPLIT_ORCHESTRATOR_COUNT="1",
                                SPECSPLIT_TREE_BUDGET="fixed")  # trees every round, whatever tiny forwards cost
    try:
        wait_until(lambda: honcho_log(tmp_path).count("worker_admitted") >= 3
                   and "orchestrator_started" in honcho_log(tmp_path), 300, "fleet ready")
        rng = random.Random(41)
        words = ["def", "return", "value", "x", "(", ")", ":", "+", "list", "for", "in", "print", "self", "while"]
        prompts = [" ".join(rng.choice(words) for _ in range(rng.randrange(70, 90))) for _ in range(4)]
        # each prompt 6 times, 4 sessions at a time: sessions on both targets (by the hash of their
        # ids: all 6 on one, 1 time in 32) end and leave their K/V
        seed = _produce(tmp_path, env, [p for _ in range(6) for p in prompts], max_new_tokens=8, rounds=0,
                        concurrency=4)
        assert seed.wait(timeout=300) == 0, (tmp_path / "produce.err").read_text()[-3000:]
        # again, longer, all at once: the first rounds copy the prompts' blocks
        seeded = len(honcho_log(tmp_path))
        producer = _produce(tmp_path, env, prompts, max_new_tokens=120, rounds=12)
        assert producer.poll() is None, "the run ended before the kill"
        # a target serving this run's sessions (the seeds' ended: a target that served only them is idle)
        log = honcho_log(tmp_path)
        slot = _serving_target_slot(log[seeded:], ("target.1", "target.2"), before=log[:seeded])
        os.kill(worker_pid(proc.pid, slot), signal.SIGKILL)
        assert producer.wait(timeout=300) == 0, (tmp_path / "produce.err").read_text()[-3000:]
        rows = _rows(tmp_path)
        assert len(rows) == len(prompts)
        target, _ = load_model(resolve_model_paths(ModelSettings(preset="tiny")).target)
        for r in rows:
            want, _ = greedy_reference(target, r["prompt_token_ids"], len(r["token_ids"]))
            assert r["token_ids"] == want, r["index"]
            assert r["cached_tokens"] % 64 == 0 and r["cached_tokens"] < len(r["prompt_token_ids"])
        # a prompt misses where its seeds all went to the other target: 1 in 64; 3 of 4: ~1 in 65,000
        assert sum(r["cached_tokens"] > 0 for r in rows) >= 2, rows
        log = honcho_log(tmp_path)
        assert "role_died" in log and re.search(r"request_resent|request_retry", log), log[-3000:]
        wait_until(lambda: worker_pid(proc.pid, slot), 120, f"{slot} restarted")
        assert proc.poll() is None, "honcho stopped the fleet:\n" + log[-3000:]
    finally:
        stop_honcho(proc)
    assert proc.returncode in (0, 143), honcho_log(tmp_path)[-3000:]
