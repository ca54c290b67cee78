"""Load-aware trees (issue 15): the cost model prices a node against the whole verify forward
(every session's tokens), so trees shrink as the batch grows, down to plain decoding (a root-only
tree) when speculation stops paying; on a flat cost line they do not shrink."""

from __future__ import annotations

from schemas import FlatTree, SamplingSpec, TreeSpec
from specsplit.orchestrator.costmodel import CostModel

# uncalibrated acceptance = the draft's path probability: 0.82, 0.67, 0.55, then an unlikely tail
CHAIN = FlatTree(token_ids=[1, 2, 3, 4, 5, 6], parents=[-1, 0, 1, 2, 3, 4],
                 draft_logprobs=[0.0, -0.2, -0.2, -0.2, -1.5, -1.5])
STEEP = (10.0, 10.0)  # verify ms = 10 + 10 per token: a compute-bound CPU forward
FLAT = (100.0, 0.0)  # a GPU forward: more tokens cost (nearly) nothing


def _ms(line: tuple[float, float], tokens: float) -> float:
    return line[0] + line[1] * tokens


def warmed(line: tuple[float, float], sessions: int, own: int = 1, round_tokens: float = 1.0) -> CostModel:
    """A cost model that saw verify forwards of ``sessions`` sessions (``own`` tokens each, plus
    a few sizes so the line is fitted), rounds delivering ``round_tokens`` and 5 ms overhead."""
    cm = CostModel()
    for extra in (0, 3, 1, 6, 2, 0, 4, 0):
        own_tokens = own + extra
        batch = own_tokens + (sessions - 1) * own
        cm.observe_forward(own_tokens, _ms(line, batch), batch if sessions > 1 else 0, sessions)
        cm.observe_overhead(5.0)
        cm.observe_rate(round_tokens, 5.0 + _ms(line, batch))
    for _ in range(6):  # the latest forwards: every session at ``own`` tokens
        batch = sessions * own
        cm.observe_forward(own, _ms(line, batch), batch if sessions > 1 else 0, sessions)
    return cm


def test_the_line_is_fitted_against_the_forwards_tokens():
    cm = CostModel()
    for batch in (16, 40, 24, 64, 8):
        cm.observe_forward(3, 20.0 + 2.0 * batch, batch_tokens=batch, batch_size=8)
    a, b = cm.verify_line()
    assert abs(a - 20.0) < 1e-6 and abs(b - 2.0) < 1e-6  # own tokens (always 3) could not fit a slope
    assert abs(cm.others_sessions - 7.0) < 1e-9 and 5 < cm.others_tokens < 61 and cm.shared()
    alone = CostModel()
    for tokens in (1, 5, 9):  # batch_tokens 0: a peer that does not report it, the forward was its own
        alone.observe_forward(tokens, 20.0 + 2.0 * tokens)
    assert abs(alone.verify_line()[1] - 2.0) < 1e-6 and alone.load() == (0.0, 0.0) and not alone.shared()


def test_same_acceptance_and_slope_lone_speculates_a_batch_of_16_decodes_plainly():
    lone, batch = warmed(STEEP, 1), warmed(STEEP, 16)
    assert abs(lone.verify_line()[1] - 10.0) < 1e-6 and abs(batch.verify_line()[1] - 10.0) < 1e-6
    assert lone.choose(CHAIN, 0).nodes == [0, 1, 2]  # the likely nodes pay for their 10 ms each
    assert batch.choose(CHAIN, 0).nodes == [0]  # 16 sessions: a node must beat 10 ms x 16 tok / 175 ms
    assert len(warmed(STEEP, 4).choose(CHAIN, 0).nodes) < 3  # in between: fewer than alone
    # min_nodes forces speculation only on a session that is alone
    assert CostModel(min_nodes=3).choose(CHAIN, 0).nodes == [0, 1, 2, 3]
    forced = warmed(STEEP, 16)
    forced.min_nodes = 3
    assert forced.choose(CHAIN, 0).nodes == [0]


def test_a_flat_cost_line_keeps_speculating_under_load():
    batch = warmed(FLAT, 16)
    a, b = batch.verify_line()
    assert abs(a - 100.0) < 1e-6 and b < 1e-9 and batch.shared()
    assert batch.choose(CHAIN, 0).nodes == [0, 1, 2, 3, 4, 5]


