"""One round as a pipeline: plan -> propose -> (verify) -> commit -> learn (torch-free).

``SessionActor`` runs these in a loop around its verify call; each stage is a function of the
session's state with a test of its own (tests/test_rounds.py):
- ``plan``: which proposers this round asks (none: a root-only round confirming provisional
  tokens; model-free ones only: a plain round, when there is no tree proposer or the cost model
  finds plain decoding delivers more under the load), the tree budget, the sync it carries;
- ``propose``: ask them, merge their proposals into one tree (``merge``), keep the nodes that pay
  (``select``, the cost model's choice);
- ``commit``: apply the verdict to the session's cursor and stream, count it;
- ``learn``: feed the cost model and the proposers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from schemas import FlatTree, SamplingSpec, TreeSpec, VerifyReply
from specsplit.orchestrator.costmodel import SMALL_SYNC, CostModel, expanded_nodes
from specsplit.orchestrator.state import (
    Candidates, RoundCount, RoundStats, SessionCursor, asks, merge, remaining_tree, root_only, select,
)
from specsplit.proposers.base import Budget, Proposal, Proposer, Verdict


@dataclass(frozen=True)
class RoundPlan:
    rnd: int
    confirm: bool  # exact SpecPV: only confirm provisional tokens (a root-only tree)
    spec: TreeSpec  # the round's tree budget (the cost model's min_path_prob included)
    sync_tokens: int  # committed tokens the verify request carries besides the tree
    plain: bool  # no model-cost proposer this round (priced as a plain round)
    proposers: tuple[Proposer, ...]  # asked this round, in order
    context_len: int = 0  # committed tokens when the round started (its root the last)
    # model proposers that start on the context beside this round's verify instead of in it
    # (the first round's overlap: ``overlap``)
    ahead: tuple[Proposer, ...] = ()


def plan(rnd: int, cur: SessionCursor, out: list[int], *, prompt_len: int, max_new_tokens: int, stop: set[int],
         tree: TreeSpec, sampling: SamplingSpec, exact: bool, proposers: Sequence[Proposer],
         cost: CostModel | None, overlap: bool = False, overlap_max_tokens: int = 0) -> RoundPlan:
    """``overlap``: round 0, which would wait for the draft to forward the prompt and then for the
    target to, verifies its root (and free chains) at once instead, the model proposers sent the
    prompt beside it (``RoundPlan.ahead``): the first token comes after the target's prefill
    alone, and the next round re-roots the tree the draft drew meanwhile. Only when the target
    has at most ``overlap_max_tokens`` to forward (0: any number)."""
    confirm = exact and cur.must_confirm(out, prompt_len, max_new_tokens, stop)
    spec = remaining_tree(tree, max_new_tokens - cur.produced(prompt_len))
    greedy = sampling.greedy
    if cost is not None and greedy:
        spec = cost.draft_spec(spec)  # how deep drafting pays this round
    sync_tokens = len(cur.target_sync().append_token_ids)
    plain = (not any(p.model_cost for p in proposers)
             or spec.max_depth == 0  # the tree holds its root only (the last token wanted): no draft call
             or (cost is not None and greedy and cost.plain_pays()))
    if confirm:
        asked: tuple[Proposer, ...] = ()
    elif not greedy:  # a sampled tree is drawn by the tree proposer alone; plain: the root only
        asked = () if plain else tuple(p for p in proposers if p.kind == "tree")
    else:  # plain (from round 0 on, so a new session under load skips the draft's prefill): no model call
        asked = tuple(p for p in proposers if not (plain and p.model_cost))
    ahead: tuple[Proposer, ...] = ()
    if overlap and rnd == 0 and not plain and not confirm and (overlap_max_tokens <= 0
                                                              or sync_tokens <= overlap_max_tokens):
        ahead, asked, plain = tuple(p for p in asked if p.model_cost), tuple(p for p in asked if not p.model_cost), True
    return RoundPlan(rnd, confirm, spec, sync_tokens, plain, asked, len(cur.committed), ahead)


async def propose(rp: RoundPlan, committed: Sequence[int], sampling: SamplingSpec, *, chain_tokens: int,
                  cost: CostModel | None) -> Candidates:
    """Ask the round's proposers (the tree proposer first), merge and select. Sampled rounds keep
    the drawn tree as it is (dropping drawn children by value would bias the output); a round
    without proposers (confirming) verifies its root alone. Its caller tells the proposers what
    goes to the target (``verifying``) once the verify request is sent."""
    for p in rp.ahead:
        p.ahead(committed, Budget(rp.spec, 0), sampling, rp.rnd)
    base, drafted = root_only(committed[-1]), None
    for p in rp.proposers:
        if p.kind == "tree":
            drafted = await p.propose(committed, Budget(rp.spec, 0), sampling, rp.rnd)
            base = drafted.tree
    if not sampling.greedy or rp.confirm:
        return Candidates(base, {}, None, drafted, base)
    chains: list[tuple[str, Proposal]] = []
    if chain_tokens > 0 and rp.spec.max_depth >= 1:
        budget = Budget(rp.spec, min(chain_tokens, rp.spec.max_depth))
        for p in rp.proposers:
            if asks(p, chains):
                prop = await p.propose(committed, budget, sampling, rp.rnd)
                if prop is not None and prop.chain:
                    chains.append((p.name, prop))
    tree, sources = merge(base, chains, rp.spec, chain_tokens)
    return select(tree, sources, cost, sync_tokens=rp.sync_tokens, plain=rp.plain, drafted=drafted)


def verifying(rp: RoundPlan, cands: Candidates, sampling: SamplingSpec, cost: CostModel | None) -> Candidates:
    """Tell the round's proposers what goes to the target (the draft grows its tree meanwhile);
    the growth budget asked for joins the draft's proposal. Called once the verify request is
    sent (``SessionActor``): the growth's request and its hint are no part of the round's wait."""
    grow_ms = sum(p.verifying(cands, rp.rnd, sampling, cost) for p in rp.proposers)
    if grow_ms and cands.drafted is not None:
        cands = replace(cands, drafted=replace(cands.drafted, grow_ms=grow_ms))
    return cands


@dataclass(frozen=True)
class Committed:
    new: list[int]  # tokens the verdict committed (accepted + bonus)
    count: RoundCount
    done: bool  # the generation is finished
    stream: list[int] | None  # tokens to stream now (None: nothing to send this round)


def commit(cur: SessionCursor, out: list[int], stats: RoundStats, tree: FlatTree, reply: VerifyReply, *,
           prompt_len: int, max_new_tokens: int, stop: set[int], exact: bool) -> Committed:
    """Apply the verdict: the cursor's committed tokens, the stream ``out`` (confirmed tokens
    only, up to the budget or a stop id), the session's counts. Without exact SpecPV every round
    streams (an empty chunk too: producers see each round)."""
    n_before = len(out)
    new = cur.apply_verify(reply)
    count = stats.add(tree, reply, cur.rolled_back)
    done = cur.take_confirmed(out, prompt_len, max_new_tokens, stop)
    stream = out[n_before:] if len(out) > n_before or not exact else None
    return Committed(new, count, done, stream)


@dataclass
class Timing:
    draft_ms: float = 0.0
    grow_ms: float = 0.0  # the growth budget this round asked the draft worker for
    verify_ms: float = 0.0
    wall_ms: float = 0.0
    # the wall's parts on the orchestrator's clock: the propose stage (the draft's round trip,
    # lookups, merging, selecting) and the verify's round trip; the rest is planning and committing
    propose_ms: float = 0.0
    verify_rpc_ms: float = 0.0


def learn(cost: CostModel | None, proposers: Sequence[Proposer], rp: RoundPlan, cands: Candidates,
          reply: VerifyReply, new: Sequence[int], timing: Timing, *, clean: bool) -> tuple[float, float]:
    """Feed the cost model (shared by the orchestrator's sessions) and every proposer of the
    session; returns what the round adds to the session's prediction (tokens, ms). ``clean``:
    a first send, not a prefill, not a partial round, not round 0 (a cost sample). A round the
    model does not model (the prompt's prefill, a resend) enters the prediction with its
    measured time and tokens, so ``predicted_tok_s`` is end to end like the measured rate it is
    compared with. A plain round teaches the forward's cost, the chains' acceptance and what
    plain rounds deliver, never the speculative rate (``observe_plain``)."""
    verdict = Verdict(cands.tree, cands.sources, reply.accepted_nodes, list(new), reply.verify_ms,
                      reply.forced_token_ids or ())
    for p in proposers:
        p.learn(verdict)
    if cost is None:
        return 0.0, 0.0
    tree, drafted, forward_tokens = cands.tree, cands.drafted, rp.sync_tokens + cands.tree.num_nodes
    if cands.choice is None:  # a confirmation (root-only) or a sampled round: its forward still prices tokens
        if clean:
            cost.observe_forward(forward_tokens, reply.verify_ms, reply.batch_tokens, reply.batch_size)
        return 0.0, 0.0
    if clean and drafted is not None:
        cost.observe_speculation(len(new), timing.draft_ms + timing.grow_ms, draft_ms=timing.draft_ms,
                                 nodes=tree.num_nodes)
    predicted = ((cands.choice.expected_tokens, cands.choice.expected_ms) if clean
                 else (float(len(new)), timing.wall_ms))
    cost.observe_round(tree, reply.accepted_nodes, sources=cands.sources)
    if clean:
        cost.observe_forward(forward_tokens, reply.verify_ms, reply.batch_tokens, reply.batch_size)
        if drafted is None:  # a plain round: the root and chain nodes, no model call
            cost.observe_plain(len(new), timing.wall_ms - reply.verify_ms)
            return predicted
        cost.observe_overhead(max(0.0, timing.wall_ms - reply.verify_ms))
        cost.observe_rate(len(new), timing.wall_ms)
        if drafted.reused == 0:
            cost.observe_draft(expanded_nodes(drafted.tree), timing.draft_ms)
    return predicted


def is_clean(rnd: int, attempts: int, sync_tokens: int, reply: VerifyReply) -> bool:
    """A round whose times are a cost sample: a first send, not the prompt's prefill (round 0 or a
    large sync), not a SpecPV partial round."""
    return rnd > 0 and attempts == 1 and sync_tokens <= SMALL_SYNC and not reply.partial
