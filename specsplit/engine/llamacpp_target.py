"""The llama.cpp target (``specsplit.engine.llamacpp`` tells how the engines use the unified
cache): a tree verified in one decode with a scratch sequence per leaf, and the rounds of several
sessions verified in one decode (``verify_batch``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schemas import ErrorCode
from specsplit.engine.base import EngineLimits
from specsplit.engine.llamacpp_kv import LlamaKV, _cache_miss, _LlamaEngineMixin
from specsplit.engine.llamacpp_model import LlamaCppModel, LlamaOutOfCells
from specsplit.engine.target import TargetEngine
from specsplit.engine.target_batch import verify_alone, verify_batch
from specsplit.engine.store import Session
from specsplit.engine.verify import Outcome, PromptRows, Verdict
from specsplit.errors import SpecError
from specsplit.tree import TreeLayout


def _leaf_sets(layout: TreeLayout) -> tuple[list[int], list[list[int]]]:
    """(leaves, below): the tree's leaves, and for every node the indices (into ``leaves``) of the
    leaves in its subtree, the first one on its first child's side."""
    n = layout.num_nodes
    leaves = [i for i in range(n) if not layout.children[i]]
    index = {leaf: k for k, leaf in enumerate(leaves)}
    below: list[list[int]] = [[] for _ in range(n)]
    for i in range(n - 1, -1, -1):
        if i in index:
            below[i] = [index[i]]
        else:
            below[i] = [k for c in layout.children[i] for k in below[c]]
    return leaves, below