def test_draft_depth_is_priced_at_the_batchs_rate():
    spec = TreeSpec(max_nodes=16, max_depth=10, branch=2, min_path_prob=0.3)

    def with_draft(cm: CostModel) -> CostModel:
        for n in range(1, 9):
            cm.observe_draft(n, 5.0 + 2.0 * n)
        return cm

    lone, batch = with_draft(warmed(STEEP, 1, round_tokens=2.0)), with_draft(warmed(STEEP, 16, round_tokens=2.0))
    assert batch.batch_rate() > 2 * lone.batch_rate()  # each round is slower, but 16 share it
    assert lone.draft_spec(spec).min_path_prob < 0.9 <= batch.draft_spec(spec).min_path_prob


def test_the_load_fades_when_the_session_is_alone_again():
    cm = warmed(STEEP, 16)
    for i in range(30):  # alone again: forwards of the sizes its trees take
        cm.observe_forward(1 + i % 6, _ms(STEEP, 1 + i % 6))
        cm.observe_rate(2, 40.0)
    assert not cm.shared() and cm.load()[0] < 0.1
    assert cm.choose(CHAIN, 0).nodes == [0, 1, 2]


def _simulate(line: tuple[float, float], sessions: int, rounds: int = 12) -> list[int]:
    """``sessions`` sessions sharing one cost model and one forward per round, each choosing from
    what the model measured; returns the nodes each round's trees kept in all."""
    cm, kept = CostModel(), []
    for tokens in (2, 5, 3, 8):  # a few lone rounds first: the line, speculation on
        cm.observe_forward(tokens, _ms(line, tokens))
    for _ in range(rounds):
        choices = [cm.choose(CHAIN, 0) for _ in range(sessions)]
        batch = sum(len(c.nodes) for c in choices)
        ms = 5.0 + _ms(line, batch)
        for c in choices:
            cm.observe_forward(len(c.nodes), ms - 5.0, batch if sessions > 1 else 0, sessions)
            cm.observe_overhead(5.0)
            cm.observe_rate(c.expected_tokens, ms)
        kept.append(batch - sessions)
    return kept


def test_a_batch_converges_to_plain_decoding_on_a_steep_line_only():
    steep = _simulate(STEEP, 16)
    assert steep[0] > 0 and steep[-3:] == [0, 0, 0]  # it starts speculating and ends root-only
    assert _simulate(FLAT, 16)[-1] == 16 * 5  # every node of every tree, every round
    assert _simulate(STEEP, 1)[-1] == 2  # alone: the two likely nodes


def test_generate_from_a_loaded_cost_model_equals_plain_greedy(models):
    """A cost model that saw batches of 16 on a steep line starts the session root-only; as its
    own (alone) forwards are measured the load fades and it speculates again. Either way the
    output is plain greedy decoding."""
    from specsplit.engine.target import TargetEngine
    from specsplit.local import generate
    from tests.conftest import greedy_reference

    target, often, _ = models["qwen3"]
    sent: list[int] = []

    def recording_target(model, limits):
        engine = TargetEngine(model, limits)
        handle = engine.handle

        def record(msg):
            sent.append(msg.tree.num_nodes)
            return handle(msg)

        engine.handle = record
        return engine

    prompt = [5, 17, 99, 3, 42, 8, 61]
    out = generate(often, target, prompt, max_new_tokens=40, tree=TreeSpec(max_nodes=8, max_depth=4, branch=2),
                   sampling=SamplingSpec(), cost_model=warmed(STEEP, 16), make_target_engine=recording_target)
    assert out == greedy_reference(target, prompt, 40)[0]
    assert sent[1:4] == [1, 1, 1] and max(sent[4:]) > 1, sent  # plain decoding under load, then speculation


def _speculated(line: tuple[float, float], draft_busy_ms: float, tokens: float, rate: float) -> CostModel:
    """A model that measured ``line`` and speculative rounds delivering ``tokens`` while holding
    the draft worker ``draft_busy_ms``, at ``rate`` tokens/ms per session."""
    cm = warmed(line, sessions=1, own=8)
    for _ in range(10):
        cm.observe_speculation(int(tokens), draft_busy_ms)
    cm.rate = rate
    return cm


