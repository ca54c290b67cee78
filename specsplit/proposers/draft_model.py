"""The draft model as a proposer: a DraftRequest to the draft workers (through the session's
recovering RPC call), which answer with a tree of the round's budget; while the target verifies
it, the worker may grow that tree (a GrowRequest) so the next round starts from it. The only
tree proposer, and the only proposer a sampled session uses.

Re-rooting without a round trip (``grow_reroot``): the GrowReply carries the grown tree, so when
it is back before the verdict the next round re-roots it here (``specsplit.tree.reroot_grown``,
the draft's own rule) and its tree goes to the target at once; the DraftRequest that re-roots the
worker's copy goes beside it, its reply only checked at the next round. A round then waits for
one worker, not two in turn: where forwards take a few milliseconds (GPUs), the draft's round
trip was a large part of a round (docs/results.md, `ops/fleet_cpu.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from schemas import DraftReply, DraftRequest, GrowReply, GrowRequest, SamplingSpec
from specsplit.errors import SpecError
from specsplit.orchestrator.hints import growth_hint
from specsplit.proposers.base import Budget, Proposal, Proposer, Verdict, register
from specsplit.tree import reroot_grown

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
        self._grow_task: asyncio.Future | None = None  # the GrowRequest in flight (or answered)
        self._behind: asyncio.Future | None = None  # a DraftRequest sent beside a verify (``_reroot``)
        self._behind_timeout_s = 0.0  # ... and how long it may take

    async def propose(self, committed: Sequence[int], budget: Budget, sampling: SamplingSpec, rnd: int) -> Proposal:
        s = self.session
        await self._settle()
        grown, self._grow_task = self._grow_task, None
        local = self._reroot(grown, committed, budget, sampling, rnd)
        if local is not None:
            return local
        if grown is not None and not grown.done():
            grown.cancel()  # the DraftRequest below stops the growth (it yields to waiting requests)

        def build():
            return DraftRequest(session_id=s.sid, round=rnd, sync=self._sync(sampling), root=s.cur.committed[-1],
                                tree=budget.spec, sampling=sampling, grammar=self._grammar())

        reply: DraftReply = await s.call(s.draft_rpc, build, self._reset)
        s.cur.after_draft()
        return Proposal(tree=reply.tree, draft_ms=reply.draft_ms, reused=reply.reused_nodes)

    def _grammar(self):
        """The session's grammar for the draft to mask its proposals with (SPECSPLIT_DRAFT_GRAMMAR),
        or None."""
        return self.session.req.grammar if self.shared.policy.draft_grammar else None

    def _sync(self, sampling: SamplingSpec):
        """The draft's sync, naming the prompt where the draft counts the output (penalties, a
        grammar it masks with)."""
        return self.session.cur.draft_sync(sampling.penalized or self._grammar() is not None)

    def _reroot(self, grown: asyncio.Future | None, committed: Sequence[int], budget: Budget,
                sampling: SamplingSpec, rnd: int) -> Proposal | None:
        """The grown tree re-rooted here when its GrowReply is back with the tree, the worker
        holds the tree's prefix of ``committed`` and the committed tokens past it are a path of it
        to an expanded node; the DraftRequest re-rooting the worker's copy is sent beside the
        verify. None: ask the worker (a DraftRequest on the round's critical path)."""
        s = self.session
        if not (self.shared.policy.grow_reroot and sampling.greedy and grown is not None and grown.done()
                and not grown.cancelled() and grown.exception() is None):
            return None
        reply = grown.result()
        tree = reply.tree if isinstance(reply, GrowReply) else None
        if tree is None or s.cur.draft_len != tree.prefix_len or len(committed) <= tree.prefix_len:
            return None
        try:
            local = reroot_grown(tree, list(committed[tree.prefix_len:]), budget.spec)
        except SpecError as exc:  # a malformed tree: the worker drafts as usual
            s.log.warning("grown_tree_refused", error=str(exc))
            return None
        if local is None:
            return None
        self._send_beside(committed, budget, sampling, rnd)
        return Proposal(tree=local[0], draft_ms=0.0, reused=local[1], rerooted_here=True)

    def ahead(self, committed: Sequence[int], budget: Budget, sampling: SamplingSpec, rnd: int) -> None:
        """The first round verifies the prompt's root alone (``SPECSPLIT_OVERLAP_PREFILL``): the
        draft forwards the prompt and drafts its tree meanwhile, so the next round's request
        re-roots that tree instead of waiting for the prompt."""
        self._send_beside(committed, budget, sampling, rnd)

    def _send_beside(self, committed: Sequence[int], budget: Budget, sampling: SamplingSpec, rnd: int) -> None:
        """A DraftRequest off the round's critical path (beside a verify): the next ``propose``
        settles it first (``_settle``: answered, or the next request resends the whole context)."""
        s = self.session
        req = DraftRequest(session_id=s.sid, round=rnd, sync=self._sync(sampling), root=committed[-1],
                           tree=budget.spec, sampling=sampling, grammar=self._grammar())
        s.cur.after_draft()  # the worker holds committed once it answers (``_settle`` checks it did)
        self._behind_timeout_s = self.shared.policy.timeout_for(req)
        self._behind = asyncio.ensure_future(s.draft_rpc.call(req, session_id=s.sid, timeout_s=self._behind_timeout_s))
        self._behind.add_done_callback(_swallow)

    async def _settle(self) -> None:
        """The DraftRequest sent beside the last verify: answered (it normally is, long since),
        or its worker's state is unknown and the next request resends the whole context."""
        task, self._behind = self._behind, None
        if task is None:
            return
        if not task.done():
            await asyncio.wait({task}, timeout=self._behind_timeout_s)
        ok = (task.done() and not task.cancelled() and task.exception() is None
              and isinstance(task.result(), DraftReply))
        if not ok:
            if not task.done():
                why = "timeout"
            elif task.cancelled():
                why = "cancelled"
            else:
                why = repr(task.exception() or task.result())[:200]
            task.cancel()
            self._reset()
            self.session.log.info("draft_behind_failed", reason=why)

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
                          node_probs=probs, return_tree=p.grow_reroot)
        if self._grow_task is not None:  # an earlier round's grow has answered or is moot
            self._grow_task.cancel()
        task = asyncio.ensure_future(s.draft_rpc.call(req, session_id=s.sid, timeout_s=p.rpc_timeout_s))
        task.add_done_callback(_swallow)
        self._grow_task = task  # a reference, so it is neither collected nor left behind
        return budget

    def learn(self, verdict: Verdict) -> None:
        self._last_verify_ms = verdict.verify_ms

    def close(self) -> None:
        for task in (self._grow_task, self._behind):
            if task is not None and not task.done():
                task.cancel()
        self._grow_task = self._behind = None
