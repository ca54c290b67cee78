"""Predicted outputs (``specsplit.proposers.prediction``; OpenAI's ``prediction``): the
proposer follows the answer along the prediction and finds its place again after an edit; through
the session actor and real engines the answer is the target's greedy decoding whatever the
prediction says, in fewer rounds when the prediction is mostly right."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from schemas import GenerateRequest, TreeSpec
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.orchestrator.actor import ActorPolicy, SessionActor
from specsplit.proposers.base import Budget, Shared
from specsplit.proposers.prediction import PredictedOutput, resync
from tests.conftest import greedy_reference
from tests.test_actor import EngineRpc
from tests.test_penalties import LIMITS, PROMPT

SPEC = TreeSpec(max_nodes=8, max_depth=8, branch=2)


def proposer(pred: list[int], prompt_len: int = 2) -> PredictedOutput:
    req = SimpleNamespace(prediction_token_ids=pred, prompt_len=prompt_len)
    return PredictedOutput(SimpleNamespace(req=req), Shared())


def chain(p: PredictedOutput, committed: list[int], n: int = 4):
    got = p.suggest(committed, Budget(SPEC, n))
    return (list(got.chain), got.keys[0]) if got else None


def test_it_follows_the_answer_and_finds_its_place_after_an_edit():
    pred = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    p = proposer(pred)
    assert chain(p, [1, 2]) == ([10, 11, 12, 13], 1)  # nothing answered yet: from the start
    assert chain(p, [1, 2, 10, 11]) == ([12, 13, 14, 15], 1)
    # the answer departs (99, 98 instead of 12, 13), then rejoins at 14, 15, 16: found again
    assert chain(p, [1, 2, 10, 11, 99, 98]) is None
    assert chain(p, [1, 2, 10, 11, 99, 98, 14, 15, 16]) == ([17, 18, 19, 20], 0)
    assert chain(p, [1, 2, 10, 11, 99, 98, 14, 15, 16, 17]) == ([18, 19, 20, 21], 1)
    assert chain(p, [1, 2, 10, 11, 99, 98, 14, 15, 16, 17, 18, 19, 20, 21]) is None  # the prediction is spent
    assert chain(proposer([]), [1, 2, 3]) is None
    p = proposer(pred)  # tokens rolled back (exact SpecPV): the place is found again
    assert chain(p, [1, 2, 10, 11, 12, 13, 14]) == ([15, 16, 17, 18], 1)
    assert chain(p, [1, 2, 10, 11, 12]) == ([13, 14, 15, 16], 0)


def test_resync_prefers_the_longest_recurrence_then_the_one_past_the_last_place():
    pred = [5, 6, 7, 1, 5, 6, 7, 2, 9, 6, 7, 3]
    assert resync(pred, [8, 5, 6, 7], 0) == 3  # 5 6 7 recurs twice: the first
    assert resync(pred, [8, 5, 6, 7], 4) == 7  # ... or the one past where the answer last was
    assert resync(pred, [9, 6, 7], 0) == 11  # the longest: 9 6 7
    assert resync(pred, [4, 4, 7], 0) is None  # one token in common is not enough
    assert resync(pred, [7], 0) == 3  # a one-token answer needs one


def run(draft, target, prediction: list[int], n: int):
    d_rpc, t_rpc = EngineRpc(DraftEngine(draft, LIMITS)), EngineRpc(TargetEngine(target, LIMITS))
    req = GenerateRequest(session_id="p", prompt_token_ids=PROMPT, max_new_tokens=n, tree=SPEC,
                          prediction_token_ids=prediction)
    return asyncio.run(SessionActor(req, d_rpc, t_rpc, ActorPolicy(tree=SPEC, lookup_max_tokens=8),
                                    lambda _: None).run())


def test_a_prediction_saves_rounds_and_never_changes_the_answer(models):
    target, _, rarely = models["qwen2"]
    want = greedy_reference(target, PROMPT, 48)[0]
    edited = want[:14] + [3, 4, 5] + want[17:30] + [7] + want[30:]  # a replacement and an insertion
    plain = run(rarely, target, [], 48)
    assert plain.token_ids == want
    for prediction in (want, edited, list(reversed(want)), [1, 2, 3]):
        done = run(rarely, target, prediction, 48)
        assert done.token_ids == want
        if prediction in (want, edited):
            assert done.rounds < plain.rounds * 0.6, (done.rounds, plain.rounds)


def test_followed_counts_the_predictions_tokens_the_answer_took_up():
    """OpenAI's ``accepted_prediction_tokens``: the prediction's tokens the answer walked along,
    in order, each at most once; an edit costs the edited tokens and the few the answer needs to
    be found again; an answer that leaves the prediction counts nothing more."""
    from specsplit.proposers.prediction import RESYNC_MIN, followed

    p = list(range(100, 200))
    assert followed(p, p) == 100 and followed(p, p + p) == 100 and followed(p, p[:50]) == 50
    assert followed(p, []) == 0 and followed(p, list(range(300, 400))) == 0 and followed([], p) == 0
    edited = p[:40] + [1, 2] + p[42:]  # two tokens replaced: found again after RESYNC_MIN more
    assert 100 - 2 - RESYNC_MIN <= followed(p, edited) <= 98
    inserted = p[:40] + [1, 2, 3, 4] + p[40:]  # a line added: the prediction goes on where it was
    assert 100 - RESYNC_MIN <= followed(p, inserted) <= 100
    moved = p[50:] + p[:50]  # the second half first: found there; the first half is then behind it
    assert 49 <= followed(p, moved) <= 50
    assert followed(p, edited, budget=0) == 40  # no budget to find it again: the first stretch only
