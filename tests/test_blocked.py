"""The blocked float32 attention (``specsplit.models.blocked``): every row equals, bit for bit,
what a decoding step at its position computes, and all of them agree with float64 attention."""

from __future__ import annotations

import pytest
import torch

from specsplit.engine.masks import SlidingWindows, TreeInputs, additive_mask, linear_then_tree
from specsplit.models.attention import grouped_attention
from specsplit.models.blocked import BLOCK, SHORT, blocked_attention, invariance_holds

SHAPES = [(4, 2, 16), (6, 1, 32), (3, 3, 8), (12, 2, 128)]  # query heads, KV heads, head dim


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def forward(q, k, v, committed: int, n_linear: int, parents: list[int]) -> torch.Tensor:
    """One forward of n_linear chained tokens then a tree on ``committed`` cached keys: [m, Hq, D]."""
    m = n_linear + len(parents)
    vis = torch.ones(m, committed + m, dtype=torch.bool)
    vis[:, committed:] = linear_then_tree(n_linear, parents, torch.device("cpu"))
    return blocked_attention(None, q[None], k[None], v[None], additive_mask(vis, torch.float32))[0][0], vis


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_row_of_a_forward_equals_the_decoding_step_at_its_position(shape, threads):
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(sum(shape) + threads)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # short contexts (float64), across SHORT (rows split), across block boundaries, far above them
        for committed in (0, 5, SHORT - 7, SHORT + BLOCK - 3, SHORT + 2 * BLOCK + 60, SHORT + 5 * BLOCK):
            n_linear = int(torch.randint(0, 4, (1,), generator=gen))
            parents = random_parents(int(torch.randint(1, 20, (1,), generator=gen)), gen)
            m = n_linear + len(parents)
            k = torch.randn(kv_heads, committed + m, dim, generator=gen)
            v = torch.randn(kv_heads, committed + m, dim, generator=gen)
            q = torch.randn(heads, m, dim, generator=gen)
            rows, vis = forward(q, k, v, committed, n_linear, parents)
            for i in range(m):  # the keys row i sees, in position order, as a decoding step's cache
                idx = vis[i].nonzero().view(-1)
                one = blocked_attention(None, q[None, :, i:i + 1], k[None][:, :, idx], v[None][:, :, idx], None)[0]
                assert torch.equal(one[0, 0], rows[i]), (committed, n_linear, parents, i)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("extra", ["", "softcap", "sinks"])
@pytest.mark.parametrize("window", [40, SHORT + BLOCK + 5, 1 << 20])  # every row short; far keys from a window; none
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_under_a_sliding_window_every_row_equals_the_decoding_step_at_its_position(shape, window, extra):
    """A sliding-window layer's rows (a key at position k hidden from a query at q once
    q - k >= window), plain, with Gemma 2's softcapped scores or with gpt-oss's attention sinks:
    a tree's rows equal a decoding step at their positions, whose cache holds every earlier key
    and hides the old ones, and agree with float64 attention."""
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(window + dim)
    kw = {"softcap": {"softcap": 2.0}, "sinks": {"s_aux": torch.randn(heads, generator=gen) * 3}, "": {}}[extra]
    sliding = SlidingWindows(window, per_layer=False)
    edge = min(window, SHORT + 2 * BLOCK)
    for committed in (5, edge - 3, SHORT + 2 * BLOCK + 60, SHORT + 5 * BLOCK, edge + 3 * BLOCK + 7):
        n_linear = int(torch.randint(0, 4, (1,), generator=gen))
        parents = random_parents(int(torch.randint(1, 20, (1,), generator=gen)), gen)
        m = n_linear + len(parents)
        depths = [0] * len(parents)
        for i, parent in enumerate(parents[1:], 1):
            depths[i] = depths[parent] + 1
        inputs = TreeInputs(committed, n_linear, parents, depths)
        vis, pos = inputs.on_device(torch.device("cpu"))
        k = torch.randn(kv_heads, committed + m, dim, generator=gen)
        v = torch.randn(kv_heads, committed + m, dim, generator=gen)
        q = torch.randn(heads, m, dim, generator=gen)
        mask = sliding.mask(vis, pos, committed, torch.float32)
        rows = blocked_attention(None, q[None], k[None], v[None], mask, **kw)[0][0]
        want = grouped_attention(q[None], k[None], v[None], mask, None, torch.float64, softcap=kw.get("softcap"),
                                 sinks=kw.get("s_aux"))[0]
        torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-6)
        for i in range(m):  # a decoding step: keys at positions 0..p, the oldest hidden by the window
            idx = vis[i].nonzero().view(-1)
            p = int(pos[i])
            assert len(idx) == p + 1
            step = (p - torch.arange(p + 1) < window)[None]  # [1, p + 1]
            one = blocked_attention(None, q[None, :, i:i + 1], k[None][:, :, idx], v[None][:, :, idx],
                                    additive_mask(step, torch.float32), **kw)[0]
            assert torch.equal(one[0, 0], rows[i]), (committed, n_linear, parents, i)


