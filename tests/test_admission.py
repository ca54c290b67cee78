"""Admission (bounded fair queue), the per-session token check, and retries that never run out
on CACHE_MISS or a lost router."""

from __future__ import annotations

import asyncio

import pytest

from schemas import ErrorCode, ErrorReply, GenerateDone, GenerateRequest, TreeSpec
from specsplit.engine.base import EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.orchestrator.actor import ActorPolicy, SessionActor
from specsplit.orchestrator.admission import Admission
from specsplit.orchestrator.server import session_tokens_needed
from specsplit.transport.rpc import RpcRouterLost
from tests.conftest import greedy_reference
from tests.test_actor import EngineRpc

SPEC = TreeSpec(max_nodes=8, max_depth=4, branch=2)


def test_runs_up_to_active_then_queues_then_refuses():
    a = Admission(active=2, max_sessions=4, client_share=1.0)
    assert [a.offer(b"A", f"s{i}", i) for i in range(4)] == ["run", "run", "wait", "wait"]
    assert a.offer(b"B", "x", 0).startswith("4 sessions admitted")
    assert [w.session_id for w in a.finish("s0")] == ["s2"]
    assert a.withdraw("s3", b"B") is None and a.waiting == 1  # only the producer that queued it
    assert a.withdraw("s3", b"A").session_id == "s3" and a.withdraw("s3") is None
    assert a.admitted == 2 and a.waiting == 0
    a.offer(b"A", "w1", 0), a.offer(b"B", "w2", 0)
    assert [w.session_id for w in a.clear_waiting()] == ["w1", "w2"] and a.waiting == 0 and a.admitted == 2


def test_one_client_cannot_starve_another():
    a = Admission(active=1, max_sessions=8, client_share=0.75)
    verdicts = [a.offer(b"flood", f"f{i}", i) for i in range(10)]
    assert verdicts[:6] == ["run"] + ["wait"] * 5 and all("share" in v for v in verdicts[6:])
    assert a.offer(b"other", "o", 0) == "wait"  # the flood did not take the whole queue
    order = []
    running = "f0"
    while True:
        started = a.finish(running)
        if not started:
            break
        running = started[0].session_id
        order.append(running)
    assert order.index("o") == 1  # round-robin: the other client's session starts second, not last


def test_a_session_that_can_never_fit_is_refused_and_one_that_just_fits_runs(models):
    big = GenerateRequest(session_id="s", prompt_token_ids=[1] * 4000, max_new_tokens=200)
    assert session_tokens_needed(big, TreeSpec(max_nodes=16, max_depth=10, branch=2)) > 4096
    target, draft, _ = models["llama"]
    prompt, n = [3, 1, 4, 1, 5, 9, 2, 6], 24
    req = GenerateRequest(session_id="s", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC)
    limits = EngineLimits(max_sessions=4, max_session_tokens=session_tokens_needed(req, SPEC),
                          max_tree_nodes=64, max_tree_depth=16)
    out = []
    actor = SessionActor(req, EngineRpc(DraftEngine(draft, limits)), EngineRpc(TargetEngine(target, limits)),
                         ActorPolicy(tree=SPEC, max_attempts=1), out.append)
    done = asyncio.run(actor.run())
    assert isinstance(out[-1], GenerateDone) and done.token_ids == greedy_reference(target, prompt, n)[0]


class Flaky(EngineRpc):
    """Answers the first ``n`` requests with CACHE_MISS / a lost router, then serves."""

    def __init__(self, engine, n: int, how: str) -> None:
        super().__init__(engine)
        self.n, self.how = n, how

    async def call(self, msg, *, session_id: str, timeout_s: float | None = None):
        if self.n > 0 and not isinstance(msg, type(None)) and type(msg).__name__ != "EndSession":
            self.n -= 1
            if self.how == "lost":
                raise RpcRouterLost("test")
            return ErrorReply.of(ErrorCode.CACHE_MISS, "evicted", session_id=session_id)
        return await super().call(msg, session_id=session_id, timeout_s=timeout_s)


@pytest.mark.parametrize("how", ["miss", "lost"])
def test_cache_miss_and_lost_router_never_use_up_attempts(models, how):
    target, draft, _ = models["qwen2"]
    limits = EngineLimits(max_sessions=4, max_session_tokens=512, max_tree_nodes=64, max_tree_depth=16)
    prompt, n = [7, 7, 1, 2], 16
    req = GenerateRequest(session_id="s", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC)
    out = []
    actor = SessionActor(req, Flaky(DraftEngine(draft, limits), 20, how), Flaky(TargetEngine(target, limits), 20, how),
                         ActorPolicy(tree=SPEC, max_attempts=1), out.append)
    done = asyncio.run(actor.run())
    assert isinstance(out[-1], GenerateDone) and done.token_ids == greedy_reference(target, prompt, n)[0]
