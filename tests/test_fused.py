"""The graphs' fused decoder body (``specsplit.engine.fused``, issue 45): the same model in fewer
kernels. tests/test_graphs.py runs the graphs' oracles through it (the default body); here: it
runs far fewer operations a layer than the model's modules, its fused weights are the modules'
own memory (the eager path unchanged, nothing stored twice), in bf16 it is as close to a float32
reference as the modules are, and models it does not run keep the modules' body."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

from specsplit.bench.opcount import ops_per_layer
from specsplit.engine.fused import FusedDecoder, build
from specsplit.engine.graphs import GraphRunner
from specsplit.engine.kvpool import KVPool, pool_shape
from tests.conftest import DEVICE_PARAMS, FAMILIES, on_device, tiny_model


def runner(model, body: str, device, slots: int = 2, max_len: int = 600) -> GraphRunner:
    dtype = next(model.parameters()).dtype
    pool = KVPool(pool_shape(model, max_len, dtype), slots, torch.device(device), scratch=True)
    return GraphRunner(model, pool, model.config.vocab_size, "static", body=body)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_body_runs_far_fewer_operations_a_layer(family, dtype):
    """Operations a decoder layer adds to one forward (a 4-layer model's count less a 2-layer
    one's, halved), for one session's token and for 4 sessions x 16: the fused body needs at most
    two thirds of the modules' (on CUDA, where RMSNorm is one kernel, under half: ~17 vs ~48),
    through the Triton kernels fewer again (on CUDA ~9 a layer), and with their GEMMs six (seven
    on CUDA where attention's keys are split and merged)."""
    for b, t in ((1, 1), (4, 16)):
        per_layer = {body: ops_per_layer(lambda n: tiny_model(family, layers=n).to(dtype), body, b, t)[0]
                     for body in ("triton_gemm", "triton", "fused", "transformers")}
        assert per_layer["fused"] <= 2 / 3 * per_layer["transformers"], (b, t, per_layer)
        assert per_layer["fused"] <= (42 if family == "qwen3" else 34), (b, t, per_layer)
        # the Triton body: the rotation, K/V writes, attention and SiLU x up in 3 launches where the
        # torch operations take 9 or more (12 in bf16); the rest (RMSNorm, GEMMs) the same
        assert per_layer["triton"] <= per_layer["fused"] - (6 if dtype == torch.float32 else 9), (b, t, per_layer)
        # and its GEMMs: q/k/v with the input norm, the rotation, attention, o adding the residual,
        # gate/up with the second norm, down with SiLU x up adding the residual
        assert per_layer["triton_gemm"] == 6, (b, t, per_layer)


def test_fused_weights_are_the_modules_memory():
    """Building the body stores nothing twice (q/k/v and gate/up become views of the fused
    tensors), leaves the model's own forward bit for bit as it was, and a second build (another
    engine on the same model) reuses the same tensors."""
    model = tiny_model("qwen2")
    ids = torch.tensor([[5, 9, 3, 77, 12]])
    with torch.no_grad():
        before = model(ids).logits
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = model.model.layers
    replaced = [weakref.ref(layers[1].mlp.up_proj.weight), weakref.ref(layers[0].self_attn.k_proj.bias)]
    first = runner(model, "fused", "cpu").fused
    gc.collect()
    assert [r() for r in replaced] == [None, None]  # the modules' old tensors are gone, not kept beside
    second = runner(model, "fused", "cpu").fused
    attn = model.model.layers[0].self_attn
    for fused in (first, second):
        layer = fused.layers[0]
        assert layer.qkv.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
        assert layer.qkv_bias.untyped_storage().data_ptr() == attn.v_proj.bias.untyped_storage().data_ptr()
        torch.testing.assert_close(layer.qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                                   rtol=0, atol=0)
    assert second.layers[1].gate_up.data_ptr() == first.layers[1].gate_up.data_ptr()
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == nbytes
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_in_bf16_the_fused_body_is_as_close_to_float32_as_the_modules(family, device):
    """bf16 logits of a tree over a cached prompt, from both bodies, against the float32 model's:
    the fused body's largest error is within 1.5x the modules' (and small). On CUDA this takes the
    float32-scores matmul path (``out_dtype``) where the device has it."""
    rng = random.Random(7)
    reference = tiny_model(family)
    low = on_device(tiny_model(family).to(torch.bfloat16), device)
    prompt = [rng.randrange(128) for _ in range(300)]
    tree = [rng.randrange(128) for _ in range(12)]
    parents = [-1, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8]
    depth = [0] * len(parents)
    for i, p in enumerate(parents[1:], 1):
        depth[i] = depth[p] + 1
    visible = torch.zeros(len(tree), len(tree), dtype=torch.bool)
    for i, p in enumerate(parents):
        visible[i, i] = True
        if p >= 0:
            visible[i] |= visible[p]
    ids = torch.tensor([prompt + tree])
    pos = torch.tensor([list(range(len(prompt))) + [len(prompt) + d for d in depth]])
    mask = torch.ones(len(prompt) + len(tree), len(prompt) + len(tree), dtype=torch.bool).tril()
    mask[len(prompt):, len(prompt):] = visible
    with torch.no_grad():
        want = reference(ids, position_ids=pos, attention_mask=mask[None, None]).logits[0, len(prompt):]
    errors = {}
    for body in ("fused", "transformers"):
        run = runner(low, body, device)
        with torch.no_grad():  # the prompt through the model into slot 0, then the tree through the body
            kv = run.pool.make_kv()
            low(torch.tensor([prompt], device=device), past_key_values=kv, use_cache=True)
            b, t, keys = 1, 16, 512
            inp = run._buffers(b, t, False)
            inp.meta.zero_()
            inp.meta[0, : len(tree)] = torch.tensor(tree)
            inp.meta[0, t: t + len(tree)] = pos[0, len(prompt):]
            inp.meta[0, 2 * t], inp.meta[0, 2 * t + 1] = kv.slot, len(prompt)
            inp.vis.zero_()
            inp.vis[0, : len(tree), : len(prompt) + len(tree)] = mask[len(prompt):].to(device)
            run._body(inp, b, t, keys, False)
        got = inp.logits[0, : len(tree)].float().cpu()
        errors[body] = (got - want).abs().max().item()
    assert errors["fused"] <= 1.5 * errors["transformers"] + 1e-3, errors
    assert errors["fused"] < 0.1 * want.abs().max().item(), errors


def test_models_the_body_does_not_run_keep_the_modules():
    """A quantized model (Linear layers that are not nn.Linear) and another architecture: no
    fused body, with the reason; the runner then runs the modules."""
    from specsplit.models.int8 import int8_supported, quantize_int8

    if int8_supported():
        quantized = quantize_int8(tiny_model("qwen2"))  # the int8 target as a CPU worker runs it
        fused, why = build(quantized, runner(tiny_model("qwen2"), "transformers", "cpu").pool)
        assert fused is None and ("attention" in why or "nn.Linear" in why), why
        quantized.config._attn_implementation = "sdpa"  # its projections alone rule it out too
        fused, why = build(quantized, runner(tiny_model("qwen2"), "transformers", "cpu").pool)
        assert fused is None and "nn.Linear" in why, why
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2)).eval()
    pool = KVPool(pool_shape(gpt2, 64, torch.float32), 1, torch.device("cpu"), scratch=True)
    fused, why = build(gpt2, pool)
    assert fused is None and "gpt2" in why
    run = GraphRunner(gpt2, pool, 128, "static")
    assert run.fused is None and run.describe()["body"] == "transformers"
    assert isinstance(runner(tiny_model("llama"), "fused", "cpu").fused, FusedDecoder)


