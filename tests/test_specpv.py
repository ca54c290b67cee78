"""SpecPV partial verification (fp32 tiny models): a view holding the whole prefix is
bit-identical to full verification; exact mode equals plain greedy decoding at 2K-8K contexts
with small budgets; approximate mode's agreement is reported; bad specs are typed errors."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from schemas import (
    CacheSync, ErrorCode, ErrorReply, FlatTree, GenerateRequest, SamplingSpec, SpecPVSpec, TreeSpec, VerifyRequest,
)
from specsplit.engine.base import EngineLimits
from specsplit.engine.kvcache import SessionKV
from specsplit.engine.specpv import BlockSummaries, PartialView, plan_view, view_kv
from specsplit.engine.target import TargetEngine
from specsplit.local import generate
from specsplit.orchestrator.state import RoundStats
from tests.conftest import MARGIN_DEFAULT, greedy_cached, on_device, tiny_model

CHAIN = TreeSpec(max_nodes=5, max_depth=4, branch=1)
TREE = TreeSpec(max_nodes=12, max_depth=4, branch=3)
TINY = SpecPVSpec(block_size=16, sink_blocks=1, retrieval_blocks=2, window_blocks=1, buffer_tokens=32,
                  threshold=512, refresh_every=4)
SMALL = SpecPVSpec(block_size=16, sink_blocks=2, retrieval_blocks=8, window_blocks=2, buffer_tokens=64,
                   threshold=1024, refresh_every=8)
WIDER = SpecPVSpec(block_size=32, sink_blocks=2, retrieval_blocks=16, window_blocks=4, buffer_tokens=64,
                   threshold=300, refresh_every=16)


class Recording(TargetEngine):
    """The real target engine, keeping the logits of its last forward."""

    def forward(self, *args, **kwargs):
        self.last = super().forward(*args, **kwargs)
        return self.last


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(n)]


# ---- the spec ----------------------------------------------------------------------------
def test_spec_defaults_and_bounds():
    s = SpecPVSpec()
    assert (s.block_size, s.sink_blocks, s.retrieval_blocks, s.window_blocks, s.buffer_tokens, s.threshold,
            s.refresh_every, s.exact) == (16, 2, 256, 8, 128, 4096, 32, True)
    SpecPVSpec(block_size=8, sink_blocks=1, retrieval_blocks=2, window_blocks=1, buffer_tokens=64, threshold=200)
    for bad in ({"block_size": 1}, {"buffer_tokens": 4}, {"refresh_every": 0}, {"threshold": -1},
                {"retrieval_blocks": 10**6}, {"block_size": 256, "retrieval_blocks": 8192}, {"exact": "maybe"},
                {"bogus": 1}):
        with pytest.raises(ValidationError):
            SpecPVSpec(**bad)
    assert GenerateRequest(session_id="s", prompt_token_ids=[1]).specpv is None
    with pytest.raises(ValidationError):
        GenerateRequest(session_id="s", prompt_token_ids=[1], specpv={"window_blocks": -1})


def test_fleet_defaults_are_off_unless_set(monkeypatch):
    from specsplit.config import OrchestratorSettings

    for k in ("SPECSPLIT_SPECPV", "SPECSPLIT_SPECPV_THRESHOLD", "SPECSPLIT_SPECPV_EXACT"):
        monkeypatch.delenv(k, raising=False)
    assert OrchestratorSettings().specpv_spec() is None
    monkeypatch.setenv("SPECSPLIT_SPECPV_THRESHOLD", "300")
    assert OrchestratorSettings().specpv_spec() == SpecPVSpec(threshold=300)
    monkeypatch.setenv("SPECSPLIT_SPECPV_EXACT", "false")
    assert OrchestratorSettings().specpv_spec().exact is False
    monkeypatch.setenv("SPECSPLIT_SPECPV", "false")
    assert OrchestratorSettings().specpv_spec() is None
    monkeypatch.setenv("SPECSPLIT_SPECPV", "true")
    monkeypatch.setenv("SPECSPLIT_SPECPV_THRESHOLD", "-5")
    with pytest.raises(ValidationError):
        OrchestratorSettings()


def test_bad_confirmed_len_is_a_typed_error_and_changes_nothing():
    eng = TargetEngine(tiny_model("qwen2", seed=1), EngineLimits(max_session_tokens=512))
    tree = FlatTree(token_ids=[3, 4], parents=[-1, 0])
    ok = eng.handle(VerifyRequest(session_id="s", round=0, sync=CacheSync(base_len=0, append_token_ids=[1, 2]),
                                  tree=tree, specpv=TINY))
    assert not isinstance(ok, ErrorReply)
    bad = eng.handle(VerifyRequest(session_id="s", round=1, sync=CacheSync(base_len=ok.cache_len), tree=tree,
                                   specpv=TINY, confirmed_len=ok.cache_len + 5))
    assert isinstance(bad, ErrorReply) and bad.code == ErrorCode.BAD_REQUEST
    assert eng.committed_len(eng.store.get("s")) == ok.cache_len


def test_below_the_threshold_nothing_changes():
    model = tiny_model("llama", seed=4)
    prompt = random_prompt(300, seed=16)
    lim = EngineLimits(max_session_tokens=1024)
    on, off = Recording(model, lim), Recording(model, lim)
    committed = list(prompt)
    for rnd in range(6):
        tree = FlatTree(token_ids=[committed[-1], 7, 9, 11], parents=[-1, 0, 1, 0])
        sync = CacheSync(base_len=len(committed) - 1) if rnd else CacheSync(base_len=0, append_token_ids=prompt[:-1])
        a = on.handle(VerifyRequest(session_id="s", round=rnd, sync=sync, tree=tree, specpv=TINY))  # threshold 512
        b = off.handle(VerifyRequest(session_id="s", round=rnd, sync=sync, tree=tree))
        assert not a.partial and torch.equal(on.last, off.last)
        assert a.model_copy(update={"verify_ms": 0.0, "confirmed_len": None}) == b.model_copy(update={"verify_ms": 0.0})
        committed += b.accepted_token_ids + [b.bonus_token_id]


def test_cursor_rolls_back_and_streams_only_confirmed_tokens():
    from schemas import VerifyReply
    from specsplit.orchestrator.state import SessionCursor

    def reply(accepted, bonus, cache_len, **kw):
        return VerifyReply(session_id="s", round=0, accepted_token_ids=accepted, bonus_token_id=bonus,
                           cache_len=cache_len, **kw)

    cur, out = SessionCursor([1, 2, 3], draft_len=3), []
    cur.apply_verify(reply([4, 5], 6, 5, partial=True, confirmed_len=3))  # provisional 4 5 6
    assert cur.committed == [1, 2, 3, 4, 5, 6] and cur.provisional == 3
    assert not cur.take_confirmed(out, 3, 10, set()) and out == []
    assert cur.must_confirm(out, 3, 3, set()) and cur.must_confirm(out, 3, 10, {5})
    assert not cur.must_confirm(out, 3, 10, set())
    cur.draft_len = 6
    cur.apply_verify(reply([], 9, 4, rollback_len=4, confirmed_len=5))  # 4 confirmed, 5 was wrong: 9
    assert cur.committed == [1, 2, 3, 4, 9] and cur.rolled_back == 2 and cur.draft_len == 4
    assert cur.draft_sync().base_len == 4 and cur.target_sync().base_len == 4
    assert not cur.take_confirmed(out, 3, 10, set()) and out == [4, 9]
    cur.apply_verify(reply([7], 8, 6, confirmed_len=7))
    assert cur.take_confirmed(out, 3, 3, set()) and out == [4, 9, 7]
    plain = SessionCursor([1])
    plain.apply_verify(reply([2], 3, 2))  # no SpecPV: everything is confirmed
    assert plain.confirmed == 3 and plain.provisional == 0


# ---- summaries and retrieval ---------------------------------------------------------------
def test_summaries_grow_incrementally_and_bound_every_key():
    torch.manual_seed(0)
    kv = SessionKV(2, 512, chunk=64)
    s = BlockSummaries(2, 16, 512 // 16)
    for step in (37, 5, 90, 16, 3):  # grows in uneven steps, summarizing complete blocks only
        for layer in kv.layers:
            layer.update(torch.randn(1, 2, step, 8), torch.randn(1, 2, step, 8))
        s.extend(kv)
        assert s.n == kv.length // 16
    keys = kv.layers[1].keys[0]  # [Hkv, L, D]
    blocks = keys[:, : s.n * 16].reshape(2, s.n, 16, 8)
    assert torch.equal(s.kmax[1][:, : s.n], blocks.amax(2)) and torch.equal(s.kmin[1][:, : s.n], blocks.amin(2))
    kv.crop_to(40)
    s.crop(40)
    assert s.n == 2
    # Quest's bound q+.Kmax + q-.Kmin is >= q.k for every key of the block
    q = torch.randn(2, 5, 8)
    bound = q.clamp(min=0) @ s.kmax[1][:, :2].transpose(1, 2) + q.clamp(max=0) @ s.kmin[1][:, :2].transpose(1, 2)
    exact = (q @ keys[:, :32].transpose(1, 2)).reshape(2, 5, 2, 16).amax(-1)
    assert (bound >= exact - 1e-5).all()


def test_retrieval_takes_the_block_a_query_points_at_per_head():
    torch.manual_seed(1)
    spec = SpecPVSpec(block_size=4, sink_blocks=1, retrieval_blocks=1, window_blocks=1, buffer_tokens=8, threshold=0)
    kv = SessionKV(1, 64)
    keys = torch.randn(1, 2, 40, 8) * 0.01
    keys[0, 0, 20:24] = 5.0  # head 0: block 5 stands out along +1
    keys[0, 1, 12:16] = -5.0  # head 1: block 3 along -1
    kv.layers[0].update(keys, keys.clone())
    s = BlockSummaries(1, 4, 16)
    s.extend(kv)
    plan = plan_view(spec, kv, s)
    assert (plan.sink_end, plan.win_start, plan.candidates, plan.retrieve) == (4, 36, 8, 1)
    query = torch.ones(1, 4, 3, 8)  # 4 query heads: 0-1 read KV head 0, 2-3 KV head 1
    query[:, 2:] = -1.0
    k, v = view_kv(plan, 0, query)
    assert k.shape == (1, 2, 4 + 4 + 4, 8)
    assert torch.equal(k[0, 0, 4:8], keys[0, 0, 20:24]) and torch.equal(k[0, 1, 4:8], keys[0, 1, 12:16])
    assert torch.equal(k[0, :, :4], keys[0, :, :4]) and torch.equal(k[0, :, 8:], keys[0, :, 36:])


# ---- budget >= context: bit-identical --------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_view_holding_the_whole_prefix_is_bit_identical(family, attn, device):
    model = on_device(tiny_model(family, seed=3, attn=attn), device)
    prompt = random_prompt(700, seed=4)
    spec = SpecPVSpec(block_size=16, sink_blocks=2, retrieval_blocks=64, window_blocks=2, buffer_tokens=128,
                      threshold=100, refresh_every=64, exact=False)  # every round after the prefill is partial
    lim = EngineLimits(max_session_tokens=2048)
    pv_eng, full_eng = Recording(model, lim), Recording(model, lim)
    rng = random.Random(5)
    committed, partial = list(prompt), 0
    for rnd in range(8):
        parents = [-1] + [rng.randrange(i) for i in range(1, 9)]
        tokens = [committed[-1]] + [rng.randrange(128) for _ in range(8)]
        tree = FlatTree(token_ids=tokens, parents=parents)
        sync = CacheSync(base_len=len(committed) - 1) if rnd else CacheSync(base_len=0, append_token_ids=prompt[:-1])
        a = pv_eng.handle(VerifyRequest(session_id="s", round=rnd, sync=sync, tree=tree, specpv=spec))
        b = full_eng.handle(VerifyRequest(session_id="s", round=rnd, sync=sync, tree=tree))
        assert (a.accepted_nodes, a.bonus_token_id, a.cache_len) == (b.accepted_nodes, b.bonus_token_id, b.cache_len)
        assert a.partial == (rnd > 0)
        partial += a.partial
        assert torch.equal(pv_eng.last, full_eng.last), (rnd, (pv_eng.last - full_eng.last).abs().max())
        committed += b.accepted_token_ids + [b.bonus_token_id]
    assert partial == 7


def test_approximate_mode_with_budget_over_context_generates_what_full_does(models):
    target, often, _ = models["llama"]
    prompt = random_prompt(600, seed=2)
    spec = SpecPVSpec(block_size=16, sink_blocks=2, retrieval_blocks=64, window_blocks=2, buffer_tokens=64,
                      threshold=256, refresh_every=4, exact=False)
    stats = RoundStats()
    out = generate(often, target, prompt, max_new_tokens=40, tree=TREE, sampling=SamplingSpec(), specpv=spec,
                   stats=stats)
    assert out == generate(often, target, prompt, max_new_tokens=40, tree=TREE, sampling=SamplingSpec())
    assert stats.partial_rounds > 0


# ---- exact mode = plain greedy at 2K-8K; approximate mode's agreement ------------------------
EXACT_CASES = [  # (family, context, spec, tree)
    ("qwen2", 2048, TINY, CHAIN),
    ("qwen2", 2048, SMALL, TREE),
    ("llama", 2048, WIDER, TREE),
    ("qwen3", 4096, TINY, TREE),
    ("llama", 4096, SMALL, CHAIN),
    ("qwen2", 8192, SMALL, TREE),
]


@pytest.mark.parametrize("family,context,spec,shape", EXACT_CASES,
                         ids=[f"{f}-{c}-{s.retrieval_blocks}x{s.block_size}-{t.branch}" for f, c, s, t in EXACT_CASES])
def test_exact_mode_equals_plain_greedy(models, family, context, spec, shape, device):
    target, often = (on_device(m, device) for m in models[family][:2])
    prompt = random_prompt(context, seed=context + len(family))
    new = 40
    ref, gap = greedy_cached(target, prompt, new)
    if gap < MARGIN_DEFAULT:
        pytest.skip(f"near-tie in the reference (gap {gap:.1e})")
    stats = RoundStats()
    out = generate(often, target, prompt, max_new_tokens=new, tree=shape, sampling=SamplingSpec(), specpv=spec,
                   stats=stats)
    assert out == ref
    assert stats.partial_rounds > 0, "the view was never used"
    approx_stats = RoundStats()
    approx = generate(often, target, prompt, max_new_tokens=new, tree=shape, sampling=SamplingSpec(),
                      specpv=spec.model_copy(update={"exact": False}), stats=approx_stats)
    same = sum(a == b for a, b in zip(approx, ref))
    first = next((i for i, (a, b) in enumerate(zip(approx, ref)) if a != b), None)
    print(f"{family} ctx {context} budget {spec.budget_tokens}: exact {stats.rounds} rounds "
          f"({stats.partial_rounds} partial, {stats.rolled_back} provisional tokens rolled back); approximate "
          f"{same}/{new} tokens equal to full verification, first divergence {first}")


def test_exact_mode_confirms_long_provisional_chains(models):
    """A view covering the prefix agrees with the full cache: provisional tokens pile up over
    many partial rounds (the refresh interval grows to refresh_every, the buffer fills) and every
    refresh confirms them all; the generation ends with a confirmation round."""
    target, often, _ = models["qwen2"]
    prompt = random_prompt(1024, seed=12)
    ref, gap = greedy_cached(target, prompt, 60)
    assert gap >= MARGIN_DEFAULT
    spec = SpecPVSpec(block_size=16, sink_blocks=2, retrieval_blocks=128, window_blocks=2, buffer_tokens=48,
                      threshold=512, refresh_every=8)
    stats = RoundStats()
    out = generate(often, target, prompt, max_new_tokens=60, tree=TREE, sampling=SamplingSpec(), specpv=spec,
                   stats=stats)
    assert out == ref
    assert stats.rolled_back == 0 and stats.partial_rounds >= stats.rounds // 2, stats


def test_exact_mode_stops_at_stop_ids_and_budget(models):
    target, often, _ = models["qwen2"]
    prompt = random_prompt(1500, seed=9)
    ref, gap = greedy_cached(target, prompt, 30)
    assert gap >= MARGIN_DEFAULT
    stop = ref[17]
    for n in (1, 7, 30):
        assert generate(often, target, prompt, max_new_tokens=n, tree=TREE, sampling=SamplingSpec(),
                        specpv=TINY) == ref[:n]
    out = generate(often, target, prompt, max_new_tokens=30, tree=TREE, sampling=SamplingSpec(), specpv=TINY,
                   stop_token_ids=[stop])
    assert out == ref[: ref.index(stop) + 1]


def test_resend_rechecks_provisional_tokens():
    """After a CACHE_MISS the orchestrator resends committed, provisional tokens included: the
    rebuilt session's first (full) round re-checks them and rolls back at the first wrong one."""
    model = tiny_model("qwen2", seed=6)
    prompt = random_prompt(600, seed=7)
    ref, _ = greedy_cached(model, prompt, 6)
    eng = TargetEngine(model, EngineLimits(max_session_tokens=2048))
    wrong = (ref[3] + 1) % 128
    committed = prompt + ref[:3] + [wrong, ref[4]]  # provisional from len(prompt) on
    tree = FlatTree(token_ids=[committed[-1], 1, 2], parents=[-1, 0, 1])
    r = eng.handle(VerifyRequest(session_id="s", round=0, sync=CacheSync(base_len=0, append_token_ids=committed[:-1]),
                                 tree=tree, specpv=TINY, confirmed_len=len(prompt)))
    assert r.rollback_len == len(prompt) + 3 and r.bonus_token_id == ref[3] and r.accepted_token_ids == []
    assert r.cache_len == len(prompt) + 3 and r.confirmed_len == len(prompt) + 4


