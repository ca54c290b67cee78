"""The session actor over real engines called in-process (the transport is tested elsewhere):
with and without tree growth, the output is the target's greedy decoding."""

from __future__ import annotations

import asyncio

import pytest

from schemas import GenerateDone, GenerateRequest, GrowRequest, TreeSpec
from specsplit.orchestrator.actor import ActorPolicy, SessionActor
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
        self.requests, self.replies = [], []

    async def call(self, msg, *, session_id: str, timeout_s: float | None = None):
        self.requests.append(msg)
        # yield like a socket would (a reply takes more than one turn of the loop), so concurrent calls
        # interleave: what the actor sends once a verify has left (its growth request) goes out before the reply
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        reply = self.engine.handle(msg)
        self.replies.append(reply)
        return reply


def run_actor(draft, target, prompt, n, **policy):
    d_rpc, t_rpc = EngineRpc(DraftEngine(draft, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    out = []
    req = GenerateRequest(session_id="s", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC)
    actor = SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=SPEC, **policy), out.append)
    done = asyncio.run(actor.run())
    assert isinstance(out[-1], GenerateDone)
    assert all(getattr(p, "_grow_task", None) is None for p in actor.proposers)  # no grow request left behind
    grows = [m for m in d_rpc.requests if isinstance(m, GrowRequest)]
    return done, grows


@pytest.mark.parametrize("which", ["often", "rarely"])
@pytest.mark.parametrize("grow", [False, True])
def test_actor_equals_greedy_with_and_without_growth(models, which, grow):
    target, often, rarely = models["qwen2"]
    draft = often if which == "often" else rarely
    prompt, n = [3, 14, 15, 92, 65, 35], 40
    want = greedy_reference(target, prompt, n)[0]
    done, grows = run_actor(draft, target, prompt, n, grow=grow, grow_fraction=4.0)
    assert done.token_ids == want
    if grow:  # every round after the first (which has no verify time to size a budget) grows, but a
        # last one left a single token to make: it is plain (no draft call, nothing to grow for)
        assert len(grows) in (done.rounds - 1, done.rounds - 2)
        assert sorted(g.round for g in grows) == list(range(1, len(grows) + 1))
    else:
        assert not grows


@pytest.mark.parametrize("which", ["often", "rarely"])
def test_the_first_round_verifies_its_root_while_the_draft_forwards_the_prompt(models, which):
    """SPECSPLIT_OVERLAP_PREFILL: round 0 sends the prompt to both workers at once, its verify
    holding the root alone; round 1's DraftRequest finds the prompt in the draft's cache (nothing
    appended but what round 0 committed) and, where the draft foresaw the first token, re-uses
    the tree it drew. The output is the target's greedy decoding."""
    from schemas import DraftReply, DraftRequest, VerifyRequest

    target, often, rarely = models["qwen2"]
    draft = often if which == "often" else rarely
    d_rpc, t_rpc = EngineRpc(DraftEngine(draft, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    prompt, n, out = [3, 14, 15, 92, 65, 35], 40, []
    req = GenerateRequest(session_id="s", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC)
    actor = SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=SPEC, overlap_prefill=True, grow=True), out.append)
    done = asyncio.run(actor.run())
    assert done.token_ids == greedy_reference(target, prompt, n)[0]
    verifies = [m for m in t_rpc.requests if isinstance(m, VerifyRequest)]
    drafts = [(m, r) for m, r in zip(d_rpc.requests, d_rpc.replies) if isinstance(m, DraftRequest)]
    assert verifies[0].round == 0 and verifies[0].tree.token_ids == [prompt[-1]]
    assert verifies[0].sync.append_token_ids == prompt[:-1]
    (first, _), (second, reply) = drafts[:2]
    assert first.round == 0 and first.sync.append_token_ids == prompt[:-1] and first.root == prompt[-1]
    # round 1: the draft holds the prompt; the first token is its root, nothing else to forward
    assert second.round == 1 and second.sync.base_len == len(prompt) and second.sync.append_token_ids == []
    assert second.root == done.token_ids[0] and isinstance(reply, DraftReply)
    if which == "often":  # the draft foresaw the first token: round 1 starts from its tree
        assert reply.reused_nodes > 0
    assert verifies[1].tree.num_nodes > 1  # round 1 verifies a drafted tree