def test_plain_decoding_under_load_from_measured_draft_and_verify_costs():
    # the 2-core box's figures (bench load): ~7 tokens per round, the draft worker busy ~550 ms
    # per round, verify 100 + 13 ms per token; speculating sessions measured 12.4 tok/s alone,
    # 4.6 each at 4, 1.0 each at 16 (the draft worker serializes them)
    cm = _speculated((100.0, 13.0), draft_busy_ms=550.0, tokens=7, rate=0.0046)
    for n, rate, plain in ((0, 0.0124, False), (1, 0.0124, False), (2, 0.0046, True), (4, 0.0046, True),
                           (16, 0.001, True)):
        cm.active_sessions, cm.rate = n, rate
        assert cm.plain_pays() is plain, n  # 4: 4/152 ms = 26 tok/s beats max(7/550 ms, 4 x 4.6) tok/s
    # two sessions measured speculating at 12 tok/s each: together they beat 2/126 ms
    cm.rate, cm.rate_sessions, cm.active_sessions = 0.012, 2.0, 2
    assert not cm.plain_pays()
    # the same 12 tok/s measured by a lone session is not credited twice (the draft worker is shared)
    cm.rate_sessions = 1.0
    assert cm.plain_pays()
    # a draft that measurably keeps up (several draft workers): speculation stays
    cm.rate, cm.rate_sessions, cm.active_sessions = 0.05, 4.0, 4
    assert not cm.plain_pays()
    # ... at the load it was measured under: 4 sessions' 50 tok/s each is not 16 sessions' each,
    # where plain decoding delivers 16 / 308 ms = 52 tok/s against the 4 x 50 = 200 measured
    cm.active_sessions = 16
    assert not cm.plain_pays()
    cm.rate = 0.01  # 4 x 10 tok/s measured: 16 x 10 would beat plain decoding, 4 x 10 does not
    assert cm.plain_pays()
    # nothing measured about speculation yet: never switch
    fresh = warmed((100.0, 13.0), sessions=1, own=8)
    fresh.active_sessions = 16
    assert not fresh.plain_pays()


def test_a_cheap_draft_keeps_speculating_under_load():
    cm = _speculated((100.0, 13.0), draft_busy_ms=20.0, tokens=7, rate=0.012)  # 350 tok/s of drafts
    cm.active_sessions = 16  # plain: 16 / 295 ms = 54 tok/s
    assert not cm.plain_pays()


def test_plain_rounds_keep_the_lookup_nodes_that_pay_for_their_share_of_the_forward():
    """Plain decoding under load calls no draft, but prompt lookup's candidates cost nothing to
    draft: a lookup node is verified when its measured acceptance beats its share of the batched
    forward (here 3.75 ms per token against a batch delivering 16 tokens per ~306 ms: ~0.2)."""
    line = (234.0, 3.75)  # bench load's batched verify: 16 sessions x 1 / 2 nodes = 294 / 354 ms
    chain = FlatTree(token_ids=[1, 2, 3, 4], parents=[-1, 0, 1, 2], draft_logprobs=[0.0] * 4)
    lookup = {1, 2, 3}
    good, poor = warmed(line, 16, round_tokens=4.0), warmed(line, 16, round_tokens=4.0)
    rate = good.rate
    for cm, accepted in ((good, [1, 2]), (poor, [])):
        for _ in range(20):
            cm.observe_plain(1, 12.0)  # plain rounds deliver 1 token each, 12 ms besides the forward
            cm.observe_round(chain, accepted, lookup)
    assert good.rate == rate and abs(good.round_tokens - 1.0) < 0.05  # the speculative rate is left alone
    assert abs(good.plain_overhead_ms - 12.0) < 1e-9 and good.overhead_ms == 5.0
    assert good.choose(chain, 1, lookup, plain=True).nodes == [0, 1, 2]  # 95 % each; the third 5 %
    assert poor.choose(chain, 1, lookup, plain=True).nodes == [0]
    # the same measured acceptance, priced at the speculative rounds' delivery (4 tokens each):
    # nodes look 4x dearer, and a 60 % lookup node no longer pays
    stale = warmed(line, 16, round_tokens=4.0)
    for _ in range(20):
        stale.observe_round(chain, [1], lookup)
        stale.observe_round(chain, [], lookup)
    assert stale.choose(chain, 1, lookup, plain=True).nodes == [0]
    for _ in range(20):
        stale.observe_plain(1, 12.0)
    assert stale.choose(chain, 1, lookup, plain=True).nodes == [0, 1]


def test_one_session_measures_speculation_while_the_rest_decode_plainly():
    """Nothing measured about drafted rounds yet: a lone session drafts; under load the first
    session to get there drafts (and measures) and the others decode plainly meanwhile, instead
    of every session queueing its prompt on the one draft worker at round 0."""
    fresh = warmed((100.0, 13.0), sessions=1, own=8)
    fresh.active_sessions = 16
    assert not fresh.plain_pays()  # nobody drafting: this session measures
    fresh.speculating = 1
    assert fresh.plain_pays()  # somebody measures already
    fresh.active_sessions = 1
    assert not fresh.plain_pays()  # alone: always drafts


