"""The draft model as a proposer: a DraftRequest to the draft workers (through the session's
recovering RPC call), which answer with a tree of the round's budget; while the target verifies
it, the worker may grow that tree (a fire-and-forget GrowRequest) so the next round starts from
it. The only tree proposer, and the only proposer a sampled session uses."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from schemas import DraftReply, DraftRequest, GrowRequest, SamplingSpec
from specsplit.orchestrator.hints import growth_hint
from specsplit.proposers.base import Budget, Proposal, Proposer, Verdict, register

GROW_BUDGET_CAP_MS = 60_000.0  # a growth budget never exceeds a minute, however slow the last verify


def _swallow(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a lost grow reply is harmless


@register
class DraftModel(Proposer):
    name = "draft"
    kind = "tree"
    model_cost = True

    def __init__(self, session, shared) -> None:
        super().__init__(session, shared)
        self._last_verify_ms = 0.0
        self._grow_task: asyncio.Future | None = None  # the GrowRequest in flight

    async def propose(self, committed: Sequence[int], budget: Budget, sampling: SamplingSpec, rnd: int) -> Proposal:
        s = self.session

        def build():
            return DraftRequest(session_id=s.sid, round=rnd, sync=s.cur.draft_sync(), root=s.cur.committed[-1],
                                tree=budget.spec, sampling=sampling)

        reply: DraftReply = await s.call(s.draft_rpc, build, self._reset)
        s.cur.after_draft()
        return Proposal(tree=reply.tree, draft_ms=reply.draft_ms, reused=reply.reused_nodes)

    def verifying(self, cands, rnd: int, sampling: SamplingSpec, cost) -> float:
        """Grow this round's tree while the target verifies it, told the other proposers' nodes
        (``SPECSPLIT_GROW_CHAINS``)."""
        if cands.drafted is None:
            return 0.0
        return self._grow(rnd, sampling, cands, cost)

    def _reset(self) -> None:
        self.session.cur.draft_len = 0  # the worker's state is unknown: resend the whole context

    def _grow(self, rnd: int, sampling: SamplingSpec, cands, cost) -> float:
        """Let the draft worker grow this round's tree while the target verifies it (fire and
        forget: the next DraftRequest queues behind it on the same worker; failures only cost
        the head start), told the tree verified when other proposers added nodes
        (``growth_hint``). Needs a previous verify time to size the budget; returns the budget."""
        p, s = self.shared.policy, self.session
        if not (p.grow and sampling.greedy and self._last_verify_ms > 0):
            return 0.0
        hint, probs = growth_hint(cands, cost) if p.grow_chains else (None, [])
        budget = min(GROW_BUDGET_CAP_MS, p.grow_fraction * self._last_verify_ms)
        req = GrowRequest(session_id=s.sid, round=rnd, budget_ms=budget, width=p.grow_width, tree=hint,
                          node_probs=probs)
        self.close()  # the previous round's grow has answered or is moot
        task = asyncio.ensure_future(s.draft_rpc.call(req, session_id=s.sid, timeout_s=p.rpc_timeout_s))
        task.add_done_callback(_swallow)
        self._grow_task = task  # a reference, so it is neither collected nor left behind
        return budget

    def learn(self, verdict: Verdict) -> None:
        self._last_verify_ms = verdict.verify_ms

    def close(self) -> None:
        if self._grow_task is not None and not self._grow_task.done():
            self._grow_task.cancel()
        self._grow_task = None
