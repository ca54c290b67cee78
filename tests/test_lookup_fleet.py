"""Prompt lookup alone (SPECSPLIT_SPECULATOR=lookup) through the fleet: real router, worker and
orchestrator processes (tiny preset, fp32), and no draft worker at all."""

from __future__ import annotations

import asyncio
import random

import pytest

from specsplit.launch import Fleet, generate_all
from tests.conftest import greedy_cached
from tests.test_specpv_fleet import target_model, tiny_paths  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.system, pytest.mark.slow]


def test_a_lookup_only_fleet_runs_without_a_draft_worker(tmp_path, tiny_paths, target_model):
    """SPECSPLIT_SPECULATOR=lookup: a fleet started with no draft worker answers greedy prompts
    with the target's greedy decoding (prompt lookup's candidates verified on repetitive prompts)
    and ends its sessions without ever waiting on the draft router."""
    # a stall of a few seconds on a starved box must not read as a lost router (a resend, asserted absent)
    fleet = Fleet.create(tmp_path, SPECSPLIT_SPECULATOR="lookup", SPECSPLIT_RPC_TIMEOUT_S=20, SPECSPLIT_LIVENESS=100)
    fleet.start(drafts=0, targets=1)
    try:
        fleet.wait_ready(drafts=0, targets=1)
        rng = random.Random(5)
        prompts = [[rng.randrange(400) for _ in range(12)] * 4 for _ in range(3)]
        results = asyncio.run(asyncio.wait_for(generate_all(fleet.orchestrator, prompts, 24), 300))  # a hang guard
        for p, r in zip(prompts, results):
            assert r.token_ids == greedy_cached(target_model, p, 24)[0] and r.finish_reason == "length"
        assert sum(r.drafted_tokens for r in results) > 0  # lookup nodes were verified
        assert fleet.log("router_draft").count("worker_admitted") == 0
        # never waited on the draft router: no request there timed out or was retried (on events,
        # where a bound on the run's time would only say how fast the box is)
        log = fleet.log("orchestrator")
        assert "request_retry" not in log and "request_resent" not in log, log[-3000:]
    finally:
        fleet.stop()
