"""The int8 target's kernels: a token's logits do not depend on the forward that computes them,
so a quantized target's speculative output equals its own greedy decoding."""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch

from schemas import SamplingSpec, TreeSpec
from specsplit.local import generate
from specsplit.models.blocked import BLOCKED_ATTENTION
from specsplit.models.int8 import (EXACT_ROWS, KERNELS, RowInt8Linear, default_kernel,
                                   int8_supported, onednn_int8_supported, quantize_int8, row_bucket)
from tests.conftest import FAMILIES, greedy_reference, perturbed, tiny_model

pytestmark = pytest.mark.skipif(not int8_supported(), reason="torch's fbgemm int8 kernels need an x86 CPU build")


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def kernel_or_skip(kernel: str) -> str:
    if kernel == "onednn" and not onednn_int8_supported():
        pytest.skip("oneDNN has no exact int8 GEMM on this CPU (needs AMX or VNNI)")
    return kernel


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [True, False])
def test_row_int8_rows_do_not_depend_on_the_batch(bias, kernel):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200, bias=bias)
    q = RowInt8Linear(lin, kernel_or_skip(kernel))
    x = torch.randn(40, 96) * torch.logspace(-3, 3, 40)[:, None]  # rows of very different ranges
    x[7] = 0.0  # an all-zero row stays finite
    with torch.no_grad():
        torch.set_num_threads(1)
        full = q(x)
        assert torch.isfinite(full).all()
        for m in (1, 2, 3, 5, 8, 16, 33):
            for start in (0, 1, 7):
                assert torch.equal(q(x[start:start + m]), full[start:start + m]), (m, start)
        torch.set_num_threads(2)
        assert torch.equal(q(x[None]), full[None])  # other threads, a leading batch dim
        ref = lin(x)
    # per-row scales: every row is close to the float layer, however small its range
    rel = (full - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
    # fbgemm: 7-bit activations x 8-bit weights, ~1.5 % typical; oneDNN: 8-bit activations
    assert rel.max() < (0.03 if kernel == "fbgemm" else 0.015), rel.max()


@pytest.mark.parametrize("shape", [(1536, 1536), (256, 1536), (200, 96), (7, 33)])
def test_onednn_rows_do_not_depend_on_the_kernel_onednn_picks(shape):
    """oneDNN runs other kernels for other shapes (a 1-row GEMV for one token; blocked AMX/VNNI
    GEMMs for more), which apply non-unit scales in different orders: the GEMM therefore runs
    with unit scales (int32 sums converted once) and the layer scales element-wise. Every row
    count gives every row bit for bit the same result, on one thread and two."""
    kernel_or_skip("onednn")
    torch.manual_seed(1)
    n, k = shape
    q = RowInt8Linear(torch.nn.Linear(k, n), "onednn")
    x = torch.randn(40, k)
    with torch.no_grad():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = q(x)
            for m in (1, 2, 3, 5, 16, 33):
                assert torch.equal(q(x[:m]), full[:m]), (shape, threads, m)


def test_row_buckets_bound_the_gemm_shapes():
    """oneDNN caches a primitive per GEMM shape (1024 per process): the row counts a worker's
    forwards run at are bounded, so that cache fills early and a worker's RSS stays flat."""
    buckets = [row_bucket(m) for m in range(1, 4097)]
    assert all(b >= m for m, b in zip(range(1, 4097), buckets))
    assert buckets[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))  # decoding steps and trees: as they are
    assert all(b - m < 256 for m, b in zip(range(1, 4097), buckets))
    assert len(set(buckets)) <= EXACT_ROWS + 15 + 16


_WARM = """
import ctypes, sys
import torch
from specsplit.backends import CpuBackend
from specsplit.engine.base import PREFILL_TOKENS
from tests.conftest import tiny_model

backend = CpuBackend(1, 2, quantize="int8")
model = backend.prepare(tiny_model("llama", seed=0, attn="eager"))
libc = ctypes.CDLL(None)
libc.fflush(None)
print("WARMED", backend.warmed_gemms, flush=True)
with torch.no_grad():
    for t in [*range(1, 18), 31, 40, 64, 65, 100, 300, 700, 1000]:
        backend.before_forward(t)
        ids = torch.randint(0, model.config.vocab_size, (1, t))
        model(input_ids=ids, logits_to_keep=t if t <= PREFILL_TOKENS else 1)
libc.fflush(None)
print("DONE", flush=True)
"""