def test_exact_worker_rechecks_its_buffer_for_a_client_without_counts():
    """A client that sends no confirmed_len still gets exact semantics: the worker treats what it
    buffered under partial views as provisional, and the confirming round rolls back to the
    first token full verification disagrees with."""
    model = tiny_model("qwen2", seed=6)
    prompt = random_prompt(1200, seed=15)
    ref, _ = greedy_cached(model, prompt, 20)  # 16 rounds commit at most 16 tokens
    eng = TargetEngine(model, EngineLimits(max_session_tokens=2048))
    committed, rolled, partial = list(prompt), 0, 0
    for rnd in range(16):
        root_only = FlatTree(token_ids=[committed[-1]], parents=[-1])
        sync = CacheSync(base_len=len(committed) - 1) if rnd else CacheSync(base_len=0, append_token_ids=prompt[:-1])
        r = eng.handle(VerifyRequest(session_id="s", round=rnd, sync=sync, tree=root_only, specpv=TINY,
                                     confirm=rnd % 4 == 3))
        assert not (r.partial and (rnd % 4 == 3 or rnd == 0))  # confirm rounds and the prefill are full
        partial += r.partial
        if r.rollback_len is not None:
            rolled += len(committed) - r.rollback_len
            del committed[r.rollback_len:]
        committed.append(r.bonus_token_id)
        assert r.cache_len == len(committed) - 1
        if not r.partial:  # confirmed: what full verification gives
            assert committed[len(prompt):] == ref[: len(committed) - len(prompt)], rnd
    assert partial and rolled  # this small view disagrees with the full cache (see the approximate figures)