def test_a_fused_body_that_miscomputes_here_keeps_the_modules(monkeypatch):
    """At start the fused body's torch operations check one forward against the model's own
    modules on the pool's scratch slot: a body that agrees serves; one that miscomputes on this
    device (here: the MLP left out) or fails leaves the modules' body, with the reason, and the
    graphs' forwards still equal the eager forward's."""
    import specsplit.engine.fused as fused_module

    model = tiny_model("qwen2", seed=3)
    assert runner(model, "fused", "cpu").body == "fused"
    monkeypatch.setattr(fused_module.FusedDecoder, "_rest_of_layer",
                        lambda self, x, out, lay: torch.addmm(x, out, lay.o.t()))
    fallen = runner(model, "fused", "cpu")
    assert fallen.body == "transformers" and fallen.fused is None and "differ" in fallen.fused_not
    assert "modules" in fallen.fused_not
    monkeypatch.setattr(fused_module.FusedDecoder, "_embed", lambda *a: (_ for _ in ()).throw(RuntimeError("no")))
    fallen = runner(model, "triton", "cpu")
    assert fallen.body == "transformers" and "failed" in fallen.fused_not
    # an engine whose fused body fell back serves through the modules' graphs, as the eager forward
    from specsplit.engine.masks import causal
    from specsplit.engine.target import TargetEngine
    from tests.test_graphs import LIMITS, graphed

    eager, fast = (TargetEngine(model, graphed(LIMITS, model, 1, mode)) for mode in ("off", "static"))
    assert fast.graphs.body == "transformers" and eager.graphs is None
    prompt, tokens = list(range(3, 40)), [5, 7, 11]
    out = []
    for engine in (eager, fast):
        kv = engine.store.get_or_create("s").kv
        engine.forward_linear(kv, prompt)
        pos = torch.arange(len(prompt), len(prompt) + 3)
        out.append(engine.forward(kv, tokens, pos, causal(3, len(prompt), torch.device("cpu")), keep=3))
    assert fast.graphs.served == 2  # the prompt and the three tokens
    torch.testing.assert_close(out[1], out[0], rtol=1e-4, atol=1e-4)
