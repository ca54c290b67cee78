"""The prefix cache (``specsplit.engine.prefix``): a new session copies the K/V of a context that
an earlier session began the same way, and answers exactly as without it."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import greedy_cached, greedy_reference, perturbed, tiny_model

from schemas import EndSession, SamplingSpec, TreeSpec, VerifyRequest
from specsplit.engine import prefix as P
from specsplit.engine.base import EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.kvcache import SessionKV
from specsplit.engine.prefix import PrefixCache
from specsplit.engine.target import TargetEngine
from specsplit.local import generate
from specsplit.orchestrator.state import SessionCursor, root_only

LAYERS, HEADS, DIM = 2, 2, 4


def filled(n: int, seed: int = 0) -> SessionKV:
    """A cache of ``n`` positions of random K/V."""
    g = torch.Generator().manual_seed(seed)
    kv = SessionKV(LAYERS, 4096, 16)
    for layer in kv.layers:
        layer.update(torch.randn(1, HEADS, n, DIM, generator=g), torch.randn(1, HEADS, n, DIM, generator=g))
    return kv


def per_token() -> int:
    return LAYERS * 2 * HEADS * DIM * 4


def test_the_longest_whole_block_prefix_is_found_and_copied():
    cache = PrefixCache(10**6, block=8)
    tokens = list(range(100, 140))  # 40 tokens: 5 blocks
    kv = filled(40)
    assert cache.put(tokens, kv) == 40
    entry, n = cache.match([*tokens[:21], 7, 7, 7], limit=24)
    assert n == 16  # blocks 0-1 match; block 2 differs at its 6th token
    out = SessionKV(LAYERS, 4096, 16)
    cache.restore(entry, n, out)
    assert out.length == 16
    for a, b in zip(out.layers, kv.layers):
        assert torch.equal(a.keys, b.keys[:, :, :16]) and torch.equal(a.values, b.values[:, :, :16])
    assert cache.match(tokens, limit=15)[1] == 8 and cache.match(tokens, limit=7) == (None, 0)  # whole blocks
    assert cache.match([1, *tokens], limit=41) == (None, 0)  # shifted: nothing in common at position 0
    entry, n = cache.match(tokens + [5] * 30, limit=70)
    assert n == 40


def test_a_hash_collision_costs_a_miss_never_another_contexts_kv(monkeypatch):
    monkeypatch.setattr(P, "chain", lambda tokens, block: [7] * (len(tokens) // block))  # every block collides
    cache = PrefixCache(10**6, block=8)
    cache.put(list(range(32)), filled(32))
    assert cache.match([0] * 32, limit=32) == (None, 0)
    _, n = cache.match([*range(8), 9, 9, 9, 9, 9, 9, 9, 9], limit=16)
    assert n == 8  # the first block is the same tokens; the second only hashes alike


def test_the_budget_bounds_the_bytes_least_recently_used_first():
    cache = PrefixCache(3 * 16 * per_token(), block=8)  # three 16-token entries
    seqs = [[s] * 16 for s in range(4)]
    for s in seqs[:3]:
        cache.put(s, filled(16))
    cache.match(seqs[0], limit=16)  # touched: the second is now the oldest
    cache.put(seqs[3], filled(16))
    assert len(cache) == 3 and cache.bytes <= cache.max_bytes and cache.evicted == 1
    assert cache.match(seqs[1], limit=16) == (None, 0)
    assert cache.match(seqs[0], limit=16)[1] == 16 and cache.match(seqs[3], limit=16)[1] == 16
    big = PrefixCache(16 * per_token(), block=8)
    assert big.put(list(range(40)), filled(40)) == 16  # longer than the budget: the blocks it holds
    assert PrefixCache(per_token(), block=8).put(list(range(40)), filled(40)) == 0
    few = PrefixCache(10**6, block=8, max_entries=2)
    for s in seqs:
        few.put(s, filled(16))
    assert len(few) == 2


def test_an_entry_that_extends_another_replaces_it():
    cache = PrefixCache(10**6, block=8)
    tokens = list(range(64))
    cache.put(tokens[:16], filled(16))
    cache.put(tokens[:40], filled(40))
    assert len(cache) == 1 and cache.bytes == 40 * per_token()
    assert cache.put(tokens[:24], filled(24)) == 0  # held already by the longer one
    cache.put([*tokens[:16], 5, 5, 5, 5, 5, 5, 5, 5], filled(24, seed=1))  # a sibling: both kept
    assert len(cache) == 2
    assert cache.match(tokens, limit=64)[1] == 40
    assert cache.match([*tokens[:16], *[5] * 8], limit=24)[1] == 24


def test_the_same_tokens_computed_two_ways_are_two_entries_and_each_found_where_usable():
    """An int8 target's prompt path and decoding path give the same tokens other bits: an entry
    of one neither holds nor replaces the other's, and a lookup takes the entry it may use even
    when another, more recent, holds more."""
    cache = PrefixCache(10**6, block=8)
    tokens = list(range(48))
    cache.put(tokens[:32], filled(32, seed=1), prompt_path=0)
    assert cache.put(tokens, filled(48, seed=2), prompt_path=40) == 48  # not held, and no replacement
    assert len(cache) == 2
    assert cache.put(tokens[:32], filled(32, seed=3), prompt_path=0) == 0  # held: the first entry
    decoding_path_only = lambda e, n: n if e.prompt_path == 0 else 0
    entry, n = cache.match(tokens, 48, decoding_path_only)
    assert n == 32 and entry.prompt_path == 0
    entry, n = cache.match(tokens, 48)
    assert n == 48 and entry.prompt_path == 40
    chunks_of_16 = lambda e, n: min(n, e.prompt_path) // 16 * 16
    assert cache.match(tokens, 48, chunks_of_16)[1] == 32


# ---- engines ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("qwen2", seed=11, scale=0.3)
    return perturbed(target, 1, 0.05), target


def engines(pair, gb: float, block: int = 16):
    draft, target = pair
    limits = EngineLimits(max_sessions=4, max_session_tokens=1024, cache_chunk=block, prefix_cache_gb=gb)
    return DraftEngine(draft, limits), TargetEngine(target, limits)


def request(sid: str, prompt: list[int]) -> VerifyRequest:
    """A new session's first verify of ``prompt`` (its last token the root), root-only."""
    sync = SessionCursor(list(prompt), prompt_len=len(prompt)).target_sync()
    return VerifyRequest(session_id=sid, round=0, sync=sync, tree=root_only(prompt[-1]))