@pytest.mark.parametrize("shape", SHAPES)
def test_blocked_attention_agrees_with_float64_attention(shape):
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(3)
    for committed, n_linear, parents in ((0, 0, [-1, 0, 0, 1]), (SHORT + 300, 2, [-1, 0, 1, 1, 0, 4]),
                                         (SHORT - 3, 6, [-1, 0, 0]),  # rows on both sides of SHORT
                                         (SHORT + 2 * BLOCK - 1, 0, list(range(-1, 12)))):
        m = n_linear + len(parents)
        k = torch.randn(2, kv_heads, committed + m, dim, generator=gen)  # a batch of two
        v = torch.randn(2, kv_heads, committed + m, dim, generator=gen)
        q = torch.randn(2, heads, m, dim, generator=gen)
        vis = torch.ones(m, committed + m, dtype=torch.bool)
        vis[:, committed:] = linear_then_tree(n_linear, parents, torch.device("cpu"))
        mask = additive_mask(vis, torch.float32)
        got = blocked_attention(None, q, k, v, mask)[0]
        want = grouped_attention(q, k, v, mask, None, torch.float64)
        assert got.shape == want.shape == (2, m, heads, dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        causal = blocked_attention(None, q, k, v, None)[0]  # no mask: causal on the cache
        torch.testing.assert_close(causal, grouped_attention(q, k, v, None, None, torch.float64), rtol=1e-5, atol=1e-6)


def test_a_row_whose_far_keys_are_not_a_visible_prefix_is_refused():
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, SHORT + 400, 16), torch.randn(1, 2, SHORT + 400, 16)
    vis = torch.ones(1, SHORT + 400, dtype=torch.bool)
    vis[0, 10] = False  # a hole far below the row's position
    with pytest.raises(ValueError, match="visible prefix"):
        blocked_attention(None, q, k, v, additive_mask(vis, torch.float32))


