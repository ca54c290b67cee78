"""System test of the metrics: a tiny fleet of real processes (2 routers, 1 draft, 2 targets, an
orchestrator), each serving Prometheus text on its own port. After a few generations, every
process's counters agree with the tokens produced and with each other; a worker killed under
its supervisor comes back and reports the restart."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time

import pytest

from specsplit.launch import Fleet, generate_all, spread_session_ids

pytestmark = [pytest.mark.system, pytest.mark.slow]

TARGETS = ("target0", "target1")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet.create(tmp_path_factory.mktemp("metrics-fleet"), metrics=True, SPECSPLIT_RPC_TIMEOUT_S=10)
    f.start(drafts=1, targets=len(TARGETS))
    try:
        f.wait_ready(drafts=1, targets=len(TARGETS))
        yield f
    finally:
        f.stop()


def total(samples: dict[str, float], name: str) -> float:
    """Sum of a metric's samples over all its label sets."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def settled(fleet: Fleet, timeout_s: float = 120.0) -> dict[str, dict[str, float]]:
    """Every process's metrics once nothing is in flight: each routed request answered, every
    session ended on the workers (EndSession follows GenerateDone). ``timeout_s`` only guards a
    hang: past it, the snapshot is returned as it is (and the checks on it fail)."""
    deadline, previous = time.monotonic() + timeout_s, None
    while True:
        # processes are scraped one after another: a request that lands between two scrapes shows
        # in one process's counters and not yet in another's, so wait for a repeatable snapshot
        got = {name: fleet.scrape(name) for name in fleet.metrics_ports}
        quiet = all(total(got[r], "specsplit:router_routed_total") == total(got[r], "specsplit:router_replies_total")
                    for r in ("router_draft", "router_target"))
        idle = all(total(got[w], "specsplit:worker_sessions") == 0 for w in ("draft0", *TARGETS))
        if (quiet and idle and got == previous) or time.monotonic() > deadline:
            return got
        previous = got
        time.sleep(0.2)