def test_invariant_failure_falls_back_to_full_verification(models, capsys):
    """A broken view (lost buffer entries: caught by the check; a forward that fails: caught
    around it) costs a full verification, is logged once per session, and is never an error."""
    target, often, _ = models["qwen2"]
    prompt = random_prompt(700, seed=8)
    ref, _ = greedy_cached(target, prompt, 40)
    spec = SpecPVSpec(block_size=16, sink_blocks=2, retrieval_blocks=64, window_blocks=2, buffer_tokens=64,
                      threshold=300, refresh_every=8)  # the view covers the prefix: many partial rounds
    broken = {"check": 0, "forward": 0}

    class Breaking(TargetEngine):
        def _partial_ok(self, session, pv, req, layout):
            if pv.pending and req.round % 4 == 1:
                pv.buffer.crop_to(len(pv.pending) - 1)  # the buffer lost an entry
                broken["check"] += 1
            return super()._partial_ok(session, pv, req, layout)

        def _partial(self, kv, pv, req, layout):
            if req.round % 4 == 3:
                broken["forward"] += 1
                raise RuntimeError("injected failure inside the partial forward")
            return super()._partial(kv, pv, req, layout)

    stats = RoundStats()
    out = generate(often, target, prompt, max_new_tokens=40, tree=TREE, sampling=SamplingSpec(), specpv=spec,
                   make_target_engine=Breaking, stats=stats)
    assert out == ref
    assert broken["check"] and broken["forward"] and stats.partial_rounds
    logged = capsys.readouterr()  # stdout, or stderr once a test configured logging
    assert (logged.out + logged.err).count("specpv_fallback") == 1


