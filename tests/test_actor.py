"""The session actor over real engines called in-process (the transport is tested elsewhere):
overlap drafts ahead only while it pays, and the output is the target's greedy decoding either way."""

from __future__ import annotations

import asyncio

import pytest

from schemas import DraftRequest, GenerateDone, GenerateRequest, TreeSpec
from specsplit.orchestrator.actor import ActorPolicy, HitRate, SessionActor
from specsplit.engine.draft import DraftEngine
from specsplit.engine.base import EngineLimits
from specsplit.engine.target import TargetEngine
from tests.conftest import greedy_reference

LIMITS = EngineLimits(max_sessions=4, max_session_tokens=512, max_tree_nodes=64, max_tree_depth=16)
SPEC = TreeSpec(max_nodes=8, max_depth=4, branch=2)


class EngineRpc:
    """An RPC client stand-in that hands each request to an engine in this process."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.requests = []

    async def call(self, msg, *, session_id: str, timeout_s: float | None = None):
        self.requests.append(msg)
        await asyncio.sleep(0)  # yield like a socket would, so concurrent calls interleave
        return self.engine.handle(msg)


def run_actor(draft, target, prompt, n, hits=None, **policy):
    d_rpc, t_rpc = EngineRpc(DraftEngine(draft, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    out = []
    req = GenerateRequest(session_id="s", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC)
    actor = SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=SPEC, **policy), out.append, hits)
    done = asyncio.run(actor.run())
    ahead = [m for m in d_rpc.requests if isinstance(m, DraftRequest) and m.tree.max_nodes == 2 * SPEC.max_nodes]
    assert isinstance(out[-1], GenerateDone)
    return done, len(ahead)


@pytest.mark.parametrize("which", ["often", "rarely"])
def test_overlap_drafts_ahead_only_while_it_pays(models, which):
    target, often, rarely = models["qwen2"]
    draft = often if which == "often" else rarely
    prompt, n = [3, 14, 15, 92, 65, 35], 40
    want = greedy_reference(target, prompt, n)[0]
    always, ahead_always = run_actor(draft, target, prompt, n, overlap=True, overlap_min_hit_rate=0.0)
    guarded, ahead_guarded = run_actor(draft, target, prompt, n, overlap=True)
    assert always.token_ids == guarded.token_ids == want
    assert ahead_always >= always.rounds - 1  # unguarded: every round but the last drafts ahead
    if which == "rarely":  # an unrelated draft: ahead drafts never hit, so the guard stops them
        # the optimistic EMA falls below 0.25 after 7 misses; then only every 8th round probes
        assert ahead_guarded <= 7 + guarded.rounds // 8 + 1 and ahead_guarded < ahead_always / 2
    else:
        assert ahead_guarded > 0


def test_overlap_hit_rate_is_learned_across_sessions(models):
    """The orchestrator shares one hit rate between its sessions: after a session of misses, the
    next one only probes."""
    target, _, rarely = models["qwen2"]
    hits = HitRate()
    prompt, n = [3, 14, 15, 92, 65, 35], 40
    first, ahead_first = run_actor(rarely, target, prompt, n, hits, overlap=True)
    assert hits.rate < 0.25
    second, ahead_second = run_actor(rarely, target, prompt[::-1], n, hits, overlap=True)
    assert ahead_second <= second.rounds // 8 + 1 < ahead_first
    assert second.token_ids == greedy_reference(target, prompt[::-1], n)[0]
