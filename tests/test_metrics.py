"""Prometheus metrics: the counting rule, the names vLLM users read, the port scheme, a port in
use, the routers' and workers' collectors, the supervisor's restart count, and an actor whose
counters agree with its GenerateDone and with the tokens it produced."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from brokers.metrics import ROLE_OFFSETS, instance_slot, metrics_port, router_registry, serve_metrics
from brokers.settings import MetricsSettings
from schemas import Ack, DraftReply, DraftRequest, ErrorCode, ErrorReply, FlatTree, GenerateDone, GenerateRequest
from schemas import CacheSync, EndSession, TreeSpec, VerifyReply
from specsplit.launch import scrape
from specsplit.metrics import OrchestratorMetrics, WorkerMetrics
from specsplit.transport.testing import TEST_SECRET
from specsplit.orchestrator.state import RoundCount, RoundStats


def samples(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def tree_of(parents: list[int]) -> FlatTree:
    return FlatTree(token_ids=list(range(10, 10 + len(parents))), parents=parents,
                    draft_logprobs=[0.0] * len(parents))


def reply(accepted: list[int], rnd: int = 0) -> VerifyReply:
    return VerifyReply(session_id="s", round=rnd, accepted_token_ids=accepted, bonus_token_id=7, cache_len=3)


# root 0; 1, 2 under the root; 3 under 1; 4 under 3: depths 0, 1, 1, 2, 3
TREE = tree_of([-1, 0, 0, 1, 3])


def test_round_count_excludes_the_root_and_the_bonus():
    c = RoundCount.of(TREE, reply([11, 13]))
    assert (c.drafted, c.accepted, list(c.positions), c.committed) == (4, 2, [0, 1], 3)
    c = RoundCount.of(tree_of([-1]), reply([]))
    assert (c.drafted, c.accepted, list(c.positions), c.committed) == (0, 0, [], 1)


def test_spec_decode_counters_have_vllms_names_and_agree_with_round_stats():
    m, stats = OrchestratorMetrics(positions=3), RoundStats()
    rounds = [(TREE, reply([11, 13, 14])), (TREE, reply([])), (TREE, reply([12])), (tree_of([-1]), reply([]))]
    for tree, r in rounds:
        m.observe_round(stats.add(tree, r), 0, 0.01)
    got = samples(m.registry)
    # a root-only round is a round, not a draft
    assert got["specsplit:spec_decode_num_drafts_total"] == 3
    assert got["specsplit:rounds_total"] == 4
    assert got["specsplit:spec_decode_num_draft_tokens_total"] == 12 == stats.drafted
    assert got["specsplit:spec_decode_num_accepted_tokens_total"] == 4 == stats.accepted
    per_pos = [got[f'specsplit:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)]
    assert per_pos == [2, 1, 1] == stats.accepted_per_depth
    assert sum(per_pos) == got["specsplit:spec_decode_num_accepted_tokens_total"]
    # committed tokens: accepted + one bonus per round
    assert got["specsplit:spec_decode_num_accepted_tokens_total"] + got["specsplit:rounds_total"] == sum(
        len(r.accepted_token_ids) + 1 for _, r in rounds)
    text = generate_latest(m.registry).decode()
    for name in ("specsplit:spec_decode_num_drafts_total ", "specsplit:spec_decode_num_draft_tokens_total ",
                 "specsplit:spec_decode_num_accepted_tokens_total ",
                 'specsplit:spec_decode_num_accepted_tokens_per_pos_total{position="0"} '):
        assert f"\n{name}" in text, name


def test_positions_are_created_on_use_and_bounded():
    m = OrchestratorMetrics(positions=1)
    deep = tree_of([-1, 0, 1, 2, 3])
    m.observe_round(RoundCount.of(deep, reply([1, 2, 3, 4])), 0, 0.01)
    got = samples(m.registry)
    assert [got[f'specsplit:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(4)] == [1] * 4
    m._position(10_000).inc()  # never more than MAX_TREE_DEPTH labels
    assert len([k for k in samples(m.registry) if "per_pos_total" in k]) == 64


def test_port_scheme_by_role_and_honcho_instance():
    s = MetricsSettings()
    assert s.metrics_port == 9500 and s.metrics_host == "127.0.0.1"
    assert instance_slot({"HONCHO_PROCESS_NAME": "draft.2"}) == 2
    assert instance_slot({}) == 1 and instance_slot({"HONCHO_PROCESS_NAME": "draft"}) == 1
    ports = {(role, slot): metrics_port(s, role, slot) for role in ROLE_OFFSETS for slot in (1, 2, 3)}
    assert len(set(ports.values())) == len(ports)  # honcho -c draft=3,target=3,orchestrator=3: no clash
    assert ports[("router_draft", 1)] == 9500 and ports[("draft", 2)] == 9801 and ports[("target", 1)] == 9900
    assert metrics_port(MetricsSettings(metrics_port=0), "draft", 2) == 0  # off
    assert metrics_port(MetricsSettings(metrics_bind_port=1234), "draft", 2) == 1234  # outright
    with pytest.raises(ValueError):
        metrics_port(s, "draft", 101)


class _Log:
    def __init__(self) -> None:
        self.events = []

    def info(self, event, **kw) -> None:
        self.events.append(event)

    warning = info


def test_a_port_in_use_is_logged_not_fatal_and_a_free_one_serves():
    m = OrchestratorMetrics()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        log = _Log()
        assert serve_metrics(m.registry, MetricsSettings(metrics_bind_port=port), "orchestrator", log) is None
        assert log.events == ["metrics_port_unavailable"]
    log = _Log()
    assert serve_metrics(m.registry, MetricsSettings(metrics_port=0), "draft", log) is None
    assert log.events == ["metrics_off"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert serve_metrics(m.registry, MetricsSettings(metrics_bind_port=free), "orchestrator", _Log()) == free
    got = scrape(f"http://127.0.0.1:{free}/metrics")
    assert got["specsplit:spec_decode_num_drafts_total"] == 0


def test_router_collector_reads_router_stats():
    from brokers.router import Router

    router = Router("target", "tcp://127.0.0.1:0", "tcp://127.0.0.1:1", secret=TEST_SECRET)  # binds nothing until run
    try:
        router.stats.routed, router.stats.replies, router.stats.no_worker = 5, 4, 2
        got = samples(router_registry(router, MetricsSettings(supervised_restarts=3)))
        assert got['specsplit:router_routed_total{service="target"}'] == 5
        assert got['specsplit:router_replies_total{service="target"}'] == 4
        assert got['specsplit:router_no_worker_total{service="target"}'] == 2
        assert got['specsplit:router_workers_live{service="target"}'] == 0
        assert got["specsplit:process_restarts_total"] == 3
    finally:
        router.close()


def test_worker_metrics_count_requests_errors_rounds_forwards_and_gauges():
    class Store:
        def __len__(self):
            return 2

        def bytes_held(self):
            return 4096

    class Backend:
        def __init__(self):
            self.calls = []

        def before_forward(self, n):
            self.calls.append(n)

    m, backend = WorkerMetrics("draft"), Backend()
    m.watch(Store(), lambda: 3)
    m.watch_forwards(backend)
    backend.before_forward(9)
    backend.before_forward(1)
    req = DraftRequest(session_id="s", round=0, sync=CacheSync(base_len=0, append_token_ids=[1]), root=2)
    m.observe(req, DraftReply(session_id="s", round=0, tree=tree_of([-1])), 0.01)
    m.observe(req, ErrorReply.of(ErrorCode.CACHE_MISS, "x"), 0.001)
    m.observe(EndSession(session_id="s"), Ack(), 0.0)
    got = samples(m.registry)
    assert backend.calls == [9, 1]  # the wrapped backend still runs
    assert got['specsplit:worker_forward_tokens_count{service="draft"}'] == 2
    assert got['specsplit:worker_forward_tokens_sum{service="draft"}'] == 10
    assert got['specsplit:worker_requests_total{kind="DraftRequest",service="draft"}'] == 2
    assert got['specsplit:worker_errors_total{code="CACHE_MISS",service="draft"}'] == 1
    assert got['specsplit:worker_rounds_total{service="draft"}'] == 1
    assert got['specsplit:worker_batch_size_count{service="draft"}'] == 3
    assert got['specsplit:worker_sessions{service="draft"}'] == 2
    assert got['specsplit:worker_kv_bytes{service="draft"}'] == 4096
    assert got['specsplit:worker_queue_depth{service="draft"}'] == 3


def test_supervisor_passes_its_restart_count_to_the_child(monkeypatch):
    from specsplit import supervise
    from specsplit.config import SupervisorSettings

    seen = []

    class Popen:
        def __init__(self, args, env, preexec_fn):
            seen.append(env[supervise.RESTARTS_VAR])

    monkeypatch.setattr(supervise.subprocess, "Popen", Popen)
    sup = supervise.Supervisor(["draft"], SupervisorSettings())
    sup._spawn()
    sup.restarts = 2
    sup._spawn()
    assert seen == ["0", "2"]
    assert MetricsSettings().supervised_restarts == 0
    monkeypatch.setenv(supervise.RESTARTS_VAR, "2")
    assert MetricsSettings().supervised_restarts == 2  # what the child reads


def test_actor_counters_agree_with_generate_done_and_tokens(models):
    from specsplit.engine.base import EngineLimits
    from specsplit.engine.draft import DraftEngine
    from specsplit.engine.target import TargetEngine
    from specsplit.orchestrator.actor import ActorPolicy, SessionActor
    from tests.test_actor import EngineRpc

    target, often, _ = models["qwen2"]
    limits = EngineLimits(max_sessions=4, max_session_tokens=512, max_tree_nodes=64, max_tree_depth=16)
    spec = TreeSpec(max_nodes=8, max_depth=4, branch=2)
    m = OrchestratorMetrics(positions=spec.max_depth)
    d_rpc, t_rpc = EngineRpc(DraftEngine(often, limits)), EngineRpc(TargetEngine(target, limits))
    dones = []
    for i, n in enumerate((17, 9)):
        req = GenerateRequest(session_id=f"s{i}", prompt_token_ids=[3, 14, 15, 92, 65], max_new_tokens=n, tree=spec)
        out = []
        done = asyncio.run(SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=spec), out.append, metrics=m,
                                        queued_s=0.5).run())
        assert isinstance(out[-1], GenerateDone) and len(done.token_ids) == n
        assert done.first_token_ms is not None and done.first_token_ms >= 500  # queueing included
        assert sum(done.accepted_per_pos) == done.accepted_tokens
        assert done.accepted_tokens + done.rounds == n  # every round commits accepted + the bonus
        dones.append(done)
    got = samples(m.registry)
    generated = sum(len(d.token_ids) for d in dones)
    assert got["specsplit:generation_tokens_total"] == generated
    assert got["specsplit:spec_decode_num_accepted_tokens_total"] == sum(d.accepted_tokens for d in dones) > 0
    assert got["specsplit:spec_decode_num_draft_tokens_total"] == sum(d.drafted_tokens for d in dones)
    assert got["specsplit:rounds_total"] == sum(d.rounds for d in dones)
    assert got["specsplit:spec_decode_num_accepted_tokens_total"] + got["specsplit:rounds_total"] == generated
    per_pos = sum(v for k, v in got.items() if k.startswith("specsplit:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == got["specsplit:spec_decode_num_accepted_tokens_total"]
    assert got["specsplit:time_to_first_token_seconds_count"] == 2
    assert got['specsplit:sessions_finished_total{finish_reason="length"}'] == 2
    assert got['specsplit:rpc_seconds_count{service="target"}'] == got["specsplit:rounds_total"]


def test_metrics_modules_do_nothing_at_import_and_brokers_stay_torch_free():
    code = ("import sys, threading, brokers.metrics\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('specsplit', 'torch')]\n"
            "assert not bad, bad\n"
            "import specsplit.metrics\n"
            "assert 'torch' not in sys.modules\n"
            "assert threading.active_count() == 1, threading.enumerate()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
