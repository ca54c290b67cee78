"""The draft's window view (sinks + recent window past a long context): a windowed forward is the
forward that sees only those columns, short contexts are untouched, and generation through a
windowed draft still equals the target's plain greedy decoding (the draft only proposes)."""

import functools

import pytest
import torch

from schemas import SamplingSpec, TreeSpec
from specsplit.engine.base import EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.draftview import DraftWindow
from specsplit.engine.kvcache import SessionKV
from specsplit.engine.masks import linear_then_tree
from specsplit.local import generate
from tests.conftest import greedy_cached, perturbed, tiny_model


def test_bounds():
    w = DraftWindow(sink_tokens=4, window_tokens=16)
    assert w.bounds(20) is None and w.bounds(21) == (4, 5) and w.bounds(100) == (4, 84)
    assert DraftWindow(window_tokens=0).bounds(10_000) is None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_windowed_forward_equals_masking_the_middle(attn):
    model = tiny_model("qwen2", seed=5, attn=attn)
    limits = EngineLimits(max_session_tokens=256)
    windowed = DraftEngine(model, limits, window=DraftWindow(sink_tokens=8, window_tokens=32))
    whole = DraftEngine(model, limits, window=None)
    prompt = torch.randint(0, 128, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    parents = [-1, 0, 0, 1, 2, 2]
    tokens = [3, 5, 7, 9, 11, 13]
    pos = torch.tensor([100 + d for d in (0, 1, 1, 2, 2, 2)])
    vis = linear_then_tree(0, parents, torch.device("cpu"))
    logits = []
    for eng, hide in ((windowed, False), (whole, True), (whole, False)):
        kv = SessionKV(model.config.num_hidden_layers, 256)
        eng.forward_linear(kv, prompt, chunk=200)  # 100 tokens: within one chunk, no window yet
        visible = torch.cat([torch.ones(len(tokens), 100, dtype=torch.bool), vis], dim=1)
        if hide:
            visible[:, 8:100 - 32] = False  # what the window leaves out
        logits.append(eng.forward(kv, tokens, pos, visible, keep=len(tokens)))
        assert kv.length == 100 + len(tokens)  # the cache holds every token either way
    assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits[0], logits[2], atol=1e-3)  # the window did leave something out


def test_a_draft_on_graphs_attends_to_the_whole_cache():
    """Where the draft replays graphs (a KV pool; "static" runs the same bodies on CPU) the window
    is not applied: a long context's forwards go through the graphs, as the whole-cache draft's
    do, with its logits; without graphs the window applies."""
    from dataclasses import replace

    from specsplit.engine.kvpool import GB, pool_shape

    model = tiny_model("qwen2", seed=5)
    limits = EngineLimits(max_session_tokens=256, max_sessions=2)
    pooled = replace(limits, kv_pool_gb=3 * pool_shape(model, 256, torch.float32).slot_bytes / GB)
    window = DraftWindow(sink_tokens=8, window_tokens=32)
    graphed = DraftEngine(model, replace(pooled, graphs="static"), window=window)
    windowed = DraftEngine(model, pooled, window=window)
    whole = DraftEngine(model, limits, window=None)
    prompt = torch.randint(0, 128, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens, parents = [3, 5, 7, 9], [-1, 0, 0, 1]
    pos = torch.tensor([100 + d for d in (0, 1, 1, 2)])
    visible = torch.cat([torch.ones(len(tokens), 100, dtype=torch.bool),
                         linear_then_tree(0, parents, torch.device("cpu"))], dim=1)
    logits = []
    for eng in (graphed, windowed, whole):
        kv = eng.store.get_or_create("s").kv
        eng.forward_linear(kv, prompt, chunk=200)
        served = eng.graphs.served if eng.graphs else 0
        logits.append(eng.forward(kv, tokens, pos, visible, keep=len(tokens)))
        if eng is graphed:
            assert eng.graphs.served == served + 1  # through a bucket, not an eager windowed forward
    torch.testing.assert_close(logits[0], logits[2], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(logits[1], logits[2], atol=1e-3)  # without graphs the window applies


def test_generation_through_a_windowed_draft_equals_greedy():
    target = tiny_model("llama", seed=21)
    draft = perturbed(target, seed=22, noise=0.004)
    prompt = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    ref, gap = greedy_cached(target, prompt, 40)
    assert gap > 1e-4
    make = functools.partial(DraftEngine, window=DraftWindow(sink_tokens=16, window_tokens=64))
    for shape in (TreeSpec(max_nodes=8, max_depth=8, branch=1), TreeSpec(max_nodes=16, max_depth=5, branch=3)):
        assert generate(draft, target, prompt, max_new_tokens=40, tree=shape, sampling=SamplingSpec(),
                        make_draft_engine=make) == ref
