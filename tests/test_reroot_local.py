"""The orchestrator re-roots a grown tree itself (GrowReply ``tree``, ``specsplit.tree.reroot_grown``):
the tree it sends the target is the one the draft's next DraftReply holds, node for node, so a
re-rooted round waits for no draft round trip and changes nothing else; where it cannot (no tree,
a path that leaves it, a malformed one, a DraftRequest beside the verify that fails) the round
asks the draft as before, and the output is the target's greedy decoding throughout."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
from pydantic import ValidationError

from schemas import (
    CacheSync,
    DraftReply,
    DraftRequest,
    ErrorReply,
    FlatTree,
    GenerateDone,
    GenerateRequest,
    GrownTree,
    GrowReply,
    GrowRequest,
    TreeSpec,
    VerifyRequest,
)
from schemas.codec import decode, encode, kind_of
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.errors import TreeError
from specsplit.metrics import OrchestratorMetrics
from specsplit.orchestrator.actor import ActorPolicy, SessionActor
from specsplit.tree import path_to, reroot_grown
from tests.conftest import greedy_reference, tiny_model
from tests.test_actor import LIMITS as ACTOR_LIMITS
from tests.test_actor import SPEC as ACTOR_SPEC
from tests.test_grow import LIMITS


def _new_tokens(g, rng: random.Random) -> tuple[list[int], str]:
    """Committed tokens past the kept tree's root, as a verdict gives them: mostly the path to an
    expanded node (re-rootable), else to an unexpanded node, or off the tree after a path."""
    expanded = [i for i in range(1, len(g.tokens)) if g.slot[i] >= 0]
    unexpanded = [i for i in range(1, len(g.tokens)) if g.slot[i] < 0]
    r = rng.random()
    if r < 0.6 and expanded:
        node, kind = rng.choice(expanded), "expanded"
    elif r < 0.8 and unexpanded:
        node, kind = rng.choice(unexpanded), "unexpanded"
    else:
        node, kind = rng.choice(expanded or [0]), "off"
    new = [g.tokens[i] for i in path_to(node, g.parents)[1:]]
    if kind == "off" or not new:
        taken = {g.tokens[c] for c in g.kids[node]}
        new.append(next(t for t in range(128) if t not in taken))
    return new, kind


def against_the_draft(eng, rounds: int, seed: int = 5) -> dict[str, int]:
    """Rounds of growth on ``eng`` (a greedy draft, ``steps_after_reuse`` 0; some rounds told a
    lookup chain: hinted nodes), each followed by a verdict the draft re-roots at or not and a
    budget within or past the draft's limits: ``reroot_grown`` of the GrowReply's tree (through
    the codec) must be exactly the next DraftReply's tree and reuse, and None exactly where the
    draft drafts from scratch. Returns how often each happened."""
    rng = random.Random(seed)
    committed = [rng.randrange(128) for _ in range(9)]
    spec = TreeSpec(max_nodes=8, max_depth=4, branch=2)
    eng.handle(DraftRequest(session_id="g", round=0, sync=CacheSync(base_len=0, append_token_ids=committed[:-1]),
                            root=committed[-1], tree=spec))
    held, seen = len(committed), {"local": 0, "scratch": 0, "hinted": 0}
    for rnd in range(rounds):
        g = eng.store.get("g").draft_tree
        hint, probs = None, []
        if rnd % 3 == 1:  # a lookup chain the draft's tree lacks, hung under the root
            first = next(t for t in range(128) if t not in {g.tokens[c] for c in g.kids[0]})
            chain = [first, *(rng.randrange(128) for _ in range(3))]
            hint = FlatTree(token_ids=[g.tokens[0], *chain], parents=[-1, *range(len(chain))])
            probs = [1.0, 0.9, 0.8, 0.7, 0.6]
        grown = eng.handle(GrowRequest(session_id="g", round=rnd, budget_ms=60_000.0, width=3, tree=hint,
                                       node_probs=probs, return_tree=True))
        assert isinstance(grown, GrowReply) and grown.tree is not None, grown
        wire = decode(kind_of(grown), encode(grown))
        assert wire == grown and wire.tree.prefix_len == held
        g = eng.store.get("g").draft_tree
        seen["hinted"] += bool(g.hinted)
        new, kind = _new_tokens(g, rng)
        spec = TreeSpec(max_nodes=rng.choice([3, 8, 12, 32]), max_depth=rng.choice([1, 3, 4, 8]), branch=2)
        local = reroot_grown(wire.tree, new, spec)
        committed += new
        reply = eng.handle(DraftRequest(session_id="g", round=rnd + 1, root=committed[-1], tree=spec,
                                        sync=CacheSync(base_len=held, append_token_ids=committed[held:-1])))
        assert isinstance(reply, DraftReply), reply
        if local is None:
            assert reply.reused_nodes == 0, (rnd, kind)
            seen["scratch"] += 1
        else:
            assert (reply.tree, reply.reused_nodes) == local, (rnd, kind)
            seen["local"] += 1
        held = len(committed)
    return seen


@pytest.mark.parametrize("family,spares", [("qwen2", 0), ("llama", 2), ("qwen3", 2)])
def test_the_orchestrator_re_roots_a_grown_tree_as_the_draft_does(family, spares):
    seen = against_the_draft(DraftEngine(tiny_model(family, seed=41), LIMITS, steps_after_reuse=0,
                                         grow_spares=spares), rounds=16)
    assert seen["local"] >= 6 and seen["scratch"] >= 2 and seen["hinted"] >= 3, seen


def test_a_grown_tree_comes_back_only_where_the_next_reply_is_that_tree():
    """No tree unless asked for, for another round, an unknown session, or a draft that forwards
    after re-rooting (``steps_after_reuse`` other than 0: its reply would hold more)."""
    model = tiny_model("qwen2", seed=3)
    spec = TreeSpec(max_nodes=8, max_depth=4, branch=2)
    for steps, ask, rnd, sid, want in [(0, True, 0, "s", True), (0, False, 0, "s", False), (0, True, 1, "s", False),
                                       (0, True, 0, "other", False), (None, True, 0, "s", False),
                                       (1, True, 0, "s", False)]:
        eng = DraftEngine(model, LIMITS, steps_after_reuse=steps)
        eng.handle(DraftRequest(session_id="s", round=0, sync=CacheSync(base_len=0, append_token_ids=[1, 2, 3]),
                                root=4, tree=spec))
        r = eng.handle(GrowRequest(session_id=sid, round=rnd, budget_ms=60_000.0, return_tree=ask))
        assert isinstance(r, GrowReply) and (r.tree is not None) == want, (steps, ask, rnd, sid)
        if want:
            g = eng.store.get("s").draft_tree
            assert r.tree.token_ids == g.tokens and r.tree.expanded == [s >= 0 for s in g.slot]
            assert (r.tree.max_nodes, r.tree.max_depth) == (LIMITS.max_tree_nodes, LIMITS.max_tree_depth)


def test_a_malformed_grown_tree_is_refused():
    ok = dict(prefix_len=4, token_ids=[4, 5, 6], parents=[-1, 0, 1], draft_logprobs=[0.0, -0.1, -0.2],
              expanded=[True, True, False], hinted=[False, False, False], max_nodes=8, max_depth=4)
    spec = TreeSpec(max_nodes=8, max_depth=4, branch=2)
    assert reroot_grown(GrownTree(**ok), [5], spec)[0].token_ids == [5, 6]
    assert reroot_grown(GrownTree(**ok), [6], spec) is None  # leaves the tree
    assert reroot_grown(GrownTree(**ok), [5, 6], spec) is None  # ends at an unforwarded node
    for bad in [{"parents": [-1, 2, 0]}, {"parents": [-1, 0, 7]}, {"parents": [0, 0, 1]}]:
        with pytest.raises(TreeError):
            reroot_grown(GrownTree(**{**ok, **bad}), [5], spec)
    # a child that outranks its parent (log-probs are never above 0): no tree that drops the parent
    chain = dict(ok, token_ids=[4, 5, 6, 7], parents=[-1, 0, 1, 2], draft_logprobs=[0.0, -0.1, -5.0, 10.0],
                 expanded=[True, True, False, False], hinted=[False] * 4)
    with pytest.raises(TreeError):
        reroot_grown(GrownTree(**chain), [5], TreeSpec(max_nodes=2, max_depth=4, branch=2))
    for bad in [{"expanded": [True]}, {"hinted": [False] * 4}, {"draft_logprobs": [0.0, 1]}, {"max_nodes": 0},
                {"prefix_len": 0}, {"token_ids": [4, 5, -6]}]:
        with pytest.raises(ValidationError):
            GrownTree(**{**ok, **bad})


class LoggedRpc:
    """Hands each request to an engine in this process, logging (seq, request, reply) on a log
    shared with the session's other client (which went first across the two workers). The
    reply takes ``reply_s`` more: the draft's growth, which runs meanwhile, answers first, as it
    does when a verify takes longer than a round trip."""

    def __init__(self, engine, log: list, seq, fail=None, reply_s: float = 0.0) -> None:
        self.engine, self.log, self.seq, self.fail, self.reply_s = engine, log, seq, fail, reply_s

    async def call(self, msg, *, session_id: str, timeout_s: float | None = None):
        n = next(self.seq)
        await asyncio.sleep(0)  # yield like a socket would, so concurrent calls interleave
        if self.fail is not None:
            self.fail(self.engine, msg)
        reply = self.engine.handle(msg)
        self.log.append((n, msg, reply))
        await asyncio.sleep(self.reply_s)
        return reply


def run_session(draft, target, prompt, n, fail=None, **policy):
    log, seq = [], itertools.count()
    d_eng = DraftEngine(draft, ACTOR_LIMITS, steps_after_reuse=0)
    d_rpc = LoggedRpc(d_eng, log, seq, fail)
    t_rpc = LoggedRpc(TargetEngine(target, ACTOR_LIMITS), log, seq, reply_s=0.02)
    out: list = []
    req = GenerateRequest(session_id="s", prompt_token_ids=prompt, max_new_tokens=n, tree=ACTOR_SPEC)
    # growth of several forwards a verify (as on a GPU, or a CPU where the draft is much smaller)
    metrics = OrchestratorMetrics()
    actor = SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=ACTOR_SPEC, grow=True, grow_fraction=20.0, **policy),
                         out.append, metrics=metrics)
    done = asyncio.run(actor.run())
    assert isinstance(out[-1], GenerateDone)
    assert all(getattr(p, "_grow_task", None) is None and getattr(p, "_behind", None) is None
               for p in actor.proposers)  # nothing left behind
    log.sort(key=lambda e: e[0])
    verifies = {m.round: (i, m) for i, m, _ in log if isinstance(m, VerifyRequest)}
    drafts = {m.round: (i, r) for i, m, r in log if isinstance(m, DraftRequest)}
    local = [rnd for rnd, (i, _) in drafts.items() if rnd in verifies and verifies[rnd][0] < i]
    # the metric counts those rounds as re-rooted here, and the draft's re-rootings of the others
    by_draft = sum(1 for rnd, (_, r) in drafts.items() if rnd not in local and getattr(r, "reused_nodes", 0) > 0)
    count = metrics.registry.get_sample_value
    assert (count("specsplit:rounds_rerooted_total", {"where": "orchestrator"}) or 0) == len(local)
    assert (count("specsplit:rounds_rerooted_total", {"where": "draft"}) or 0) == by_draft
    return done, log, verifies, drafts, local


@pytest.mark.parametrize("which", ["often", "rarely"])
def test_re_rooted_rounds_send_the_draft_s_own_tree_without_waiting_for_it(models, which):
    """Through the actor: rounds whose verify went out before their DraftRequest (re-rooted here)
    verify exactly the tree the draft's reply holds, the GrowRequests ask for the tree, and the
    output is the target's greedy decoding; with ``grow_reroot`` off every DraftRequest goes first."""
    target, often, rarely = models["qwen2"]
    draft = often if which == "often" else rarely
    prompt, n = [3, 14, 15, 92, 65, 35], 40
    want = greedy_reference(target, prompt, n)[0]
    done, log, verifies, drafts, local = run_session(draft, target, prompt, n)
    assert done.token_ids == want
    assert all(m.return_tree for _, m, _ in log if isinstance(m, GrowRequest))
    for rnd in local:
        reply = drafts[rnd][1]
        assert isinstance(reply, DraftReply) and reply.reused_nodes > 0
        assert verifies[rnd][1].tree == reply.tree, rnd
    off_done, off_log, _, _, off_local = run_session(draft, target, prompt, n, grow_reroot=False)
    assert off_done.token_ids == want and not off_local
    assert not any(m.return_tree for _, m, _ in off_log if isinstance(m, GrowRequest))
    if which == "often":  # a draft that agrees re-roots most rounds (one that does not: its bonus leaves the tree)
        assert len(local) >= done.rounds // 2, (local, done.rounds)