@pytest.mark.skipif(not onednn_int8_supported(), reason="oneDNN's exact int8 GEMM needs VNNI or AMX")
def test_a_warmed_int8_model_creates_no_gemm_primitive_while_it_serves(tmp_path):
    """``CpuBackend.prepare`` creates oneDNN's GEMM primitives for every row bucket and thread
    count its forwards run (tree-sized on 1 thread, prompts on 2, the lm_head at kept rows), so
    a serving worker's RSS does not grow as rarer batch sizes first appear (issue 15)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create"}
    out = subprocess.run([sys.executable, "-c", _WARM], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert "DONE" in out.stdout, out.stderr[-2000:]
    out = out.stdout
    before, served = out.split("WARMED", 1)
    created = [ln for ln in served.splitlines() if "create:cache_miss" in ln and ",matmul," in ln]
    assert int(served.split()[0]) > 0 and before.count(",matmul,") > 0  # warm_gemms ran, and oneDNN reports
    assert created == [], created


def test_the_exact_kernel_is_the_default_where_there_is_one():
    assert default_kernel() == ("onednn" if onednn_int8_supported() else "fbgemm")
    q = RowInt8Linear(torch.nn.Linear(8, 4))
    assert q.kernel == default_kernel()
    with pytest.raises(ValueError):
        RowInt8Linear(torch.nn.Linear(8, 4), "cublas")


def test_onednn_weights_are_symmetric_per_channel_codes_of_max_abs_over_127():
    """The packed weights hold round(w / s) clamped to [-127, 127] with s = max|w| / 127 per
    output channel (round half to even, as torch.round), and the dequantization scale is s / 127:
    read back through the GEMM with one-hot activations (row i of the output: column i's codes)."""
    from specsplit.models.int8 import _CODE_ZERO, _onednn_gemm, _onednn_weights

    kernel_or_skip("onednn")
    g = torch.Generator().manual_seed(3)
    n, k = 40, 96
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] = 0.0  # an all-zero channel: the scale's floor
    w[1] = 0.0  # a scale of exactly 1 (max |w| = 127) and codes exactly halfway: 64, 62, 0, -2
    w[1, :5] = torch.tensor([-127.0, 63.5, 62.5, -0.5, -1.5])
    want_s = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    want = torch.round(w / want_s[:, None]).clamp(-127, 127)
    dequant, packed = _onednn_weights(w)
    assert torch.equal(dequant, (want_s / 127.0).float())
    onehot = torch.full((k, k), _CODE_ZERO, dtype=torch.uint8)
    onehot.fill_diagonal_(_CODE_ZERO + 1)
    with torch.no_grad():
        got = _onednn_gemm(onehot, packed, torch.ones(n), torch.zeros(n, dtype=torch.int32))  # [K, N]
    assert torch.equal(got.t(), want)


