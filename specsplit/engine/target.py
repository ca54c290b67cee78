"""Target engine: apply the sync, ONE forward over the whole tree, verify, compact the cache.

With a ``SpecPVSpec`` (VerifyRequest.specpv) the session also keeps a partial view
(``specsplit.engine.specpv``): past the spec's threshold a round is verified against the view
instead of the whole prefix, and the accepted tokens go to the view's buffer; a *full* round
re-encodes the buffered tokens against the whole cache in the same forward as the tree (exact
mode: and re-checks them, rolling back to the first one the target disagrees with).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from schemas import ErrorCode, Message, VerifyReply, VerifyRequest
from specsplit.engine import penalties
from specsplit.engine.base import Engine, is_device_failure
from specsplit.engine.masks import TreeInputs, positions, tree_visibility
from specsplit.engine.sampling import argmax_rows, make_generator
from specsplit.engine.specpv import PartialView, attention_name, plan_view, view_attention_of
from specsplit.engine.store import Session
from specsplit.engine.target_batch import fused, verify_batch
from specsplit.engine.verify import (
    Outcome, PromptRows, Verdict, greedy_verdict, logprobs_of, verify_greedy, verify_sampling,
)
from specsplit.errors import SpecError
from specsplit.models.int8 import prompt_attention_name
from specsplit.tree import TreeLayout, validate_tree


class TargetEngine(Engine):
    role = "target"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._view_attention: str | None | bool = False  # False: not looked up yet
        self._prompt_attention: str | None | bool = False  # False: not looked up yet
        self.grammars = None  # a GrammarBook (set by the worker: it has the tokenizer); None: no grammars

    def _dispatch(self, msg: Message) -> Message:
        if isinstance(msg, VerifyRequest):
            return self.verify(msg)
        return super()._dispatch(msg)

    @staticmethod
    def committed_len(session) -> int:
        pv = session.specpv
        return session.kv.length + (len(pv.pending) if pv is not None else 0)

    def verify(self, req: VerifyRequest) -> VerifyReply:
        t0 = time.perf_counter()
        layout, session = self.admit(req)
        with session.lock:
            self.check_locked(session, req.round, req.sync)
            out = self.run_locked(session, req, layout)
            cache_len = self.committed_len(session)
        return self.reply_for(req, out, cache_len, t0)

    def admit(self, req: VerifyRequest) -> tuple[TreeLayout, Session]:
        """The checks that need no session lock (tree, token range, capacity); finds or creates
        the session. Raises SpecError; nothing has moved then."""
        layout = validate_tree(
            req.tree,
            vocab_size=self.vocab_size,
            max_nodes=self.limits.max_tree_nodes,
            max_depth=self.limits.max_tree_depth,
        )
        sync = req.sync
        total = sync.base_len + len(sync.append_token_ids) + 1  # len(committed)
        if req.confirmed_len is not None and req.confirmed_len > total:
            raise SpecError(ErrorCode.BAD_REQUEST, f"confirmed_len {req.confirmed_len} exceeds the {total} "
                                                   "committed tokens")
        bias = req.sampling.logit_bias or ()
        if any(b.token_id >= self.vocab_size for b in bias):
            raise SpecError(ErrorCode.BAD_REQUEST, f"a logit_bias token is outside the vocabulary [0, {self.vocab_size})")
        if any(t >= self.vocab_size for t in req.sampling.masked_token_ids or ()):
            raise SpecError(ErrorCode.BAD_REQUEST, f"a masked token is outside the vocabulary [0, {self.vocab_size})")
        if req.grammar is not None and self.grammars is None:
            raise SpecError(ErrorCode.BAD_REQUEST, "this target takes no grammars (it has no tokenizer for them)")
        if req.sampling.infill and not req.sampling.greedy and self.infill_vocab is None:
            raise SpecError(ErrorCode.BAD_REQUEST, "this target takes no infill sampler (it has no tokenizer for it)")
        return layout, self.open_session(req.session_id, req.round, sync, layout.num_nodes)

    def run_locked(self, session: Session, req: VerifyRequest, layout: TreeLayout) -> Outcome:
        """One round under the session's lock (checks passed); drops the session on an
        unexpected failure (``guarded``)."""

        def run() -> Outcome:
            out = self._round(session, self.with_prefix(session, req), layout)
            out = dataclasses.replace(out, cached=session.reused) if session.reused else out
            session.last_round = req.round
            if req.sync.base_len == 0:  # a context forwarded: kept at once (Engine.keep_prefix)
                self.keep_prefix(session, held=True)
            return out

        return self.guarded(session, run)

    def reply_for(self, req: VerifyRequest, out: Outcome, cache_len: int, t0: float, *,
                  batch_tokens: int | None = None, batch_size: int = 1,
                  verify_ms: float | None = None) -> VerifyReply:
        """The reply; ``batch_tokens`` / ``batch_size`` describe the forward that served it (by
        default this round's own: its forwarded tokens, one session); ``verify_ms`` measured
        already (a batch's), else since ``t0`` once the device is done."""
        accepted = out.verdict.path[1:]
        if batch_tokens is None:
            batch_tokens = out.forward_tokens or len(req.sync.append_token_ids) + req.tree.num_nodes
        return VerifyReply(
            session_id=req.session_id,
            round=req.round,
            accepted_token_ids=[req.tree.token_ids[i] for i in accepted],
            accepted_nodes=accepted,
            bonus_token_id=out.verdict.bonus,
            cache_len=cache_len,
            verify_ms=self.elapsed_ms(t0) if verify_ms is None else verify_ms,
            partial=out.partial,
            rollback_len=out.rollback_len,
            confirmed_len=out.confirmed_len,
            batch_tokens=batch_tokens,
            batch_size=batch_size,
            cached_tokens=out.cached,
            forced_token_ids=list(out.verdict.forced) or None,
            logprobs=out.verdict.logprobs,
            prompt_logprobs=out.prompt_logprobs,
        )

    def with_prefix(self, session: Session, req: VerifyRequest) -> VerifyRequest:
        """``take_prefix`` for this request (its root is the tree's): the request itself, or one
        whose sync keeps the cached prefix copied into the session's cache. A request for the
        prompt's log-probabilities forwards the whole prompt: they are its rows."""
        sync = self.take_prefix(session, req.sync, req.tree.token_ids[0], reuse=req.prompt_logprobs is None)
        return req if sync is req.sync else req.model_copy(update={"sync": sync})

    def reusable(self, sync, prompt_path: int, n: int) -> int:
        """How much of an ``n``-token cached prefix (its first ``prompt_path`` positions prefilled
        on the prompt attention) a new session may reuse: positions its own prefill would compute
        the same way. A prompt this target prefills on the prompt attention (from position 0, in
        ``linear_chunk`` chunks: ``_prompt_tokens``) reuses whole chunks of such positions; any
        other, only positions computed on the decoding path (a cache with no prompt-path
        positions). Without a prompt attention every position is computed one way: all of it."""
        if not self._prompt_attn():
            return n
        chunk = self.linear_chunk
        if sync.prompt_len - 1 > chunk and len(sync.append_token_ids) > chunk:  # as _full and _prompt_tokens decide
            return min(n, prompt_path) // chunk * chunk
        return n if prompt_path == 0 else 0

    # ---- several sessions in one forward ---------------------------------------------------
    def verify_batch(self, requests: Sequence[Message]) -> list[Message]:
        """Replies to ``requests`` in order, verifying the trees of the sessions that allow it in
        ONE forward; see ``specsplit.engine.target_batch``."""
        return verify_batch(self, requests)

    def verify_members(self, members, replies: list, t0: float) -> None:
        """Verify ``target_batch``'s members (2+, sessions locked, checks passed) in one forward
        and set each one's reply; an engine whose forward differs overrides this."""
        fused(self, members, replies, t0)

    # ---- one round ---------------------------------------------------------------------
    def _round(self, session, req: VerifyRequest, layout: TreeLayout) -> Outcome:
        pv: PartialView | None = session.specpv
        if pv is None and req.specpv is not None:
            pv = session.specpv = PartialView(req.specpv, len(session.kv.layers), self.limits.max_tree_nodes,
                                              self.limits.max_session_tokens)
        if pv is None:
            session.kv.crop_to(req.sync.base_len)
            return self._full(session, None, req, layout)
        pv.crop(session.kv, req.sync.base_len)
        if self._partial_ok(session, pv, req, layout):
            try:
                return self._partial(session, pv, req, layout)
            except SpecError:
                raise
            except Exception as exc:
                if is_device_failure(exc):
                    raise
                self._fall_back(session, pv, f"{type(exc).__name__}: {exc}")
        out = self._full(session, pv, req, layout)
        if req.specpv != pv.spec:  # turned off, or another spec: the next round starts afresh
            session.specpv = None if req.specpv is None else PartialView(
                req.specpv, len(session.kv.layers), self.limits.max_tree_nodes, self.limits.max_session_tokens)
        return out

    def _partial_ok(self, session, pv: PartialView, req: VerifyRequest, layout: TreeLayout) -> bool:
        spec, kv = pv.spec, session.kv
        if (req.confirm or req.specpv != spec or req.sync.append_token_ids
                or (spec.exact and not req.sampling.greedy)  # exact re-checks are greedy ones
                or pv.logical_len(kv.length) <= spec.threshold
                or pv.rounds_since_full >= min(spec.refresh_every, pv.interval)
                or len(pv.pending) + layout.num_nodes > spec.buffer_tokens):
            return False
        if pv.cooldown:  # exact mode: the view disagreed even after one partial round
            pv.cooldown -= 1
            return False
        if self._view_attention is False:
            # a partial view's slots are not positions, which sliding windows' masks need
            self._view_attention = attention_name(self.model) if self.windows is None else None
            if self._view_attention is None:
                self.log.warning("specpv_unsupported", attention=self.model.config._attn_implementation,
                                 sliding_window=self.windows.window if self.windows else None,
                                 action="full verification")
        if self._view_attention is None:
            return False
        broken = pv.check(kv)
        if broken:
            self._fall_back(session, pv, broken)
            return False
        return True

    def _fall_back(self, session, pv: PartialView, reason: str) -> None:
        """An invariant failed: log once per session; this round is verified fully, which
        re-encodes the buffered ids and rebuilds the view."""
        if not pv.fallbacks:
            self.log.warning("specpv_fallback", session_id=session.session_id, reason=reason[:500],
                             action="full verification")
        pv.fallbacks += 1

    def _partial(self, session: Session, pv: PartialView, req: VerifyRequest, layout: TreeLayout) -> Outcome:
        """Verify the tree against the partial view; buffer the accepted path's K/V."""
        kv = session.kv
        dev, n, m = self.device, layout.num_nodes, len(pv.pending)
        start = kv.length + m  # the root's position
        pv.summaries.extend(kv)
        plan = plan_view(pv.spec, kv, pv.summaries)
        visible = torch.ones(n, m + n, dtype=torch.bool, device=dev)  # [N, B+N]
        visible[:, m:] = tree_visibility(layout.parents, dev)
        pos = positions(layout.depths, start, dev)  # [N]
        with view_attention_of(self.model, self._view_attention):
            logits = self.forward(pv.buffer, req.tree.token_ids, pos, visible, keep=n, specpv_view=plan)  # [N, V]
        verdict = self.decide(req, layout, logits, session=session)
        pv.buffer.compact([m + i for i in verdict.path], m)
        pv.pending.extend(req.tree.token_ids[i] for i in verdict.path)
        self.note_accepted(session, req, verdict)
        pv.rounds_since_full += 1
        # exact: what the full cache holds and the root after it were confirmed; the rest is provisional
        return Outcome(verdict, partial=True, confirmed_len=kv.length + 1 if pv.spec.exact else None,
                       forward_tokens=n)

    def _full(self, session: Session, pv: PartialView | None, req: VerifyRequest, layout: TreeLayout) -> Outcome:
        """One forward of [buffered ids + sync tokens + tree] against the whole cache. Exact
        mode (``req.confirmed_len``, greedy): the provisional tokens among them are re-checked
        first; at the first the target disagrees with, the round rolls back to it."""
        kv = session.kv
        n, f = layout.num_nodes, kv.length
        # this request's cache came from the prefix cache: its prompt goes on from there as from 0
        origin = session.prompt_path if session.reused and f == session.reused else 0
        pending = list(pv.pending) if pv is not None else []
        refreshed = 0
        if pending and not pv.spec.exact and req.confirmed_len is None and self._prompt_attn():
            # approximate mode promises no equality with full verification: the buffered tokens'
            # re-encoding against the whole cache (the refresh) runs as a prefill, on the prompt
            # attention; the tree stays on the decoding path
            self.forward_linear(kv, pending, attention=self._prompt_attention)
            del session.tokens[f:]  # positions no prefill computes this way: no prefix cache keeps them
            refreshed, pending, f = len(pending), [], kv.length
        lin = [*pending, *req.sync.append_token_ids]
        s, root = len(lin), req.tree.token_ids[0]
        start = f + s  # the root's position
        confirmed = req.confirmed_len
        if confirmed is None and pv is not None and pv.spec.exact and pv.pending:
            confirmed = f + 1  # a client that keeps no count: what this worker buffered is provisional
        check_from = s  # lin rows whose successor (in lin + [root]) is provisional
        if confirmed is not None and req.sampling.greedy:
            check_from = min(s, max(confirmed, f + 1) - 1 - f)
        head = check_from if s + origin > self.linear_chunk else 0
        # the prompt's log-probabilities: the same forwards keep every linear row (from an empty
        # cache: a sync from 0 without prefix reuse or buffered tokens; VerifyRequest checks the rest)
        scored = None
        if req.prompt_logprobs is not None:
            if f or pending:
                raise SpecError(ErrorCode.INTERNAL, "the prompt's rows were not all forwarded by this request")
            scored = PromptRows(req.prompt_logprobs, [*lin[1:], root], req.sync.prompt_len - 1)
        on_rows = scored.take if scored is not None else None
        if head:
            prompt = self._prompt_tokens(f, req.sync, pv, head, origin)
            if prompt:
                self.forward_linear(kv, lin[:prompt], attention=self._prompt_attention, on_rows=on_rows)
                session.prompt_path = kv.length
            if head > prompt:
                self.forward_linear(kv, lin[prompt:head], on_rows=on_rows)
        t = s - head
        tree = TreeInputs(f + head, t, layout.parents, layout.depths)  # built on the device only if eager
        checked = s - check_from
        lead = t if scored is not None else checked  # linear rows kept before the tree's
        logits = self.forward(kv, [*lin[head:], *req.tree.token_ids], None, None, keep=n + lead, tree=tree)
        if scored is not None:
            scored.take(logits[:lead])
        logits = logits[lead - checked:]  # [C+N, V]: the checked rows, then the tree's
        if checked:
            wrong = self._first_disagreement(logits[:checked], [*lin, root][check_from + 1:])
            if wrong is not None:
                j, token = wrong
                cut = f + check_from + j + 1  # committed keeps its first `cut` tokens, then `token`
                kv.crop_to(cut)
                del session.tokens[cut:]
                if pv is not None:
                    pv.summaries.crop(cut)
                    pv.after_refresh(rolled_back=True)
                    pv.reset_buffer()
                return Outcome(Verdict([0], token), rollback_len=cut, confirmed_len=cut + 1,
                               forward_tokens=refreshed + s + n)
        verdict = self.decide(req, layout, logits[checked:], session=session)
        kv.compact([start + i for i in verdict.path], start)
        self.note_accepted(session, req, verdict)
        if pv is not None:
            pv.after_refresh(rolled_back=False)
            pv.reset_buffer()  # the view is rebuilt from the refreshed cache
        exact = req.confirmed_len is not None or (pv is not None and pv.spec.exact)
        return Outcome(verdict, confirmed_len=kv.length + 1 if exact else None, forward_tokens=refreshed + s + n,
                       prompt_logprobs=scored.result() if scored is not None else None)

    @staticmethod
    def note_accepted(session: Session, req: VerifyRequest, verdict: Verdict) -> None:
        """The session's tokens (``Session.tokens``) gain the path accepted after the root."""
        root_at = req.sync.base_len + len(req.sync.append_token_ids)
        if len(session.tokens) == root_at + 1:
            session.tokens.extend(req.tree.token_ids[i] for i in verdict.path[1:])

    def _prompt_attn(self) -> str | None:
        """The model's prompt attention (``prompt_attention_name``), looked up once."""
        if self._prompt_attention is False:
            self._prompt_attention = prompt_attention_name(self.model)
        return self._prompt_attention

    def _prompt_tokens(self, f: int, sync, pv: PartialView | None, head: int, origin: int = 0) -> int:
        """How many of the first ``head`` tokens forwarded linearly are a long prompt's, prefilled
        on the model's prompt attention (``prompt_attention_name``): only from an empty cache (or
        from ``origin``, the whole chunks of it a prefix cache gave) and only for a prompt longer
        than one chunk (one prefilled with its first tree otherwise), so its chunks are the same
        in its first prefill and in any resend. Tokens from its last on (the first round's root,
        then the generation) take the decoding path."""
        n = sync.prompt_len - 1
        if not self._prompt_attn() or f != origin or (pv is not None and pv.pending) or n <= self.linear_chunk:
            return 0
        return min(n - origin, head)

    @staticmethod
    def _first_disagreement(logits: torch.Tensor, expected: list[int]) -> tuple[int, int] | None:
        """logits [C, V] of the rows before C provisional tokens ``expected``: (row, the target's
        token) of the first row whose argmax differs, or None. One host copy."""
        argmax = argmax_rows(logits)  # [C]
        wrong = argmax != torch.tensor(expected, dtype=torch.long, device=logits.device)  # [C]
        first = wrong.to(torch.int8).argmax()  # first True (0 when none)
        j, token, any_wrong = torch.stack([first, argmax[first], wrong.any().long()]).tolist()
        return (j, token) if any_wrong else None

    def decide(self, req: VerifyRequest, layout: TreeLayout, logits: torch.Tensor,
               argmax: list[int] | None = None, *, session: Session | None = None) -> Verdict:
        """The verdict on the tree from its logits [N, V] (greedy: or from its rows' ``argmax``,
        computed for several sessions at once). With a grammar, from the logits it allows
        (``grammar.GrammarBook.constrain``), and the session's matcher takes the accepted path;
        with a logit bias, penalties and masked tokens, from the logits they make
        (``engine.penalties``).
        With ``logprobs`` asked, the committed tokens' log-probabilities (``verify.logprobs_of``)."""
        scores = logits
        if req.sampling.logit_bias:  # (``argmax`` was of the raw rows, as below)
            scores, argmax = penalties.biased(req.sampling.logit_bias, logits), None
        if req.sampling.penalized:  # (``argmax`` was of the unpenalized rows)
            scores, argmax = penalties.penalize(session, req, layout, scores), None
        if req.sampling.masked_token_ids:
            scores, argmax = penalties.masked(req.sampling.masked_token_ids, scores), None
        if req.grammar is not None:
            masked = self.grammars.constrain(session, req, layout, scores)
            verdict = self._decide(req, layout, masked, None)
            self.grammars.accepted(session, req, verdict.path)
            verdict = dataclasses.replace(verdict, forced=self.grammars.forced_after(session, verdict.bonus))
        else:
            verdict = self._decide(req, layout, scores, argmax)
        if req.sampling.penalized:
            penalties.accepted(session, req, verdict.path)
        if req.logprobs is not None:  # of the raw logits, as vLLM's: before the grammar's mask
            verdict = dataclasses.replace(verdict, logprobs=logprobs_of(req.tree, logits, verdict, req.logprobs))
        return verdict

    def _decide(self, req: VerifyRequest, layout: TreeLayout, logits: torch.Tensor, argmax: list[int] | None) -> Verdict:
        if req.sampling.greedy:
            return verify_greedy(req.tree, layout, logits) if argmax is None else \
                greedy_verdict(req.tree, layout, argmax)
        g = make_generator(req.sampling.seed, req.round, "target", self.device)
        infill = self.infill_vocab() if req.sampling.infill else None  # (checked: a target with its tables)
        return verify_sampling(req.tree, layout, logits, req.sampling, g, infill)
