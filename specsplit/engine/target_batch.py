"""The target verifies the trees of several sessions in one forward (continuous batching at round
granularity: the worker hands over the requests queued when a forward starts).

Each session keeps its own cache, cache length, positions and tree mask; the forward is the
flattened token batch of ``specsplit.engine.batch``. Per request, exactly what ``verify`` does
alone: the same validation before any cache moves (errors stay per request: one bad request
fails nobody else), the same CACHE_MISS / STALE_ROUND rules under the session's lock, the same
verification rule with the same per-(seed, round) generator, the same compaction. Verified alone
(after the batch, in request order) instead: SpecPV sessions (a partial view, or exact-mode
re-checks), a sync longer than one linear chunk (a prompt), and a session's second request in the
same batch. If the batched forward fails for a reason other than the device, every member's cache
is cropped back and each member is verified alone, so one request cannot fail the others.
Every member's reply reports the shared forward (``batch_tokens``: all members' new tokens,
``batch_size``: the members), which is what its ``verify_ms`` measured.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from schemas import CacheSync, ErrorCode, Message, VerifyRequest
from specsplit.engine.base import LINEAR_CHUNK, is_device_failure
from specsplit.engine.batch import Segment, admitted_and_locked, select_fused
from specsplit.engine.kvpool import PooledKV
from specsplit.engine.masks import TreeInputs
from specsplit.engine.store import Session
from specsplit.engine.verify import Outcome
from specsplit.errors import DeviceFailure, SpecError
from specsplit.tree import TreeLayout


def batchable(req: Message) -> bool:
    """Whether a request may share a forward (its session's state is checked once locked)."""
    return (isinstance(req, VerifyRequest) and req.specpv is None and req.confirmed_len is None
            and req.prompt_logprobs is None and len(req.sync.append_token_ids) <= LINEAR_CHUNK)


@dataclass(slots=True)
class _Member:
    index: int  # position in the request list
    req: VerifyRequest
    layout: TreeLayout
    session: Session  # locked while a member
    segment: Segment | None = None
    sync: CacheSync | None = None  # the sync to apply: the request's, or one after a copied prefix


def verify_batch(engine, requests: Sequence[Message]) -> list[Message]:
    """Replies to ``requests`` (any messages the engine serves), in order. ``engine`` is a
    TargetEngine. Raises DeviceFailure only, as ``handle`` does."""
    t0 = time.perf_counter()
    fused = select_fused(requests, batchable)
    if len(fused) < 2 or not engine.batched_forward_supported():
        return [engine.handle(req) for req in requests]
    replies: list[Message | None] = [None] * len(requests)
    later = sorted(set(range(len(requests))) - set(fused))
    members = _lock_members(engine, requests, fused, replies, later)
    try:
        if len(members) == 1:
            verify_alone(engine, members[0], replies, t0)
        elif members:
            engine.verify_members(members, replies, t0)
    finally:
        for m in members:
            m.session.lock.release()
    for i in sorted(later):
        replies[i] = engine.handle(requests[i])
    return replies


def _lock_members(engine, requests, indices: list[int], replies: list, later: list[int]) -> list[_Member]:
    """Admit and lock each candidate; a refusal becomes its reply, a SpecPV session goes ``later``."""
    members = []
    for i, req, (layout, session) in admitted_and_locked(engine, requests, indices, replies):
        if session.specpv is not None:  # its partial view must follow the request: verified alone
            session.lock.release()
            later.append(i)
            continue
        members.append(_Member(i, req, layout, session))
    return members


def verify_alone(engine, m: _Member, replies: list, t0: float) -> None:
    """One member verified by itself (its session stays locked); a refusal becomes its reply."""
    try:
        out = engine.run_locked(m.session, m.req, m.layout)
        replies[m.index] = engine.reply_for(m.req, out, engine.committed_len(m.session), t0)
    except SpecError as exc:
        replies[m.index] = exc.to_reply(m.req.session_id, m.req.round)


def fused(engine, members: list[_Member], replies: list, t0: float) -> None:
    """The torch engines' ``verify_members``: the members' segments in one ``forward_segments``."""
    members = _with_prefixes(engine, members, replies)
    if len(members) < 2:  # (alone, its request copies the prefix again: the same one)
        for m in members:
            verify_alone(engine, m, replies, t0)
        return
    for m in members:
        sync, kv = m.sync, m.session.kv
        kv.crop_to(sync.base_len)
        tree = TreeInputs(sync.base_len, len(sync.append_token_ids), m.layout.parents, m.layout.depths)
        m.segment = Segment(kv, [*sync.append_token_ids, *m.req.tree.token_ids], None, None, m.layout.num_nodes, tree)
    try:
        logits = engine.forward_segments([m.segment for m in members])  # per member [N_i, V]
    except Exception as exc:
        if is_device_failure(exc):
            for m in members:
                engine.store.drop(m.session)
            raise DeviceFailure(f"{engine.role} on {engine.device}: {type(exc).__name__}: {exc}") from exc
        engine.log.warning("batch_forward_failed", sessions=len(members), error=f"{type(exc).__name__}: {exc}"[:500],
                           action="verify each alone")
        for m in members:  # what the forward appended is dropped: each starts from its request's base again
            m.session.kv.crop_to(m.req.sync.base_len)
            verify_alone(engine, m, replies, t0)
        return
    tokens = sum(len(m.segment.token_ids) for m in members)  # the shared forward's, every member's reply says
    argmax = greedy_argmax(members, logits)
    done = []
    for m, lg, am in zip(members, logits, argmax):
        try:
            done.append((m, engine.guarded(m.session, lambda m=m, lg=lg, am=am: _finish(engine, m, lg, am))))
        except SpecError as exc:
            replies[m.index] = exc.to_reply(m.req.session_id, m.req.round)
    done = _keep_paths(engine, done, replies)
    for m, _ in done:
        if m.req.sync.base_len == 0:  # its request forwarded a context
            engine.keep_prefix(m.session, held=True)
    # one wait for the device for every reply: one forward served them all (a wait per reply
    # cost each member a device synchronization)
    ms = engine.elapsed_ms(t0)
    for m, out in done:
        replies[m.index] = engine.reply_for(m.req, out, engine.committed_len(m.session), t0,
                                            batch_tokens=tokens, batch_size=len(members), verify_ms=ms)


def _with_prefixes(engine, members: list[_Member], replies: list) -> list[_Member]:
    """Each member's sync after ``TargetEngine.with_prefix`` (a new session's cached prefix
    copied into its cache; ``sync + append`` still ends where the request's does, so the root's
    position and the replies are the request's); a member that fails there gets its reply and
    leaves the batch."""
    kept = []
    for m in members:
        try:
            m.sync = engine.guarded(m.session, lambda m=m: engine.with_prefix(m.session, m.req)).sync
            kept.append(m)
        except SpecError as exc:
            replies[m.index] = exc.to_reply(m.req.session_id, m.req.round)
    return kept


def greedy_argmax(members: list[_Member], logits: list) -> list[list[int] | None]:
    """Per member its rows' argmax (greedy members; None for sampled ones): one device op and one
    host copy for all of them."""
    from specsplit.engine.sampling import argmax_rows

    greedy = [lg for m, lg in zip(members, logits) if m.req.sampling.greedy]
    if not greedy:
        return [None] * len(members)
    flat = iter(argmax_rows(torch.cat(greedy)).tolist())
    return [[next(flat) for _ in range(lg.shape[0])] if m.req.sampling.greedy else None
            for m, lg in zip(members, logits)]


def _finish(engine, m: _Member, logits, argmax: list[int] | None = None) -> Outcome:
    """Verify one member's tree from its logits [N, V] (greedy: their ``argmax``); its cache
    keeps the accepted path's K/V once ``_keep_paths`` ran."""
    verdict = engine.decide(m.req, m.layout, logits, argmax, session=m.session)
    engine.note_accepted(m.session, m.req, verdict)
    m.session.last_round = m.req.round
    return Outcome(verdict, forward_tokens=len(m.segment.token_ids), cached=m.session.reused)


def _keep_paths(engine, done: list[tuple[_Member, Outcome]], replies: list) -> list[tuple[_Member, Outcome]]:
    """Each verified member's cache keeps its accepted path after the root: on a KV pool, every
    member's K/V moved at once (``KVPool.compact_sessions``: three operations for the batch, not
    three a member), else cache by cache. The members whose caches did; a failure drops the
    sessions it touched and becomes their replies (a device failure ends the worker)."""
    moves = []
    for m, out in done:
        start = m.req.sync.base_len + len(m.req.sync.append_token_ids)  # the root's position
        moves.append((m.session.kv, [start + i for i in out.verdict.path], start))
    pool = engine.kv_pool
    if pool is None or not all(isinstance(kv, PooledKV) and kv.pool is pool for kv, _, _ in moves):
        kept = []
        for (m, out), (kv, src, start) in zip(done, moves):
            try:
                engine.guarded(m.session, lambda kv=kv, src=src, start=start: kv.compact(src, start))
                kept.append((m, out))
            except SpecError as exc:
                replies[m.index] = exc.to_reply(m.req.session_id, m.req.round)
        return kept
    try:
        pool.compact_sessions(moves)
    except Exception as exc:
        for m, _ in done:
            engine.store.drop(m.session)
        if is_device_failure(exc):
            raise DeviceFailure(f"{engine.role} on {engine.device}: {type(exc).__name__}: {exc}") from exc
        for m, _ in done:
            replies[m.index] = SpecError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}").to_reply(
                m.req.session_id, m.req.round)
        return []
    return done