def test_per_forward_scale_is_what_breaks_exactness():
    """The control: torch.ao's dynamic int8 (one activation scale per forward) gives a row a
    different result when another row shares its forward, which is why targets do not use it."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
    x = torch.randn(2, 96)
    x[1] *= 50
    with torch.no_grad():
        assert not torch.equal(ao(x)[:1], ao(x[:1]))
        q = RowInt8Linear(lin)
        assert torch.equal(q(x)[:1], q(x[:1]))


@pytest.mark.parametrize("threads", [1, 4])
def test_a_draft_quantized_layers_side_by_side_equals_torch_ao_on_the_whole_model(threads):
    """A draft's layers are quantized on the caller's threads, side by side: every layer's int8
    weights, scales and the logits equal torch.ao's dynamic int8 of the whole float32 model."""
    model = tiny_model("qwen2", seed=4)
    want = copy.deepcopy(model).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = torch.ao.quantization.quantize_dynamic(want, {torch.nn.Linear}, dtype=torch.qint8)
    torch.set_num_threads(threads)
    got = quantize_int8(model, batch_invariant=False)
    pairs = [(n, m, dict(want.named_modules())[n]) for n, m in got.named_modules()
             if type(m).__name__ == "Linear" and "dynamic" in type(m).__module__]
    assert len(pairs) == sum(1 for _, m in want.named_modules() if "dynamic" in type(m).__module__) > 4
    for name, a, b in pairs:
        (wa, ba), (wb, bb) = a._weight_bias(), b._weight_bias()
        assert torch.equal(wa.int_repr(), wb.int_repr()) and wa.q_scale() == wb.q_scale(), name
        assert (ba is None and bb is None) or torch.equal(ba, bb), name
    ids = torch.tensor([[3, 17, 5, 9, 11, 2]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


@pytest.mark.parametrize("total,prefix", [(40, 25), (1200, 1100)])  # short contexts; past blocked.SHORT
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_int8_logits_match_between_prefill_decode_and_tree_forwards(family, kernel, total, prefix):
    model = quantize_int8(tiny_model(family, seed=5), kernel=kernel_or_skip(kernel))
    assert model.config._attn_implementation == BLOCKED_ATTENTION  # this machine passes its check
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    ids = torch.randint(0, 128, (1, total), generator=torch.Generator().manual_seed(1))
    from transformers import DynamicCache

    with torch.no_grad():
        torch.set_num_threads(2)  # prompts prefill on every core, trees on one
        full = model(ids).logits[0]
        cache = DynamicCache()
        parts = [model(ids[:, :prefix], past_key_values=cache, use_cache=True).logits[0]]
        torch.set_num_threads(1)
        for i in range(prefix, total):
            parts.append(model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits[0])
    assert torch.equal(torch.cat(parts), full)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_int8_target_speculation_equals_its_own_greedy_decoding(family, kernel):
    """The oracle for a quantized target: speculative decoding (trees, prompt lookup, re-rooted
    growth) returns exactly that quantized model's plain greedy tokens (full re-forwards)."""
    target_fp32 = tiny_model(family, seed=11)
    target = quantize_int8(copy.deepcopy(target_fp32), kernel=kernel_or_skip(kernel))
    drafts = {"often-agreeing int8": quantize_int8(perturbed(target_fp32, seed=3, noise=0.004), batch_invariant=False),
              "rarely-agreeing fp32": tiny_model(family, seed=12)}
    rng = random.Random(4)
    checked = 0
    for name, draft in drafts.items():
        for tree in (TreeSpec(max_nodes=1, max_depth=1, branch=1), TreeSpec(max_nodes=6, max_depth=6, branch=1),
                     TreeSpec(max_nodes=12, max_depth=4, branch=3)):
            prompt = [rng.randrange(128) for _ in range(rng.randrange(3, 30))]
            prompt += prompt[:8]  # a repeat, so prompt lookup proposes candidates
            want, _ = greedy_reference(target, prompt, 24)
            got = generate(draft, target, prompt, max_new_tokens=24, tree=tree, sampling=SamplingSpec(),
                           lookup_max_tokens=4, grow_budget_ms=5.0)
            assert got == want, (family, name, tree)
            checked += 1
    assert checked == 6


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_long_prompt_is_prefilled_on_the_prompt_attention_the_same_way_in_every_resend(kernel):
    """A prompt longer than one linear chunk is prefilled on float32 attention (``prompt_attention_name``),
    every time the same way: a session whose cache is lost and resent holds bit for bit the cache
    of one that never lost it (the prompt on the prompt attention in the same chunks, the
    generated tokens on the float64 path they were decoded on), and decodes the same tokens."""
    import random

    from schemas import VerifyRequest
    from specsplit.engine.base import EngineLimits
    from specsplit.engine.target import TargetEngine
    from specsplit.models.attention import GQA_ATTENTION
    from specsplit.orchestrator.state import SessionCursor, root_only

    target = TargetEngine(quantize_int8(tiny_model("qwen2", seed=5), kernel=kernel_or_skip(kernel)),
                          EngineLimits(max_sessions=4, max_session_tokens=256))
    target.linear_chunk = 16
    prompt = [random.Random(3).randrange(128) for _ in range(41)]
    linear, forward_linear = [], target.forward_linear

    def spy(kv, ids, chunk=None, attention=None, on_rows=None):
        linear.append((len(ids), attention))
        return forward_linear(kv, ids, chunk, attention, on_rows)

    target.forward_linear = spy

    def decode(sid: str, *, resend_at: int | None = None, name_prompt: bool = True) -> tuple[list[int], list]:
        cur = SessionCursor(list(prompt), prompt_len=len(prompt) if name_prompt else 0)
        for rnd in range(12):
            if rnd == resend_at:  # the worker lost the session: the whole context again
                target.store.drop(target.store.get(sid))
                cur.target_len = 0
            reply = target.handle(VerifyRequest(session_id=sid, round=rnd, sync=cur.target_sync(),
                                                tree=root_only(cur.committed[-1])))
            cur.apply_verify(reply)
        kv = target.store.get(sid).kv
        return cur.committed, [(layer.keys.clone(), layer.values.clone()) for layer in kv.layers]

    whole, kv = decode("a")
    assert linear == [(40, GQA_ATTENTION)]  # prompt[:-1]; its last token is the first root
    linear.clear()
    resent, kv_resent = decode("b", resend_at=7)
    assert linear == [(40, GQA_ATTENTION), (40, GQA_ATTENTION), (7, None)]  # 48 - 1 - 40: the first root, 6 decoded
    assert resent == whole
    for (k, v), (k2, v2) in zip(kv, kv_resent):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    # the two paths do round differently, so the comparison above can fail: a prompt prefilled on
    # the decoding path (no prompt named) leaves other bits in the deeper layers' cache
    _, kv_plain = decode("c", name_prompt=False)
    assert any(not torch.equal(k, k2) for (k, _), (k2, _) in zip(kv[1:], kv_plain[1:]))