def test_sampled_sessions_in_exact_mode_verify_fully(models):
    """Exact re-checks are greedy: a sampled session with an exact spec is verified fully, so its
    output is the one full verification gives for the same seed."""
    target, often, _ = models["llama"]
    prompt = random_prompt(700, seed=13)
    sampling = SamplingSpec(temperature=0.8, top_k=20, seed=3)
    spec = SpecPVSpec(block_size=16, sink_blocks=1, retrieval_blocks=4, window_blocks=1, buffer_tokens=64,
                      threshold=256)
    stats = RoundStats()
    out = generate(often, target, prompt, max_new_tokens=24, tree=TREE, sampling=sampling, specpv=spec, stats=stats)
    assert out == generate(often, target, prompt, max_new_tokens=24, tree=TREE, sampling=sampling)
    assert stats.partial_rounds == 0
    approx = RoundStats()  # approximate mode samples under the view
    assert len(generate(often, target, prompt, max_new_tokens=24, tree=TREE, sampling=sampling,
                        specpv=spec.model_copy(update={"exact": False}), stats=approx)) == 24
    assert approx.partial_rounds > 0


def int8_target_and_reference(models, context: int, seed: int):
    """The qwen2 target in the fleet's int8 form, its often-agreeing draft, a prompt and the
    target's greedy decoding of it (32 tokens, wide margins)."""
    import copy

    from specsplit.models.int8 import int8_supported, quantize_int8

    if not int8_supported():
        pytest.skip("torch's fbgemm int8 kernels need an x86 CPU build")
    target = quantize_int8(copy.deepcopy(models["qwen2"][0]))
    prompt = random_prompt(context, seed=seed)
    ref, gap = greedy_cached(target, prompt, 32)
    assert gap >= MARGIN_DEFAULT
    return target, models["qwen2"][1], prompt, ref