def test_a_counters_agree_with_the_produced_tokens(fleet):
    rng = random.Random(7)
    prompts = [[rng.randrange(400) for _ in range(rng.randrange(3, 20))] for _ in range(6)]
    n = 24
    results = asyncio.run(generate_all(fleet.orchestrator, prompts, n, session_ids=spread_session_ids(len(prompts), [f"target-{i}" for i in range(len(TARGETS))], "metrics")))
    # then one alone: under load the cost model may decode plainly (no draft token accepted in a
    # CI run), while a lone session always drafts, so the speculative counters below move
    results += asyncio.run(generate_all(fleet.orchestrator, [[5, 17, 99, 3, 250, 41]], n))
    assert all(r.finish_reason == "length" and len(r.token_ids) == n for r in results)
    m = settled(fleet)
    orch = m["orchestrator"]
    generated = sum(len(r.token_ids) for r in results)
    accepted = orch["specsplit:spec_decode_num_accepted_tokens_total"]
    rounds = orch["specsplit:rounds_total"]
    # every round commits its accepted tokens and one bonus token
    assert accepted + rounds == generated == orch["specsplit:generation_tokens_total"]
    assert accepted == sum(r.accepted_tokens for r in results) > 0
    assert rounds == sum(r.rounds for r in results)
    assert orch["specsplit:spec_decode_num_draft_tokens_total"] == sum(r.drafted_tokens for r in results)
    assert total(orch, "specsplit:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert 0 < orch["specsplit:spec_decode_num_drafts_total"] <= rounds
    # rounds that started from a grown tree, re-rooted here or by the draft (each once; the cost model may
    # still send such a round's root alone, so not a bound by the drafts counted above)
    assert total(orch, "specsplit:rounds_rerooted_total") <= rounds
    assert {k for k in orch if k.startswith("specsplit:rounds_rerooted_total{")} <= {
        'specsplit:rounds_rerooted_total{where="orchestrator"}', 'specsplit:rounds_rerooted_total{where="draft"}'}
    # the n-gram cache holds the finished sessions' answers; its candidates are among the drafted
    assert orch["specsplit:lookup_cache_ngrams"] > 0
    assert (orch["specsplit:lookup_cache_accepted_tokens_total"] <= orch["specsplit:lookup_cache_draft_tokens_total"]
            <= orch["specsplit:spec_decode_num_draft_tokens_total"])
    # the per-request figures that travel in GenerateDone sum to the same counters
    per_pos = [sum(col) for col in zip(*(r.accepted_per_pos + [0] * 64 for r in results))]
    for i, v in enumerate(per_pos[:10]):
        key = f'specsplit:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'
        assert orch.get(key, 0) == v, key
    assert all(r.orchestrator_first_token_ms is not None and r.orchestrator_first_token_ms > 0 for r in results)
    assert orch["specsplit:time_to_first_token_seconds_count"] == len(results)
    assert orch['specsplit:sessions_finished_total{finish_reason="length"}'] == len(results)
    assert orch["specsplit:num_sessions_running"] == 0 and orch["specsplit:num_sessions_waiting"] == 0
    assert orch['specsplit:rpc_seconds_count{service="target"}'] == rounds  # one answered verify per round
    # the workers served exactly the orchestrator's rounds (no retries in a clean run), spread over both targets
    verifies = [m[t]['specsplit:worker_requests_total{kind="VerifyRequest",service="target"}'] for t in TARGETS]
    assert sum(verifies) == rounds and all(v > 0 for v in verifies)
    assert sum(m[t]['specsplit:worker_rounds_total{service="target"}'] for t in TARGETS) == rounds
    # at most one draft per round: a round may skip it (plain decoding under load, CostModel.plain_pays)
    assert 0 < m["draft0"]['specsplit:worker_requests_total{kind="DraftRequest",service="draft"}'] <= rounds
    # a round re-rooted here still sends the draft its DraftRequest (beside the verify)
    assert (total(orch, "specsplit:rounds_rerooted_total")
            <= m["draft0"]['specsplit:worker_requests_total{kind="DraftRequest",service="draft"}'])
    # a verify forwards its tree (root included) after the sync tokens
    fwd = sum(m[t]['specsplit:worker_forward_tokens_sum{service="target"}'] for t in TARGETS)
    assert fwd >= orch["specsplit:spec_decode_num_draft_tokens_total"] + rounds
    for w in ("draft0", *TARGETS):
        assert total(m[w], "specsplit:worker_kv_bytes") == 0 and total(m[w], "specsplit:worker_queue_depth") == 0
        assert m[w]["specsplit:process_restarts_total"] == 0
    # routers: everything routed reached a worker and was answered
    for r, workers in (("router_draft", ("draft0",)), ("router_target", TARGETS)):
        routed = total(m[r], "specsplit:router_routed_total")
        served = sum(total(m[w], "specsplit:worker_requests_total") for w in workers)
        ends = sum(m[w].get(f'specsplit:worker_requests_total{{kind="EndSession",service="{w[:-1]}"}}', 0) for w in workers)
        copies = total(m[r], "specsplit:router_end_session_copies_total")
        # each EndSession reached every worker: the session's own one answered it (routed), the rest a copy
        assert copies == ends * (len(workers) - 1) / len(workers)
        assert routed + copies == served and routed == total(m[r], "specsplit:router_replies_total") > 0
        assert total(m[r], "specsplit:router_workers_live") == len(workers)
        assert total(m[r], "specsplit:router_no_worker_total") == 0


def test_b_a_restarted_worker_reports_its_restart(fleet):
    pids = re.findall(r"role_started role=target pid=(\d+)", fleet.log("target1"))
    assert len(pids) == 1, fleet.log("target1")[-2000:]
    os.kill(int(pids[0]), signal.SIGKILL)  # the child only: its supervisor brings it back
    fleet.wait_log("target1", "role_started", count=2, timeout_s=120)
    fleet.wait_log("router_target", "worker_admitted", count=len(TARGETS) + 1, timeout_s=180)
    deadline = time.monotonic() + 60
    while True:
        try:
            got = fleet.scrape("target1")
            break
        except OSError:  # the new child has not bound its port yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert got["specsplit:process_restarts_total"] == 1
    assert fleet.scrape("target0")["specsplit:process_restarts_total"] == 0
