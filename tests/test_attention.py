"""gqa_attention (grouped-query attention without repeat_kv) computes what transformers' sdpa
attention computes, for every query count (grouped matmul up to SMALL_QUERY, sdpa with
enable_gqa above), every mask kind, and inside a whole model; the CPU backend gives it to drafts."""

import copy

import pytest
import torch

from specsplit.models.attention import GQA_ATTENTION, SMALL_QUERY, gqa_attention, use_gqa_attention
from tests.conftest import tiny_model


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.training = False


@pytest.mark.parametrize("m", [1, 3, SMALL_QUERY, SMALL_QUERY + 1, 64])
@pytest.mark.parametrize("mask_kind", ["float", "bool", "none"])
def test_gqa_attention_equals_sdpa(m, mask_kind):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(m)
    hq, hkv, d, cached = 8, 2, 16, 40
    length = cached + m
    q = torch.randn(1, hq, m, d, generator=g)
    k, v = torch.randn(1, hkv, length, d, generator=g), torch.randn(1, hkv, length, d, generator=g)
    visible = torch.rand(m, length, generator=g) > 0.3
    visible[:, 0] = True  # every row sees something
    if mask_kind == "float":
        mask = torch.zeros(m, length).masked_fill_(~visible, torch.finfo(torch.float32).min)[None, None]
    elif mask_kind == "bool":
        mask = visible[None, None]
    else:
        mask = None
    module = _Module(hq // hkv)
    ours, _ = gqa_attention(module, q, k, v, mask, scaling=d ** -0.5)
    causal = torch.ones(m, length, dtype=torch.bool).tril(cached)[None, None]  # queries after the cache
    ref, _ = sdpa_attention_forward(module, q, k, v, causal if mask is None else mask, scaling=d ** -0.5)
    assert ours.shape == ref.shape == (1, m, hq, d)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5), (ours - ref).abs().max()


def test_model_on_gqa_attention_matches_sdpa_logits():
    from specsplit.engine.kvcache import SessionKV
    from specsplit.engine.masks import additive_mask, linear_then_tree

    sdpa = tiny_model("qwen2", seed=3)
    gqa = copy.deepcopy(sdpa)
    assert use_gqa_attention(gqa) and gqa.config._attn_implementation == GQA_ATTENTION
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    parents = [-1, 0, 0, 1, 1, 2]  # a branching tree on top of a 24-token prefix
    vis = linear_then_tree(24, parents, torch.device("cpu"))
    pos = torch.tensor([list(range(24)) + [24 + d for d in (0, 1, 1, 2, 2, 2)]])
    outs = []
    for model in (sdpa, gqa):
        with torch.no_grad():
            kv = SessionKV(model.config.num_hidden_layers, 64)
            outs.append(model(input_ids=ids, position_ids=pos, attention_mask=additive_mask(vis, torch.float32),
                              past_key_values=kv, use_cache=True).logits)
    assert torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))


def test_cpu_backend_gives_drafts_gqa_attention_and_targets_not():
    from specsplit.backends import CpuBackend

    draft = CpuBackend(threads=1, prefill_threads=1, pack_weights=False, batch_invariant=False)
    model = draft.prepare(tiny_model("llama", seed=1))
    assert model.config._attn_implementation == GQA_ATTENTION and draft.describe()["gqa_attention"]
    target = CpuBackend(threads=1, prefill_threads=1, pack_weights=False, batch_invariant=True)
    assert target.prepare(tiny_model("llama", seed=1)).config._attn_implementation == "sdpa"
    mha = tiny_model("llama", seed=1)
    mha.config.num_key_value_heads = mha.config.num_attention_heads  # no grouped heads: nothing to gain
    assert not use_gqa_attention(mha)