def test_a_failed_draft_beside_the_first_round_resends_the_whole_prompt(models):
    """The DraftRequest sent beside round 0 fails (the draft worker answers an error): the next
    round finds out before it drafts and sends the whole context; the output is unchanged."""
    from schemas import DraftRequest, ErrorCode, ErrorReply

    class FailFirstDraft(EngineRpc):
        async def call(self, msg, *, session_id, timeout_s=None):
            if isinstance(msg, DraftRequest) and msg.round == 0:
                self.requests.append(msg)
                self.replies.append(None)
                return ErrorReply.of(ErrorCode.OVERLOADED, "busy", session_id=session_id, retryable=True)
            return await super().call(msg, session_id=session_id, timeout_s=timeout_s)

    target, often, _ = models["qwen2"]
    d_rpc, t_rpc = FailFirstDraft(DraftEngine(often, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    prompt, n, out = [3, 14, 15, 92, 65, 35], 20, []
    req = GenerateRequest(session_id="s", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC)
    done = asyncio.run(SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=SPEC, overlap_prefill=True), out.append).run())
    assert done.token_ids == greedy_reference(target, prompt, n)[0]
    drafts = [m for m in d_rpc.requests if isinstance(m, DraftRequest)]
    assert drafts[1].round == 1 and drafts[1].sync.base_len == 0
    assert drafts[1].sync.append_token_ids == [*prompt, done.token_ids[0]][:-1]


def test_round_stats_count_acceptance_by_depth():
    from schemas import FlatTree, VerifyReply
    from specsplit.orchestrator.state import RoundStats

    stats = RoundStats()
    tree = FlatTree(token_ids=[1, 2, 3, 4, 5], parents=[-1, 0, 0, 1, 3])  # depths 0 1 1 2 3
    stats.add(tree, VerifyReply(session_id="s", round=0, accepted_token_ids=[2, 4], accepted_nodes=[1, 3],
                                bonus_token_id=7, cache_len=9))
    stats.add(tree, VerifyReply(session_id="s", round=1, accepted_token_ids=[], accepted_nodes=[],
                                bonus_token_id=7, cache_len=9))
    assert stats.drafted_per_depth == [4, 2, 2] and stats.accepted_per_depth == [1, 1]
    assert stats.acceptance_by_depth() == [0.25, 0.5, 0.0]


def test_a_session_started_under_load_decodes_plainly_from_round_0(models):
    """Where plain decoding pays (a cost model that measured a draft worker busy 550 ms per 7-token
    round and verify at 100 + 13 ms per token, three other sessions under way), a new session's
    first round is plain too: no DraftRequest, so the draft worker does not prefill a prompt for
    nothing. The output is still the target's greedy decoding."""
    from schemas import DraftRequest
    from tests.test_costmodel_load import _speculated

    target, often, _ = models["qwen2"]
    cost = _speculated((100.0, 13.0), draft_busy_ms=550.0, tokens=7, rate=0.0046)
    cost.active_sessions = 3  # this session makes four
    d_rpc, t_rpc = EngineRpc(DraftEngine(often, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    prompt, n, out = [3, 14, 15, 92, 65, 35], 12, []
    req = GenerateRequest(session_id="s", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC)
    done = asyncio.run(SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=SPEC), out.append, cost).run())
    assert done.token_ids == greedy_reference(target, prompt, n)[0]
    drafted = [m.round for m in d_rpc.requests if isinstance(m, DraftRequest)]
    assert 0 not in drafted, drafted