def run(d_eng, t_eng, sid: str, prompt: list[int], n: int, **kw) -> list[int]:
    out = generate(None, None, prompt, max_new_tokens=n, tree=TreeSpec(max_nodes=8, max_depth=4, branch=2),
                   sampling=kw.pop("sampling", SamplingSpec()), session_id=sid,
                   make_draft_engine=lambda m, limits: d_eng, make_target_engine=lambda m, limits: t_eng, **kw)
    for eng in (d_eng, t_eng):
        eng.handle(EndSession(session_id=sid))
    return out


def test_a_conversations_next_turn_reuses_the_last_and_decodes_greedily(pair):
    """Turn 2's context is turn 1's prompt + answer + a new message: both workers copy turn 1's
    K/V (prompt and generated tokens, whole blocks) and forward the rest; the answer is the
    target's greedy decoding. Turn 3 reuses turn 2's."""
    d_eng, t_eng = engines(pair, gb=0.01)
    rng = random.Random(4)
    context, held = [rng.randrange(128) for _ in range(70)], 0
    for turn in range(3):
        want, gap = greedy_reference(pair[1], context, 24)
        assert gap > 1e-3
        before = t_eng.prefix_cache.reused_tokens, d_eng.prefix_cache.reused_tokens
        got = run(d_eng, t_eng, f"turn{turn}", context, 24)
        assert got == want
        reused = t_eng.prefix_cache.reused_tokens - before[0], d_eng.prefix_cache.reused_tokens - before[1]
        # the last turn's context and answer (but its last token, whose K/V no forward wrote) in whole blocks
        assert reused == ((held - 1) // 16 * 16,) * 2 if turn else reused == (0, 0)
        held = len(context) + len(got)
        context = context + got + [rng.randrange(128) for _ in range(10)]
    assert t_eng.prefix_cache.hits == 2 and t_eng.prefix_cache.misses == 1


def test_without_a_prefix_cache_nothing_is_kept(pair):
    d_eng, t_eng = engines(pair, gb=0.0)
    assert t_eng.prefix_cache is None and d_eng.prefix_cache is None
    prompt = list(range(40))
    assert run(d_eng, t_eng, "a", prompt, 8) == run(d_eng, t_eng, "b", prompt, 8)


def test_the_first_verify_forwards_only_what_the_cache_lacks(pair):
    _, t_eng = engines(pair, gb=0.01)
    prompt = [random.Random(9).randrange(128) for _ in range(100)]

    def first_round(sid: str, ids: list[int]):
        cur = SessionCursor(list(ids), prompt_len=len(ids))
        reply = t_eng.handle(VerifyRequest(session_id=sid, round=0, sync=cur.target_sync(), tree=root_only(ids[-1])))
        t_eng.handle(EndSession(session_id=sid))
        return reply

    cold = first_round("a", prompt)
    assert cold.batch_tokens == 100 and cold.cached_tokens == 0  # 99 prompt tokens + the root
    warm = first_round("b", prompt)
    assert warm.batch_tokens == 100 - 96 and warm.bonus_token_id == cold.bonus_token_id
    assert warm.cache_len == cold.cache_len == 100 and warm.cached_tokens == 96


def test_a_context_is_kept_once_forwarded_and_a_failed_session_is_not(pair, monkeypatch):
    """A new session's context is kept right after its first round (a session starting
    meanwhile with it finds it); a session dropped after a failed forward is not kept again
    (its cache may be half written); one evicted or ended is."""
    from schemas import ErrorCode, ErrorReply

    _, t_eng = engines(pair, gb=0.01, block=8)
    cache, kept = t_eng.prefix_cache, []
    put = cache.put
    monkeypatch.setattr(cache, "put", lambda tokens, kv, pp=0: kept.append(len(tokens)) or put(tokens, kv, pp))
    prompt = list(range(50))
    cur = SessionCursor(list(prompt), prompt_len=len(prompt))
    first = t_eng.handle(VerifyRequest(session_id="a", round=0, sync=cur.target_sync(), tree=root_only(prompt[-1])))
    assert kept == [50] and cache.match(prompt, 49)[1] == 48  # the prompt and its root, at once
    cur.apply_verify(first)
    forward = t_eng.forward

    def failing(*args, **kwargs):
        raise RuntimeError("a forward that fails")

    t_eng.forward = failing
    reply = t_eng.handle(VerifyRequest(session_id="a", round=1, sync=cur.target_sync(),
                                       tree=root_only(cur.committed[-1])))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.INTERNAL and "a" not in t_eng.store
    assert kept == [50]  # dropped: not kept again
    t_eng.forward = forward
    fresh = SessionCursor(list(prompt), prompt_len=len(prompt)).target_sync()
    again = t_eng.handle(VerifyRequest(session_id="b", round=0, sync=fresh, tree=root_only(prompt[-1])))
    assert again.cached_tokens == 48 and len(kept) == 2
    t_eng.store.evict_oldest()  # evicted (LRU, TTL): kept
    assert len(kept) == 3 and len(cache) == 1


def test_sampling_with_a_cached_prefix_draws_what_it_draws_without(pair):
    """A seeded sampled answer is the same from a cached prefix (float32: the copied K/V equal
    what the forward computed, up to its rounding, which these draws do not meet)."""
    sampling = SamplingSpec(temperature=0.9, seed=5)
    prompt = [random.Random(2).randrange(128) for _ in range(80)]
    d0, t0 = engines(pair, gb=0.0)
    want = run(d0, t0, "cold", prompt, 20, sampling=sampling)
    d_eng, t_eng = engines(pair, gb=0.01)
    run(d_eng, t_eng, "first", prompt + [1, 2, 3], 4, sampling=sampling)
    assert run(d_eng, t_eng, "second", prompt, 20, sampling=sampling) == want
    assert t_eng.prefix_cache.hits == 1


def test_an_int8_target_reuses_only_what_its_own_prefill_computes_the_same_way():
    """The int8 target prefills a prompt longer than a chunk on its prompt attention, in chunks
    from position 0, and everything else on its decoding path, whose bits differ: a cached
    prefix is reused only where the new session's own prefill computes the same bits. Each
    session's cache and tokens then equal, bit for bit, those of a target with no prefix cache."""
    from specsplit.models.int8 import int8_supported, quantize_int8

    if not int8_supported():
        pytest.skip("torch's fbgemm int8 kernels need an x86 CPU build")
    model = quantize_int8(tiny_model("qwen2", seed=5))

    def target(gb: float) -> TargetEngine:
        eng = TargetEngine(model, EngineLimits(max_sessions=8, max_session_tokens=256, cache_chunk=8,
                                               prefix_cache_gb=gb))
        eng.linear_chunk = 16
        return eng

    cached, plain = target(0.01), target(0.0)

    def decode(eng: TargetEngine, sid: str, prompt: list[int]):
        cur = SessionCursor(list(prompt), prompt_len=len(prompt))
        for rnd in range(10):
            cur.apply_verify(eng.handle(VerifyRequest(session_id=sid, round=rnd, sync=cur.target_sync(),
                                                      tree=root_only(cur.committed[-1]))))
        kv = eng.store.get(sid).kv
        held = [(layer.keys.clone(), layer.values.clone()) for layer in kv.layers]
        eng.handle(EndSession(session_id=sid))
        return cur.committed, held

    def same(sid: str, prompt: list[int]) -> int:
        """Decode ``prompt`` on both targets; the tokens the cached one reused."""
        before = cached.prefix_cache.reused_tokens
        (tokens, kv), (want, kv_want) = decode(cached, sid, prompt), decode(plain, sid, prompt)
        assert tokens == want
        for (k, v), (k2, v2) in zip(kv, kv_want):
            assert torch.equal(k, k2) and torch.equal(v, v2)
        return cached.prefix_cache.reused_tokens - before

    rng = random.Random(8)
    long = [rng.randrange(128) for _ in range(41)]  # 40 tokens before the root: prompt attention
    short = [rng.randrange(128) for _ in range(15)]  # one chunk or less: the decoding path
    assert same("long", long) == 0
    assert same("longer", long + [rng.randrange(128) for _ in range(20)]) == 32  # whole chunks of its prompt path
    assert same("short-after-long", long[:15]) == 0  # the decoding path: not from prompt-path positions
    assert same("short", short) == 0
    assert same("short-again", short[:12] + [1, 2, 3]) == 8  # decoding path both: every whole block
    assert same("long-after-short", short + [rng.randrange(128) for _ in range(30)]) == 0


def test_a_long_context_with_specpv_reuses_and_stays_exact(pair):
    """SpecPV's exact mode on a session started from a cached prefix: its partial view is built
    from the copied cache, its provisional tokens are not kept as the session's, and the answer
    is the target's greedy decoding (a view over a cache of another context would show)."""
    from schemas import SpecPVSpec
    from specsplit.orchestrator.state import RoundStats

    spec = SpecPVSpec(block_size=16, sink_blocks=1, retrieval_blocks=2, window_blocks=1, buffer_tokens=32,
                      threshold=256, refresh_every=4)
    d_eng, t_eng = engines(pair, gb=0.05)
    rng = random.Random(6)
    context = [rng.randrange(128) for _ in range(400)]
    for turn in range(2):
        want, gap = greedy_cached(pair[1], context, 30)
        assert gap > 1e-3
        stats = RoundStats()
        got = run(d_eng, t_eng, f"long{turn}", context, 30, specpv=spec, stats=stats)
        assert got == want and stats.partial_rounds > 0
        context = context + got + [rng.randrange(128) for _ in range(20)]
    assert t_eng.prefix_cache.hits == 1 and t_eng.prefix_cache.reused_tokens >= 384


def test_usage_counts_each_prompts_cached_tokens_once():
    """OpenAI's usage: a prompt's cached tokens once however many choices it has (the most any
    of them had: n choices are n sessions, which may start before another one left)."""
    from specsplit.api.generation import Done
    from specsplit.api.server import usage

    done = {0: Done(0, "", "length", 0, 100, 5, {}, 64), 1: Done(1, "", "length", 0, 100, 5, {}, 0),
            2: Done(2, "", "stop", 1, 50, 3, {}, 0)}
    assert usage(done) == {"prompt_tokens": 150, "completion_tokens": 13, "total_tokens": 163,
                           "prompt_tokens_details": {"cached_tokens": 64}}


def test_sessions_verified_in_one_forward_are_kept_and_answer_as_alone(pair):
    """Two new sessions verified in one batched forward: both contexts are kept at once, and a
    third session with one of them copies it; every reply is what verifying alone gives."""
    _, t_eng = engines(pair, gb=0.01)
    _, plain = engines(pair, gb=0.0)
    rng = random.Random(3)
    prompts = [[rng.randrange(128) for _ in range(70)] for _ in range(2)]

    batch = t_eng.verify_batch([request("x", prompts[0]), request("y", prompts[1])])
    assert [r.batch_size for r in batch] == [2, 2] and len(t_eng.prefix_cache) == 2
    third = t_eng.handle(request("z", prompts[1]))
    assert third.cached_tokens == 64
    for reply, prompt in zip([*batch, third], [*prompts, prompts[1]]):
        alone = plain.handle(request("alone", prompt))
        plain.handle(EndSession(session_id="alone"))
        assert (reply.bonus_token_id, reply.cache_len) == (alone.bonus_token_id, alone.cache_len)


def test_a_failed_batched_forward_verifies_each_alone_from_its_prefix_again(pair):
    """When the batched forward fails (not the device), each member is verified alone from its
    request: its cached prefix copied again, its reply what verifying alone gives."""
    _, t_eng = engines(pair, gb=0.01)
    _, plain = engines(pair, gb=0.0)
    rng = random.Random(5)
    prompts = [[rng.randrange(128) for _ in range(80)] for _ in range(2)]

    for i, p in enumerate(prompts):  # both contexts cached
        t_eng.handle(request(f"seed{i}", p))

    def failing(segments):
        raise RuntimeError("a batched forward that fails")

    t_eng.forward_segments = failing
    replies = t_eng.verify_batch([request("x", prompts[0]), request("y", prompts[1])])
    for reply, prompt in zip(replies, prompts):
        alone = plain.handle(request("alone", prompt))
        plain.handle(EndSession(session_id="alone"))
        assert reply.cached_tokens == 64 and reply.batch_size == 1
        assert (reply.bonus_token_id, reply.cache_len) == (alone.bonus_token_id, alone.cache_len)
