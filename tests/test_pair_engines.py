"""The engines of a ``specsplit pair`` process (issue 45): a draft and a target engine, each on its
own thread and, on CUDA, its own stream, over KV pools with graphs, serving two sessions at once so
that one session's drafts and growth run while the other's trees are verified. Each session's
greedy output equals the target's plain greedy decoding, and a sampled run equals the same run on
eager engines alone: nothing one role's forwards leave on their stream (static buffers, pool
slots, allocator blocks) reaches the other's. On CPU the graph
bodies run eagerly ("static"); ``ops/gpu_check.sh`` runs the CUDA case on a lent device."""

from __future__ import annotations

import random
import threading
from dataclasses import replace

import pytest

from schemas import Ack, EndSession, TreeSpec
from specsplit.bench.replay_fleet import ThreadedEngine
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.local import generate
from tests.test_graphs import LIMITS, MODES, device_of, graphed
from tests.test_kvpool import GREEDY, MARGIN, SAMPLED, greedy_reference

SESSIONS = 2
NEW_TOKENS = 24


@pytest.mark.parametrize("mode", MODES)
def test_two_sessions_through_both_roles_on_their_own_threads_equal_greedy(models, mode):
    from tests.conftest import on_device

    dev = device_of(mode)
    target, draft, _ = (on_device(m, dev) for m in models["qwen2"])
    limits = replace(LIMITS, max_session_tokens=600)
    engines = {"target": ThreadedEngine(TargetEngine(target, graphed(limits, target, SESSIONS, mode)), "target"),
               "draft": ThreadedEngine(DraftEngine(draft, graphed(limits, draft, SESSIONS, mode)), "draft")}
    rng = random.Random(5)
    prompts, refs = [], []
    while len(prompts) < SESSIONS:  # prompts whose greedy decoding has no near-tie
        prompt = [rng.randrange(128) for _ in range(rng.randrange(4, 30))]
        ref, gap = greedy_reference(models["qwen2"][0], prompt, NEW_TOKENS)
        if gap >= MARGIN:
            prompts.append(prompt)
            refs.append(ref)
    sampled_kw = {"max_new_tokens": 16, "tree": TreeSpec(max_nodes=8, max_depth=4, branch=2), "sampling": SAMPLED}
    sampled_refs = [generate(draft, target, p, **sampled_kw, session_id=f"ref{i}") for i, p in enumerate(prompts)]
    outs: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(SESSIONS)

    def end(sid: str) -> None:
        """End a finished session on both roles, as the orchestrator does: its slots go back to
        the pools. Left to LRU eviction, the other thread's live session could be the one evicted
        (the pools hold one slot per thread), and its next request would be a CACHE_MISS that only
        the orchestrator, not ``generate``, answers by resending."""
        for e in engines.values():
            assert isinstance(e.handle(EndSession(session_id=sid)), Ack)

    def session(i: int) -> None:
        try:
            start.wait(30)
            for k in range(3):  # three runs each: slots freed and taken again, the other session's forwards beside
                outs[i] = generate(draft, target, prompts[i], max_new_tokens=NEW_TOKENS, sampling=GREEDY,
                                   tree=TreeSpec(max_nodes=12, max_depth=5, branch=2), session_id=f"s{i}-{k}",
                                   grow_budget_ms=5.0, make_target_engine=lambda *_: engines["target"],
                                   make_draft_engine=lambda *_: engines["draft"])
                assert outs[i] == refs[i], (i, outs[i], refs[i])
                end(f"s{i}-{k}")
            sampled = generate(draft, target, prompts[i], **sampled_kw, session_id=f"sampled{i}",
                               make_target_engine=lambda *_: engines["target"],
                               make_draft_engine=lambda *_: engines["draft"])
            end(f"sampled{i}")
            assert sampled == sampled_refs[i], (i, sampled, sampled_refs[i])
        except BaseException as exc:  # reported below, with the session's index
            errors.append(exc)

    threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(SESSIONS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        for e in engines.values():
            e.close()
    assert not errors, errors[0]
    assert [e.store.evicted for e in engines.values()] == [0, 0]  # each session's slot freed by its end
    assert sorted(outs) == list(range(SESSIONS)) and not any(t.is_alive() for t in threads)
    assert all(e.engine.graphs.served > 0 for e in engines.values())
