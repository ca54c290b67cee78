"""SpecPV through the fleet: real router, worker and orchestrator processes (tiny preset, fp32).

The fleet default (SPECSPLIT_SPECPV_*) makes every session verify its long contexts partially in
exact mode; the output equals the target's plain greedy decoding, also when a target worker is
killed mid-run (the session and its view are rebuilt on the other worker, provisional tokens are
re-checked there). A request may carry its own spec (approximate mode here).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import pytest

from schemas import SpecPVSpec
from specsplit.launch import Fleet, generate_all, spread_session_ids
from tests.conftest import KillAfterTokens, greedy_cached

pytestmark = [pytest.mark.system, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_paths():
    out = subprocess.run([sys.executable, "-m", "specsplit", "models", "path", "tiny"], capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def target_model(tiny_paths):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_paths["target"], dtype=torch.float32).eval()


def test_fleet_exact_specpv_equals_greedy_through_a_worker_kill(tmp_path, tiny_paths, target_model):
    env = dict(SPECSPLIT_MAX_SESSION_TOKENS=2048, SPECSPLIT_SPECPV_THRESHOLD=256, SPECSPLIT_SPECPV_BLOCK_SIZE=16,
               SPECSPLIT_SPECPV_SINK_BLOCKS=1, SPECSPLIT_SPECPV_RETRIEVAL_BLOCKS=4,
               SPECSPLIT_SPECPV_WINDOW_BLOCKS=2, SPECSPLIT_SPECPV_BUFFER_TOKENS=64,
               SPECSPLIT_SPECPV_REFRESH_EVERY=4, SPECSPLIT_RPC_TIMEOUT_S=20)
    fleet = Fleet.create(tmp_path, **env)
    fleet.start(drafts=1, targets=2)
    try:
        fleet.wait_ready(drafts=1, targets=2)
        rng = random.Random(17)
        prompts = [[rng.randrange(400) for _ in range(rng.randrange(500, 800))] for _ in range(8)]
        new = 48

        async def run():
            # fault injection on an event: the kill comes from the stream callback once 16 tokens
            # arrived; half the sessions are placed on target0
            kill = KillAfterTokens(lambda: fleet.kill9("target0"), 16)
            ids = spread_session_ids(len(prompts), ["target-0", "target-1"], "specpv")
            task = asyncio.ensure_future(generate_all(fleet.orchestrator, prompts, new, on_tokens=kill, session_ids=ids))
            await asyncio.wait_for(kill.done.wait(), 240)  # hang guards, not speed bounds
            assert kill.streamed < len(prompts) * new, "the run ended before the kill"
            return await asyncio.wait_for(task, 240)

        results = asyncio.run(run())
        for p, r in zip(prompts, results):
            assert r.token_ids == greedy_cached(target_model, p, new)[0] and r.finish_reason == "length"
        log = fleet.log("orchestrator")
        assert '"partial": true' in log or "partial=True" in log, log[-3000:]
        assert log.count("request_resent") + log.count("request_retry") > 0, "the kill moved no session (no resend, no retry)"
        # a request with its own spec: approximate mode streams as accepted and completes
        approx = SpecPVSpec(block_size=16, sink_blocks=1, retrieval_blocks=4, window_blocks=2, buffer_tokens=64,
                            threshold=256, exact=False)
        (r,) = asyncio.run(generate_all(fleet.orchestrator, prompts[:1], 24, specpv=approx))
        assert len(r.token_ids) == 24 and r.finish_reason == "length"
    finally:
        fleet.stop()