def test_int8_target_fp64_attention_is_wrapped_too(models):
    """The fleet's int8 target runs its own float64 attention function: the view wraps it (a
    whole-prefix view stays bit-identical) and exact mode equals that target's greedy decoding."""
    target, often, prompt, ref = int8_target_and_reference(models, 1100, seed=14)
    covering = SpecPVSpec(block_size=16, sink_blocks=2, retrieval_blocks=128, window_blocks=2, buffer_tokens=64,
                          threshold=512, refresh_every=8)
    for spec in (TINY, covering):
        stats = RoundStats()
        assert generate(often, target, prompt, max_new_tokens=32, tree=TREE, sampling=SamplingSpec(), specpv=spec,
                        stats=stats) == ref
        assert stats.partial_rounds > 0
        if spec is covering:  # the whole prefix: partial rounds agree with full ones, nothing rolls back
            assert stats.rolled_back == 0 and stats.partial_rounds > stats.rounds // 3, stats


def test_int8_approximate_mode_refreshes_its_buffer_as_a_prefill(models, monkeypatch):
    """Approximate mode promises no equality with full verification, so the int8 target re-encodes
    the buffered tokens of a refresh on its prompt attention (float32), not the float64 it verifies
    trees with. Exact mode's re-checks never do. With a view covering the context and margins this
    wide, both still generate what full verification does."""
    from specsplit.models.attention import GQA_ATTENTION

    target, often, prompt, ref = int8_target_and_reference(models, 700, seed=15)
    calls, forward_linear = [], TargetEngine.forward_linear

    def spy(self, kv, ids, chunk=None, attention=None):
        calls.append((len(ids), attention))
        return forward_linear(self, kv, ids, chunk, attention)

    monkeypatch.setattr(TargetEngine, "forward_linear", spy)
    for exact in (False, True):
        calls.clear()
        spec = SpecPVSpec(block_size=16, sink_blocks=2, retrieval_blocks=64, window_blocks=2, buffer_tokens=32,
                          threshold=256, refresh_every=4, exact=exact)
        stats = RoundStats()
        assert generate(often, target, prompt, max_new_tokens=32, tree=TREE, sampling=SamplingSpec(), specpv=spec,
                        stats=stats) == ref
        assert stats.partial_rounds > 0
        refreshes = [n for n, attention in calls if attention == GQA_ATTENTION]
        assert (len(refreshes) > 0) != exact and all(0 < n <= 32 + TREE.max_nodes for n in refreshes), calls


def test_partial_view_state_is_bounded():
    pv = PartialView(TINY, num_layers=2, max_tree_nodes=16, max_session_tokens=4096)
    assert pv.buffer.max_len == TINY.buffer_tokens + 16
    assert pv.summaries.max_blocks == 4096 // 16 + 1


def test_local_generate_sessions_never_expire_while_the_other_role_works(models):
    """A long prompt's target prefill can take longer than a worker's session TTL on a CPU;
    in ``generate`` the draft's session waits meanwhile and must still be there (a 16K-token
    bench run lost its draft session to the 600 s default)."""
    from specsplit.engine.draft import DraftEngine

    target, draft, _ = models["llama"]
    seen = []

    def draft_engine(model, limits):
        seen.append(limits)
        return DraftEngine(model, limits)

    prompt = [5, 6, 7, 8]
    out = generate(draft, target, prompt, max_new_tokens=6, tree=TreeSpec(max_nodes=4, max_depth=3, branch=2),
                   sampling=SamplingSpec(), make_draft_engine=draft_engine)
    assert out == greedy_cached(target, prompt, 6)[0]
    assert seen and seen[0].session_ttl_s == float("inf") and seen[0].max_sessions == 1