def test_plain_rounds_under_load_still_verify_prompt_lookup_nodes(models):
    """Under load plain decoding calls no draft, yet a prompt that repeats itself still gets prompt
    lookup's free candidates verified (a lone forward here: the cost model keeps at least one),
    and the output is still the target's greedy decoding."""
    from schemas import DraftRequest, VerifyRequest
    from tests.test_costmodel_load import _speculated

    target, often, _ = models["qwen2"]
    cost = _speculated((100.0, 13.0), draft_busy_ms=550.0, tokens=7, rate=0.0046)
    cost.active_sessions = 3  # this session makes four: plain decoding pays
    d_rpc, t_rpc = EngineRpc(DraftEngine(often, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    prompt, n, out = [3, 14, 15, 92, 65, 35] * 3, 12, []
    req = GenerateRequest(session_id="s", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC)
    policy = ActorPolicy(tree=SPEC, lookup_max_tokens=8)
    done = asyncio.run(SessionActor(req, d_rpc, t_rpc, policy, out.append, cost).run())
    assert done.token_ids == greedy_reference(target, prompt, n)[0]
    assert not [m for m in d_rpc.requests if isinstance(m, DraftRequest)]
    trees = [m.tree for m in t_rpc.requests if isinstance(m, VerifyRequest)]
    assert trees[0].token_ids == [35, 3, 14, 15, 92, 65, 35, 3, 14][:trees[0].num_nodes] and trees[0].num_nodes > 1
    assert done.drafted_tokens == sum(t.num_nodes - 1 for t in trees)


@pytest.mark.parametrize("budget", ["cost", "fixed"])
def test_lookup_only_never_calls_the_draft_and_still_equals_greedy(models, budget):
    """SPECSPLIT_SPECULATOR=lookup: no draft worker at all (no draft, grow or end-session call);
    greedy rounds verify the root plus prompt lookup's candidates (all of them with a fixed budget,
    those that pay with the cost model) and the output is the target's greedy decoding; a sampled
    session decodes plainly, one target-sampled token per round, the same for the same seed."""
    from schemas import SamplingSpec, VerifyRequest
    from specsplit.orchestrator.costmodel import CostModel

    target, often, _ = models["qwen2"]
    prompt, n = [3, 14, 15, 92, 65, 35] * 3, 12

    def run(sampling):
        d_rpc, t_rpc = EngineRpc(DraftEngine(often, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
        out = []
        req = GenerateRequest(session_id="s", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC, sampling=sampling)
        policy = ActorPolicy(tree=SPEC, lookup_max_tokens=8, lookup_only=True, grow=True)
        cost = CostModel() if budget == "cost" else None
        done = asyncio.run(SessionActor(req, d_rpc, t_rpc, policy, out.append, cost).run())
        assert d_rpc.requests == []
        return done, [m.tree for m in t_rpc.requests if isinstance(m, VerifyRequest)]

    done, trees = run(SamplingSpec())
    assert done.finish_reason == "length" and done.token_ids == greedy_reference(target, prompt, n)[0]
    assert trees[0].token_ids == [35, 3, 14, 15, 92, 65, 35, 3, 14][:trees[0].num_nodes] and trees[0].num_nodes > 1
    if budget == "fixed":
        assert trees[0].num_nodes == 5  # the whole chain, within SPEC's depth 4
    sampled = SamplingSpec(temperature=0.8, top_p=0.95, seed=11)
    done, trees = run(sampled)
    assert len(done.token_ids) == n and done.rounds == n and all(t.num_nodes == 1 for t in trees)
    assert run(sampled)[0].token_ids == done.token_ids


@pytest.mark.parametrize("overlap", [False, True])
def test_sessions_starting_together_leave_the_first_drafted_round_to_one_of_them(models, overlap):
    """A fresh cost model under load: the first session drafts its first rounds (measuring
    speculation), the one starting beside it decodes plainly until a drafted round is measured,
    instead of both queueing their prompts on the draft worker; every session leaves the
    ``speculating`` count as it found it, and both outputs are the target's greedy decoding.
    With the first round's overlap the first session's round-0 draft goes beside its verify,
    and counts as drafting all the same."""
    from schemas import DraftRequest
    from specsplit.orchestrator.costmodel import CostModel

    target, often, _ = models["qwen2"]
    cost = CostModel()
    d_rpc, t_rpc = EngineRpc(DraftEngine(often, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    prompts, n, out = {"a": [3, 14, 15, 92, 65, 35], "b": [2, 71, 82, 81, 82, 84, 59]}, 10, []

    async def both():
        actors = [SessionActor(GenerateRequest(session_id=sid, prompt_token_ids=p, max_new_tokens=n, tree=SPEC),
                               d_rpc, t_rpc, ActorPolicy(tree=SPEC, overlap_prefill=overlap), out.append, cost)
                  for sid, p in prompts.items()]
        return await asyncio.gather(*(a.run() for a in actors))

    done = asyncio.run(both())
    for d in done:
        assert d.token_ids == greedy_reference(target, prompts[d.session_id], n)[0]
    first = {}
    for m in d_rpc.requests:
        if isinstance(m, DraftRequest):
            first.setdefault(m.session_id, m.round)
    assert first.get("a") == 0, first  # the first session drafts from round 0
    assert first.get("b", n) >= 1, first  # the second did not draft at round 0 beside it
    assert cost.speculating == 0 and cost.active_sessions == 0


class PrefillClock(EngineRpc):
    """An engine stand-in whose requests take 0.5 s plus 0.01 s per token their sync appends (as a
    long prompt's prefill takes minutes on a CPU): past its timeout a request times out (no
    sleeping: the time is its model)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.timeouts: list[float] = []

    async def call(self, msg, *, session_id: str, timeout_s: float | None = None):
        from specsplit.transport.rpc import RpcTimeout

        self.timeouts.append(timeout_s)
        sync = getattr(msg, "sync", None)
        if timeout_s is not None and 0.5 + 0.01 * (len(sync.append_token_ids) if sync else 0) > timeout_s:
            self.requests.append(msg)
            raise RpcTimeout(session_id, b"\x00", timeout_s)
        return await super().call(msg, session_id=session_id, timeout_s=timeout_s)


@pytest.mark.parametrize("per_token", [0.05, 0.0])
def test_a_long_prompts_prefill_gets_time_by_its_tokens(models, per_token):
    """A worker request's timeout grows by SPECSPLIT_RPC_TIMEOUT_PER_TOKEN_S per token its sync
    appends: a prompt whose prefill outlasts SPECSPLIT_RPC_TIMEOUT_S is served once, not timed
    out and resent; without the allowance it never is."""
    target, draft, _ = models["qwen2"]
    prompt, n = [3 + i % 90 for i in range(120)], 12  # 119 tokens to prefill: 1.69 s of modelled work
    d_rpc, t_rpc = PrefillClock(DraftEngine(draft, LIMITS)), PrefillClock(TargetEngine(target, LIMITS))
    out = []
    req = GenerateRequest(session_id="s", prompt_token_ids=prompt, max_new_tokens=n, tree=SPEC)
    policy = ActorPolicy(tree=SPEC, rpc_timeout_s=1.0, rpc_timeout_per_token_s=per_token, max_attempts=3,
                         backoff_s=0.001)
    actor = SessionActor(req, d_rpc, t_rpc, policy, out.append)
    done = asyncio.run(actor.run())
    if not per_token:
        assert done.finish_reason == "error" and out[0].message == "gave up after 3 attempts: timeout"
        drafts = [t for m, t in zip(d_rpc.requests, d_rpc.timeouts) if type(m).__name__ == "DraftRequest"]
        assert drafts == [1.0] * 3
        return
    assert done.token_ids == greedy_reference(target, prompt, n)[0]
    assert d_rpc.timeouts[0] == pytest.approx(1.0 + 0.05 * (len(prompt) - 1))  # the draft's prefill first
    assert len(t_rpc.requests) == len(t_rpc.replies)  # every verify answered at its first send