def test_a_failed_draft_request_beside_the_verify_resends_the_context(models):
    """The draft worker loses the session just before re-rooting DraftRequests sent beside a
    verify (a restart: CACHE_MISS): the next round finds the worker's state unknown, drafts
    through the worker with the whole context, and the output is still greedy decoding."""
    target, often, _ = models["qwen2"]
    prompt, n = [3, 14, 15, 92, 65, 35], 40
    dropped: list[int] = []

    def fail(eng, msg):
        if isinstance(msg, DraftRequest) and msg.sync.base_len > 0 and msg.round % 4 == 2:
            session = eng.store.get("s")
            if session is not None:
                eng.store.drop(session)
                dropped.append(msg.round)

    done, log, _, drafts, local = run_session(often, target, prompt, n, fail=fail)
    assert done.token_ids == greedy_reference(target, prompt, n)[0]
    missed = [rnd for rnd, (_, r) in drafts.items() if isinstance(r, ErrorReply)]
    assert missed and set(missed) <= set(local), (missed, local)  # the ones sent beside a verify
    for rnd in missed:  # the next DraftRequest carries the whole context
        nxt = min(r for r in drafts if r > rnd)
        assert next(m for _, m, _ in log if isinstance(m, DraftRequest) and m.round == nxt).sync.base_len == 0
