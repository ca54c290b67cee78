"""The draft builds the trees of several sessions in lockstep: each step, ONE forward
(``specsplit.engine.batch``) carries the next forward of every session still drafting (its root
forward, then each best-first step or sampled level), each on its own cache under its own mask.

Each DraftRequest runs as the generator ``DraftEngine.draft_steps``: the same code that
``draft`` drives alone, so a session's tree, kept tree, RNG draws and cache are what drafting it
alone gives, up to the rounding of forwards of another shape (fp32: ~1e-6 in the logits; the
torch.ao int8 draft's per-forward activation scale: more, so its trees may differ; a draft only
proposes, the target's output is unchanged). Per request as ``draft`` does: checks before
anything moves, errors per request. Drafted alone (after the lockstep, in request order): a sync
longer than one linear chunk (a prompt), sampled requests (``batchable``), GrowRequests,
anything else, a session's second request.
If a batched forward fails for a reason other than the device, the caches are cut back and each
session still drafting finishes alone.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass

from schemas import DraftReply, DraftRequest, Message
from specsplit.engine.base import LINEAR_CHUNK, is_device_failure
from specsplit.engine.batch import Segment, admitted_and_locked, select_fused
from specsplit.engine.store import Session
from specsplit.errors import DeviceFailure, SpecError


def batchable(req: Message) -> bool:
    """A greedy DraftRequest with a short sync. A sampled one drafts alone: its tree is drawn
    with the request's seed from the draft's probabilities, which another forward shape rounds
    differently (the int8 draft's per-forward activation scale most of all), so a seeded run's
    output would depend on which sessions happened to share a forward. A greedy tree only
    proposes: the target's verdict, hence the output, is the same whatever the draft proposes."""
    return (isinstance(req, DraftRequest) and req.sampling.greedy
            and len(req.sync.append_token_ids) + 1 <= LINEAR_CHUNK)


@dataclass(slots=True)
class _Member:
    index: int  # position in the request list
    req: DraftRequest
    session: Session  # locked while a member
    steps: Generator  # DraftEngine.draft_steps
    pending: Segment | None = None  # the forward it waits for


def draft_batch(engine, requests: Sequence[Message]) -> list[Message]:
    """Replies to ``requests`` in order (``engine``: a DraftEngine). Raises DeviceFailure only."""
    t0 = time.perf_counter()
    fused = select_fused(requests, batchable)
    if len(fused) < 2 or not engine.batched_forward_supported():
        return [engine.handle(req) for req in requests]
    replies: list[Message | None] = [None] * len(requests)
    members = _lock_members(engine, requests, fused, replies)
    try:
        _lockstep(engine, members, replies, t0)
    finally:
        for m in members:
            m.steps.close()  # a no-op once finished
            m.session.lock.release()
    # one wait for the device for every member's reply (they leave together): a wait per member
    # cost each a device synchronization
    ms = engine.elapsed_ms(t0)
    for m in members:
        if isinstance(replies[m.index], DraftReply):
            replies[m.index] = replies[m.index].model_copy(update={"draft_ms": ms})
    for i in sorted(set(range(len(requests))) - set(fused)):
        replies[i] = engine.handle(requests[i])
    return replies


def _lock_members(engine, requests, indices: list[int], replies: list) -> list[_Member]:
    """Admit and lock each candidate (a refusal becomes its reply)."""
    return [_Member(i, req, session, engine.draft_steps(session, req, spec))
            for i, req, (session, spec) in admitted_and_locked(engine, requests, indices, replies)]


def _lockstep(engine, members: list[_Member], replies: list, t0: float) -> None:
    active = [m for m in members if _advance(engine, m, None, replies, t0)]
    while active:
        held = [m.pending.kv.length for m in active]
        try:
            logits = engine.forward_segments([m.pending for m in active])  # per member [keep_i, V]
        except Exception as exc:
            if is_device_failure(exc):
                for m in active:
                    engine.store.drop(m.session)
                raise DeviceFailure(f"{engine.role} on {engine.device}: {type(exc).__name__}: {exc}") from exc
            engine.log.warning("batch_forward_failed", sessions=len(active),
                               error=f"{type(exc).__name__}: {exc}"[:500], action="draft each alone")
            for m, length in zip(active, held):
                m.pending.kv.crop_to(length)  # what the failed forward appended is dropped
                _advance(engine, m, None, replies, t0, alone=True)
            return
        active = [m for m, lg in zip(active, logits) if _advance(engine, m, lg, replies, t0)]


def _advance(engine, m: _Member, logits, replies: list, t0: float, alone: bool = False) -> bool:
    """Send ``logits`` (None: start) to the member's generator: True while it waits for another
    forward; its reply once it returns. ``alone``: forward its pending segment, and each next
    one, by itself until it finishes."""

    def step() -> bool:
        lg = engine.forward_one(m.pending) if alone else logits
        while True:
            try:
                m.pending = m.steps.send(lg)
            except StopIteration as done:
                tree, reused = done.value
                replies[m.index] = engine.reply_for(m.req, tree, reused, t0, draft_ms=0.0)  # ms: draft_batch
                return False
            if not alone:
                return True
            lg = engine.forward_one(m.pending)

    try:
        return engine.guarded(m.session, step)
    except SpecError as exc:
        replies[m.index] = exc.to_reply(m.req.session_id, m.req.round)
        return False