def test_the_round_that_measures_speculation_verifies_a_drafted_node_under_load():
    """A 16-session batch on a steep line chooses a root-only tree, so the drafted round that
    measures speculation for ``plain_pays`` verified no node: it measured a draft delivering one
    token, and plain decoding never drafted again while the load lasted (CI, 2026-12-02: sixteen
    sessions, not one drafted node). That round keeps ``min_nodes``; once it is measured, choices
    under load are free again."""
    from specsplit.orchestrator.state import select
    from specsplit.proposers.base import Proposal

    cm = warmed(STEEP, 16)
    cm.active_sessions = 16
    assert cm.measuring() and cm.shared()
    assert cm.choose(CHAIN, 0).nodes == [0]
    assert cm.choose(CHAIN, 0, measure=True).nodes == [0, 1]
    drafted = select(CHAIN, {}, cm, sync_tokens=0, plain=False, drafted=Proposal(tree=CHAIN, draft_ms=30.0))
    assert drafted.tree.num_nodes == 2
    assert select(CHAIN, {}, cm, sync_tokens=0, plain=False).tree.num_nodes == 1  # no draft call: not measuring
    cm.observe_speculation(2, 30.0, draft_ms=30.0, nodes=2)
    assert not cm.measuring()
    assert select(CHAIN, {}, cm, sync_tokens=0, plain=False, drafted=Proposal(tree=CHAIN)).tree.num_nodes == 1


def _lockstep(draft_ms: float) -> CostModel:
    """The 2-core box under 16 sessions (bench load, the real pair): verify 900 ms for 16 tokens,
    1190 for 32; drafted rounds delivering 2 tokens from 2-node trees, the draft worker busy only
    for their draft call, ``draft_ms``."""
    line = (610.0, 290.0 / 16)
    cm = warmed(line, sessions=16, own=1)
    for _ in range(10):
        cm.observe_speculation(2, draft_ms, draft_ms=draft_ms, nodes=2)
    cm.rate, cm.rate_sessions, cm.active_sessions = None, None, 16
    return cm


def test_a_cheap_draft_call_does_not_switch_a_batch_that_would_queue_on_it():
    # one draft worker alone would allow 2 tokens / 100 ms = 20 tok/s > 16 / 900 ms = 17.8 by
    # plain decoding; but 16 sessions each waiting for 15 other draft calls, then a 32-token
    # forward, deliver 32 tokens / (1600 + 1190) ms = 11.5 tok/s: plain decoding pays
    cm = _lockstep(100.0)
    assert abs(cm.verify_ms(16, explore=False) - 900.0) < 1.0 and abs(cm.verify_ms(32, explore=False) - 1190.0) < 1.0
    assert cm.plain_pays()
    # the same without the draft-call measurement (an older peer): the one-worker bound alone
    legacy = _lockstep(100.0)
    legacy.draft_call_ms = None
    assert not legacy.plain_pays()
    # a draft call of 5 ms (a GPU draft): 32 / (80 + 1190) ms = 25 tok/s, the one worker's 400:
    # the batch keeps drafting
    assert not _lockstep(5.0).plain_pays()
    # measured: 16 drafting sessions at 1.5 tok/s each beat plain decoding whatever the bounds
    measured = _lockstep(100.0)
    measured.rate, measured.rate_sessions = 0.0015, 16.0
    assert not measured.plain_pays()


def test_the_speculative_rate_is_credited_for_the_sessions_that_were_drafting():
    """A drafted round's rate counts for the sessions drafting beside it, not for every session
    under way: one session measuring speculation among 15 plain ones is not 16 drafting sessions."""
    cm = _lockstep(100.0)
    cm.speculating = 1
    for _ in range(20):
        cm.observe_rate(2, 1800.0)  # its 2 tokens in 1.8 s, a forward shared with 15 plain rounds
    assert abs(cm.rate_sessions - 1.0) < 1e-9
    assert cm.plain_pays()  # 1 x 1.1 tok/s, not 16 x 1.1 = 17.8 ~ plain decoding's 17.8
    cm.speculating = 16
    for _ in range(40):
        cm.observe_rate(2, 1800.0)
    assert cm.rate_sessions > 15.0