def test_the_check_a_model_is_switched_on_passes_here():
    """The start-up check behind ``use_invariant_attention`` holds on this machine for the real
    target's shapes (Qwen2.5 1.5B: 12 query heads on 2 KV heads of 128) on 1 and 2 threads."""
    assert invariance_holds(12, 2, 128, (1, 2))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_int8_target_tree_logits_equal_decoding_steps_past_a_thousand_tokens():
    """Real weights (SmolLM2-135M, int8 as a target runs it; 9 query heads on 3 KV heads, so a
    decoding step's 3 rows are padded): a 16-node tree verified at 1530 cached tokens (past
    SHORT, straddling the block edge at 1536, on 2 threads) gives every node bit-for-bit the
    logits that decoding its path one token at a time gives (1 thread)."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, DynamicCache

    from specsplit.engine.masks import tree_visibility
    from specsplit.models.blocked import BLOCKED_ATTENTION
    from specsplit.models.int8 import int8_supported, quantize_int8

    if not int8_supported():
        pytest.skip("torch's fbgemm int8 kernels need an x86 CPU build")
    out = subprocess.run([sys.executable, "-m", "specsplit", "models", "path", "smollm2"], capture_output=True,
                         text=True, timeout=900, check=True)
    model = AutoModelForCausalLM.from_pretrained(json.loads(out.stdout)["target"], dtype=torch.float32)
    model = quantize_int8(model).eval()
    assert model.config._attn_implementation == BLOCKED_ATTENTION
    gen = torch.Generator().manual_seed(5)
    committed = 1530
    prompt = torch.randint(100, 20000, (1, committed), generator=gen)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 6, 7, 9, 10, 12]
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    tokens = torch.randint(100, 20000, (1, len(parents)), generator=gen)
    saved = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(2)
            cache = DynamicCache()
            for a in range(0, committed, 512):
                model(input_ids=prompt[:, a:a + 512], past_key_values=cache, use_cache=True)
            vis = torch.ones(len(parents), committed + len(parents), dtype=torch.bool)
            vis[:, committed:] = tree_visibility(parents, torch.device("cpu"))
            tree = model(input_ids=tokens, position_ids=torch.tensor([[committed + d for d in depth]]),
                         attention_mask=additive_mask(vis, torch.float32), past_key_values=cache,
                         use_cache=True).logits[0]
            torch.set_num_threads(1)
            for i in range(len(parents)):
                cache.crop(committed - cache.get_seq_length())  # transformers: a negative count to drop
                path = [i]
                while parents[path[-1]] >= 0:
                    path.append(parents[path[-1]])
                for k, node in enumerate(reversed(path)):
                    logits = model(input_ids=tokens[:, node:node + 1], position_ids=torch.tensor([[committed + k]]),
                                   past_key_values=cache, use_cache=True).logits[0, -1]
                assert torch.equal(logits, tree[i]), (i, float((logits - tree[i]).abs().max()))
    finally:
        torch.set_num_threads(saved)


def test_a_batched_forwards_masks_each_get_their_plan_once_and_leave_with_their_mask(monkeypatch):
    """A batched forward calls every layer once per session with that session's mask: each
    mask's plan is computed once for all layers (not again whenever another session's mask came
    in between), the results are those of computing it every time, and a plan leaves the memo
    when its mask is collected."""
    import gc

    import specsplit.models.blocked as blocked

    gen = torch.Generator().manual_seed(3)
    calls = []
    visible = blocked._visible
    monkeypatch.setattr(blocked, "_visible", lambda *a: calls.append(1) or visible(*a))
    sessions = []
    for committed, n in ((5, 3), (SHORT + BLOCK + 9, 4), (SHORT + 3 * BLOCK, 2)):  # short, blocked, blocked
        vis = torch.ones(n, committed + n, dtype=torch.bool)
        vis[:, committed:] = linear_then_tree(0, list(range(-1, n - 1)), torch.device("cpu"))
        sessions.append((torch.randn(4, n, 16, generator=gen), torch.randn(2, committed + n, 16, generator=gen),
                         torch.randn(2, committed + n, 16, generator=gen), additive_mask(vis, torch.float32)))

    def layer():
        return [blocked_attention(None, q[None], k[None], v[None], mask)[0] for q, k, v, mask in sessions]

    first = layer()
    assert len(calls) == len(sessions)
    for _ in range(3):  # later layers: no plan computed again, the same outputs
        assert all(torch.equal(a, b) for a, b in zip(layer(), first))
    assert len(calls) == len(sessions)
    monkeypatch.setattr(blocked, "MEMO_PLANS", 1)  # the memo at its smallest: the last mask only
    blocked._memo.plans.clear()
    assert all(torch.equal(a, b) for a, b in zip(layer(), first))
    assert len(calls) == 2 * len(sessions)
    monkeypatch.setattr(blocked, "MEMO_PLANS", 1024)
    layer()
    held = len(blocked._memo.plans)
    assert held >= 1
    sessions.clear()
    gc.collect()
    assert len(blocked._memo.plans) < held and all(
        entry[0] is None or entry[0]() is not None for entry in blocked._memo.plans.values())
