"""A fleet of a sliding-window pair started as people start it (``honcho start``, the Procfile,
the .env; ``SPECSPLIT_DRAFT_MODEL`` / ``SPECSPLIT_TARGET_MODEL`` naming model directories):
prompts pushed by ``specsplit produce`` past the window come back as the target's own greedy
decoding (tiny random Qwen2 with sliding layers, the tiny preset's tokenizer), though a target
worker's process is killed -9 mid-stream and its sessions are rebuilt on the other one."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal

import pytest

from tests.conftest import greedy_reference, perturbed, wait_until
from tests.honcho_fleet import honcho_fleet, honcho_log, stop_honcho, worker_pid
from tests.test_crash_only import _produce, _serving_target_slot
from tests.test_sliding_window import windowed_model

pytestmark = [pytest.mark.system, pytest.mark.slow]
NEW_TOKENS = 120  # a prompt's: many rounds after the kill


@pytest.mark.timeout(600)
def test_a_windowed_pair_through_honcho_equals_the_targets_greedy_decoding(tmp_path):
    from transformers import AutoModelForCausalLM

    from specsplit.models import ModelSettings, resolve_model_paths

    tiny = resolve_model_paths(ModelSettings(preset="tiny")).target
    target = windowed_model("qwen2", seed=91, vocab_size=512, sliding_window=16)
    dirs = {}
    for role, model in (("target", target), ("draft", perturbed(target, seed=92, noise=0.01))):
        dirs[role] = tmp_path / role
        model.save_pretrained(dirs[role])
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny / name, dirs[role] / name)
    proc, _, env = honcho_fleet(tmp_path, "draft=1,target=2,orchestrator=1,api=0", SPECSPLIT_ORCHESTRATOR_COUNT="1",
                                SPECSPLIT_DRAFT_MODEL=str(dirs["draft"]), SPECSPLIT_TARGET_MODEL=str(dirs["target"]),
                                SPECSPLIT_DRAFT_DTYPE="float32", SPECSPLIT_TARGET_DTYPE="float32",  # the fp32 oracle
                                SPECSPLIT_TREE_BUDGET="fixed")  # trees every round, whatever tiny forwards cost
    try:
        wait_until(lambda: honcho_log(tmp_path).count("worker_admitted") >= 3
                   and "orchestrator_started" in honcho_log(tmp_path), 300, "fleet ready")
        rng = random.Random(93)
        words = ["def", "return", "value", "x", "(", ")", ":", "+", "list", "for", "in", "print", "self"]
        prompts = [" ".join(rng.choice(words) for _ in range(rng.randrange(20, 40))) for _ in range(6)]
        producer = _produce(tmp_path, env, prompts, max_new_tokens=NEW_TOKENS, rounds=15)
        assert producer.poll() is None, "the run ended before the kill"
        # the process doing a target's work, one that serves a session: those sessions' caches are
        # rebuilt on the other target, their whole context prefilled under the window masks
        slot = _serving_target_slot(honcho_log(tmp_path), ("target.1", "target.2"))
        os.kill(worker_pid(proc.pid, slot), signal.SIGKILL)
        assert producer.wait(timeout=300) == 0, (tmp_path / "produce.err").read_text()[-3000:]
        rows = [json.loads(line) for line in (tmp_path / "produce.out").read_text().splitlines()]
        assert len(rows) == len(prompts)
        reference = AutoModelForCausalLM.from_pretrained(dirs["target"]).eval()
        for r in rows:
            assert len(r["prompt_token_ids"]) + len(r["token_ids"]) > 16 + 20  # well past the window
            want, _ = greedy_reference(reference, r["prompt_token_ids"], len(r["token_ids"]))
            assert r["token_ids"] == want, r["index"]
        assert sum(r["accepted_tokens"] for r in rows) > 0, rows  # the draft's proposals were accepted
        log = honcho_log(tmp_path)
        assert "role_died" in log and "model_refused" not in log, log[-3000:]
        assert re.search(r"request_resent|request_retry", log), "no request of the killed target was resent"
        wait_until(lambda: worker_pid(proc.pid, slot), 120, f"{slot} restarted")
        assert proc.poll() is None, "honcho stopped the fleet:\n" + log[-3000:]
    finally:
        stop_honcho(proc)
    assert proc.returncode in (0, 143), honcho_log(tmp_path)[-3000:]