class LlamaTargetEngine(_LlamaEngineMixin, TargetEngine):
    """TargetEngine's requests and verification rules on a llama.cpp context (full verification;
    SpecPV views are a torch-engine feature: a request's ``specpv`` is verified fully here)."""

    role = "target"
    trash = -1  # set to the last sequence id by _setup

    def __init__(self, lm: LlamaCppModel, limits: EngineLimits = EngineLimits(), *, vocab_size: int | None = None,
                 backend=None):
        from specsplit.logs import get_logger

        self._setup(lm, limits, vocab_size, backend)
        self._view_attention = None
        self.log = get_logger("specsplit.target")

    @staticmethod
    def committed_len(session) -> int:
        return session.kv.prefix

    def batched_forward_supported(self) -> bool:
        return True  # sessions share a decode through their own sequences (verify_members)

    def verify_batch(self, requests) -> list:
        """Replies in order; the sessions that allow it share one decode (``target_batch``'s
        rules, ``verify_members``). Under the context's lock, as ``handle``."""
        with self.lm.lock:
            try:
                return verify_batch(self, requests)
            finally:
                self._clear_if_idle()

    def verify_members(self, members, replies: list, t0: float) -> None:
        """Several sessions' syncs and trees in one llama_decode: each token carries its own
        session's sequences, so it sees only its session's prefix and tree ancestors (the unified
        cache's visibility rule), exactly what its request alone would decode. Members are grouped
        into decodes of at most ``n_batch`` tokens; a member that fits no group, or finds no free
        sequences for its tree, is verified alone after the groups."""
        groups: list[list] = [[]]
        used, later = 0, []
        for m in members:
            size = len(m.req.sync.append_token_ids) + m.layout.num_nodes
            if size > self.lm.n_batch:
                later.append(m)
                continue
            if used + size > self.lm.n_batch:
                groups.append([])
                used = 0
            groups[-1].append(m)
            used += size
        for group in groups:
            group = [m for m in group if not self._gone(m, replies)]
            if len(group) == 1:
                verify_alone(self, group[0], replies, t0)
            elif group:
                later += self._verify_group(group, replies, t0)
        for m in later:
            if not self._gone(m, replies):
                verify_alone(self, m, replies, t0)

    @staticmethod
    def _gone(m, replies: list) -> bool:
        """A member whose session was dropped meanwhile (a collection, or evicted by a later
        member's new session: its sequence may already serve another) is answered CACHE_MISS."""
        if not m.session.kv.closed:
            return False
        replies[m.index] = _cache_miss().to_reply(m.req.session_id, m.req.round)
        return True

    def _verify_group(self, group, replies: list, t0: float) -> list:
        """One decode for ``group``'s rounds; returns the members left to verify alone."""
        planned, later = [], []
        for m in group:
            try:
                planned.append((m, self.guarded(m.session, lambda m=m: self._plan(m.session.kv, m.req, m.layout))))
            except SpecError as exc:
                if exc.code is ErrorCode.OVERLOADED:  # no free sequences now: alone, after this decode
                    later.append(m)
                else:
                    replies[m.index] = exc.to_reply(m.req.session_id, m.req.round)
        tokens, pos, seqs, outputs = [], [], [], []
        for _, plan in planned:
            outputs += [len(tokens) + i for i in plan.outputs]
            tokens += plan.tokens
            pos += plan.positions
            seqs += plan.seqs
        if not planned:
            return later
        try:
            logits = self.lm.decode(tokens, pos, seqs, outputs)
        except LlamaOutOfCells:
            self._collect()  # every session dropped: each member resends its context
            for m, _ in planned:
                replies[m.index] = _cache_miss().to_reply(m.req.session_id, m.req.round)
            return later
        except Exception as exc:  # nothing was decoded (llama_decode restores the cache on failure)
            self.log.warning("batch_forward_failed", sessions=len(planned), error=f"{type(exc).__name__}: {exc}"[:500],
                             action="verify each alone")
            for m, plan in planned:
                self._release(m.session.kv, plan)
                m.session.kv.crop_to(m.req.sync.base_len)
            return later + [m for m, _ in planned]
        row = 0
        for m, plan in planned:
            lg = torch.from_numpy(logits[row:row + plan.layout.num_nodes])
            row += plan.layout.num_nodes

            def settle(m=m, plan=plan, lg=lg) -> Outcome:
                try:
                    verdict = self._settle(m.session.kv, m.req, plan, lg, m.session)
                finally:
                    self._release(m.session.kv, plan)
                m.session.last_round = m.req.round
                return Outcome(verdict, forward_tokens=len(plan.tokens))

            try:
                out = self.guarded(m.session, settle)
                replies[m.index] = self.reply_for(m.req, out, self.committed_len(m.session), t0,
                                                  batch_tokens=len(tokens), batch_size=len(planned))
            except SpecError as exc:
                replies[m.index] = exc.to_reply(m.req.session_id, m.req.round)
        return later

    def _round(self, session: Session, req, layout: TreeLayout) -> Outcome:
        kv: LlamaKV = session.kv
        lin = req.sync.append_token_ids
        # the prompt's log-probabilities: every sync token's row is kept (VerifyRequest checks the
        # sync is from an empty cache and names the prompt)
        scored = PromptRows(req.prompt_logprobs, [*lin[1:], req.tree.token_ids[0]], req.sync.prompt_len - 1) \
            if req.prompt_logprobs is not None else None
        plan = self._plan(kv, req, layout, scored)
        try:
            logits = torch.from_numpy(self._retry_out_of_cells(
                kv, lambda: self.lm.decode(plan.tokens, plan.positions, plan.seqs, plan.outputs)))  # [lead + N, V]
            if scored is not None:
                scored.take(logits[:plan.lead])
            verdict = self._settle(kv, req, plan, logits[plan.lead:], session)
        finally:
            self._release(kv, plan)
        return Outcome(verdict, forward_tokens=len(lin) + layout.num_nodes,
                       prompt_logprobs=scored.result() if scored is not None else None)

    def _plan(self, kv: LlamaKV, req, layout: TreeLayout, scored: PromptRows | None = None) -> "_Planned":
        """Before the round's decode: the cache cropped to the sync's base, a sync too long for
        one decode with the tree committed ahead in chunks, and a scratch sequence (a copy of the
        main one) per leaf of the tree; the decode's tokens, positions and sequences. ``scored``:
        every sync token's logits are read too (the chunks' go to it now)."""
        kv.crop_to(req.sync.base_len)
        lin = list(req.sync.append_token_ids)
        n = layout.num_nodes
        leaves, below = _leaf_sets(layout)
        room = self.lm.n_batch - n
        if len(lin) > room:  # a long sync (a prompt): committed first, in chunks
            head, lin = lin[:len(lin) - room], lin[len(lin) - room:]
            self.forward_linear(kv, head, on_rows=scored.take if scored is not None else None)
        scratch = self._take_seqs(kv, len(leaves))
        for s in scratch:
            self.lm.seq_cp(kv.seq, s)
        start = kv.prefix + len(lin)  # the root's position
        return _Planned(
            lin=lin, layout=layout, scratch=scratch, below=below, start=start,
            tokens=[*lin, *req.tree.token_ids],
            positions=[*range(kv.prefix, start), *(start + d for d in layout.depths)],
            seqs=[[kv.seq, *scratch]] * len(lin) + [[scratch[k] for k in below[i]] for i in range(n)],
            lead=len(lin) if scored is not None else 0)

    def _settle(self, kv: LlamaKV, req, plan: "_Planned", logits: torch.Tensor, session: Session) -> Verdict:
        """After the decode (the sync's tokens are committed): the verdict from the tree's logits
        [N, V], and the accepted path's cells handed to the main sequence."""
        kv.prefix = kv.length = plan.start
        verdict: Verdict = self.decide(req, plan.layout, logits, session=session)
        path_seq = plan.scratch[plan.below[verdict.path[-1]][0]]
        self.lm.seq_cp(path_seq, kv.seq, plan.start, plan.start + len(verdict.path))  # root + accepted nodes
        kv.prefix = kv.length = plan.start + len(verdict.path)
        return verdict

    def _release(self, kv: LlamaKV, plan: "_Planned") -> None:
        if not kv.closed:  # (a collection cleared everything)
            for s in plan.scratch:
                kv.drop(s)
                self.pool.give(s)
        plan.scratch = []


@dataclass(slots=True)
class _Planned:
    """One round's decode inputs on a llama target (``LlamaTargetEngine._plan``)."""

    lin: list[int]  # sync tokens in the decode (committed to the main sequence by it)
    layout: TreeLayout
    scratch: list[int]  # a sequence per leaf
    below: list[list[int]]  # per node: the leaves (indices into scratch) under it
    start: int  # the root's position
    tokens: list[int]
    positions: list[int]
    seqs: list[list[int]]
    lead: int = 0  # sync tokens whose logits are read too, before the tree's (the prompt's rows)

    @property
    def outputs(self) -> list[int]:
        """The tree nodes' indices in the decode's tokens (their logits are read), after the
        first ``lead`` sync tokens'."""
        return [*range(self.lead), *range(len(self.lin), len(self.tokens))]
