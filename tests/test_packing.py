"""Prepacked oneDNN Linear weights: bit-identical logits in bf16, and nothing packed elsewhere."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from schemas import SamplingSpec, TreeSpec
from specsplit.local import generate
from specsplit.models.packing import PackedLinear, pack_linear_weights, packing_supported
from specsplit.engine.base import model_vocab_size
from tests.conftest import FAMILIES, tiny_model

needs_packing = pytest.mark.skipif(
    not packing_supported(), reason="this CPU/torch build cannot pack bf16 weights (oneDNN needs AVX512 or AVX-NE-CONVERT)")


def _linears(model) -> int:
    return sum(type(m) is torch.nn.Linear for m in model.modules())


@needs_packing
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_bf16_logits_are_bit_identical(family):
    plain = tiny_model(family, seed=3).to(torch.bfloat16)
    n_linear = _linears(plain)
    packed = copy.deepcopy(plain)
    assert pack_linear_weights(packed) == n_linear
    assert _linears(packed) == 0 and sum(isinstance(m, PackedLinear) for m in packed.modules()) == n_linear
    assert model_vocab_size(packed) == model_vocab_size(plain) == 128
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in (1, 5, 37):  # decode-, tree- and prefill-sized batches
            ids = torch.randint(0, 128, (1, t), generator=g)
            a, b = plain(input_ids=ids).logits, packed(input_ids=ids).logits
            assert torch.equal(a, b), (family, t, (a.float() - b.float()).abs().max().item())


@needs_packing
def test_packed_bf16_target_generates_the_same_tokens():
    target = tiny_model("qwen2", seed=0).to(torch.bfloat16)
    draft = tiny_model("qwen2", seed=1).to(torch.bfloat16)
    packed = copy.deepcopy(target)
    assert pack_linear_weights(packed) > 0
    rng = random.Random(7)
    tree = TreeSpec(max_nodes=12, max_depth=4, branch=3)
    for _ in range(4):
        prompt = [rng.randrange(128) for _ in range(rng.randrange(2, 20))]
        kw = dict(max_new_tokens=20, tree=tree, sampling=SamplingSpec())
        assert generate(draft, packed, prompt, **kw) == generate(draft, target, prompt, **kw)


def test_fp32_and_quantized_models_are_left_alone():
    fp32 = tiny_model("llama", seed=0)
    before = {k: v.clone() for k, v in fp32.state_dict().items()}
    assert pack_linear_weights(fp32) == 0
    assert _linears(fp32) > 0 and all(torch.equal(before[k], v) for k, v in fp32.state_dict().items())
    int8 = torch.ao.quantization.quantize_dynamic(tiny_model("llama", seed=0), {torch.nn.Linear}, dtype=torch.qint8)
    assert pack_linear_weights(int8) == 0
    head = int8.get_output_embeddings()
    head.weight = lambda: pytest.fail("unpacked the int8 head")  # ~0.8 s for a 150K-token vocabulary
    assert model_vocab_size(int8) == 128


def test_unsupported_cpu_leaves_the_model_alone():
    """Where the CPU cannot pack, packing is a no-op (the self-check refuses), never an error."""
    model = tiny_model("qwen2", seed=0).to(torch.bfloat16)
    n = pack_linear_weights(model)
    assert n == (_linears(tiny_model("qwen2", seed=0)) if packing_supported() else 0)
    assert _linears(model) == (0 if n else _linears(tiny_model("qwen2", seed=0)))
