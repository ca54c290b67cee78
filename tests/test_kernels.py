"""The Triton kernels of the graphs' decoder body (``specsplit.engine.kernels``, issue 45) against
torch references: rotary positions (and qwen3's head norms) with the K/V written into the pool,
attention over pool slots read in place (split or not, the new tokens' tree or a full visibility
row, padding sessions), SiLU x up; and every variant the real pair launches compiles for the
H200 (sm_90) with the Triton version its image runs. On CPU the kernels run in Triton's
interpreter (tests/conftest.py); on a CUDA device, compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specsplit.engine import kernels

pytestmark = pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
def test_rope_store_rotates_queries_in_place_and_writes_the_pool(dtype, qk_norm):
    """Queries come back rotated in ``qkv``; rotated keys and the values land in each session's
    slot at its length + i, and nothing else of the pool moves."""
    g = torch.Generator().manual_seed(1)
    b, t, hq, hkv, d, slots, max_len = 3, 5, 6, 2, 32, 4, 40
    qkv = torch.randn(b * t, hq + 2 * hkv, d, generator=g).to(dtype)
    angles = torch.rand(b * t, d // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    weight = (torch.rand(hq + hkv, d, generator=g) + 0.5).to(dtype) if qk_norm else None
    kv = torch.randn(2, slots, hkv, max_len, d, generator=g).to(dtype)
    slot_of, length = torch.tensor([2, 0, 3]), torch.tensor([7, 0, 30])
    x = qkv[:, : hq + hkv].float()
    if qk_norm:
        x = (F.rms_norm(x, (d,), None, 1e-6).to(dtype).float() * weight.float()).to(dtype).float()
    want = x * cos.float()[:, None] + rotate_half(x) * sin.float()[:, None]
    want_kv = kv.clone()
    for s in range(b):
        rows = slice(s * t, (s + 1) * t)
        at = slice(int(length[s]), int(length[s]) + t)
        want_kv[0, slot_of[s], :, at] = want[rows, hq:].transpose(0, 1).to(dtype)
        want_kv[1, slot_of[s], :, at] = qkv[rows, hq + hkv:].transpose(0, 1)
    values = qkv[:, hq + hkv:].clone()
    qkv, kv = qkv.to(DEVICE), kv.to(DEVICE)
    kernels.rope_store(qkv, cos.to(DEVICE), sin.to(DEVICE), None if weight is None else weight.to(DEVICE), 1e-6,
                       kv, slot_of.to(DEVICE), length.to(DEVICE), hq, hkv)
    torch.testing.assert_close(qkv[:, :hq].float().cpu(), want[:, :hq], **TOL[dtype])
    torch.testing.assert_close(qkv[:, hq + hkv:].cpu(), values, rtol=0, atol=0)  # values read, not moved
    torch.testing.assert_close(kv.float().cpu(), want_kv.float(), **TOL[dtype])


def reference_attention(qkv, kv, slot_of, length, vis, compact, scaling, hq, hkv):
    """Per session and query head: float32 scores over the slot's first length + T entries under
    the visibility, softmax, probabilities rounded to the values' dtype, times the values."""
    n, _, d = qkv.shape
    b = slot_of.numel()
    t, group = n // b, hq // hkv
    out = torch.zeros(n, hq * d)
    for s in range(b):
        size, slot = int(length[s]) + t, int(slot_of[s])
        if compact:
            seen = torch.ones(t, size, dtype=torch.bool)
            seen[:, int(length[s]):] = vis[s]
        else:
            seen = vis[s, :, :size]
        q = qkv[s * t:(s + 1) * t, :hq].float()
        for h in range(hq):
            scores = (q[:, h] @ kv[0, slot, h // group, :size].float().T * scaling).masked_fill(~seen, -1e30)
            probs = torch.softmax(scores, -1).to(qkv.dtype).float()
            out[s * t:(s + 1) * t, h * d:(h + 1) * d] = probs @ kv[1, slot, h // group, :size].float()
    return out


CASES = [  # sessions, new tokens, their cache lengths, the bucket's keys, programs aimed for, splits
    pytest.param(1, 1, [10], 256, 1, 1, id="one-token"),
    pytest.param(2, 4, [100, 3], 256, 8, 1, id="two-sessions"),
    pytest.param(3, 4, [300, 0, 17], 512, 64, 2, id="split-keys"),  # a session of length 0 too
    pytest.param(1, 16, [700], 768, 300, 3, id="split-three-ways"),
    pytest.param(4, 8, [5, 120, 64, 0], 512, 64, 2, id="split-short"),  # the second split past every length
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("compact", [True, False], ids=["tree", "rows"])
@pytest.mark.parametrize(("b", "t", "lengths", "keys", "programs", "splits"), CASES)
def test_attend_over_pool_slots_equals_the_reference(b, t, lengths, keys, programs, splits, compact, dtype):
    """The kernel's attention, with its keys split over programs or not, equals float32 scores
    and softmax over each session's own slot (the tree among the new tokens and every cached
    entry, or a visibility row per token), for sessions of any length in one bucket."""
    g = torch.Generator().manual_seed(b * 100 + t)
    hq, hkv, d, max_len = 6, 2, 32, 800
    kv = torch.randn(2, 5, hkv, max_len, d, generator=g).to(dtype)
    qkv = torch.randn(b * t, hq + 2 * hkv, d, generator=g).to(dtype)
    slot_of, length = torch.tensor([4, 1, 0, 2][:b]), torch.tensor(lengths)
    if compact:
        vis = torch.rand(b, t, t, generator=g) < 0.5
        vis |= torch.eye(t, dtype=torch.bool)
    else:
        vis = torch.rand(b, t, max_len, generator=g) < 0.6
        vis[:, :, 0] = True
    _, planned, per_split = kernels.plan(b, t, keys, hkv, hq // hkv, programs)
    assert planned == splits and per_split * splits >= keys > per_split * (splits - 1)
    out = torch.full((b * t, hq * d), float("nan"), dtype=dtype, device=DEVICE)
    kernels.attend(qkv.to(DEVICE), kv.to(DEVICE), slot_of.to(DEVICE), length.to(DEVICE), vis.to(DEVICE), compact,
                   keys, 0.3, hq, hkv, out, programs)
    want = reference_attention(qkv, kv, slot_of, length, vis, compact, 0.3, hq, hkv)
    torch.testing.assert_close(out.float().cpu(), want, **TOL[dtype])


def test_a_session_with_nothing_visible_stays_finite():
    """A padding row (nothing visible: a padding session on the scratch slot, length 0) gets a
    finite output, so nothing downstream of it turns into NaN."""
    hq, hkv, d = 4, 2, 16
    qkv = torch.randn(2, hq + 2 * hkv, d, device=DEVICE)
    kv = torch.randn(2, 1, hkv, 64, d, device=DEVICE)
    out = torch.empty(2, hq * d, device=DEVICE)
    vis = torch.zeros(1, 2, 2, dtype=torch.bool, device=DEVICE)
    kernels.attend(qkv, kv, torch.tensor([0], device=DEVICE), torch.tensor([0], device=DEVICE), vis, True, 64,
                   0.25, hq, hkv, out, 1)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_mul_equals_torch(dtype):
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(7, 2 * 1500, generator=g) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = kernels.silu_mul(gate_up.to(DEVICE)).cpu()
    assert got.dtype == dtype and got.shape == (7, 1500)
    want = F.silu(gate.float()) * up.float()  # bf16: the gate's activation and the product each rounded
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.slow
def test_every_variant_compiles_for_the_h200():
    """Each kernel variant the real pair's buckets launch (the 1.5B target: head size 128, 6
    query heads a KV head; the 0.5B draft: 64 and 7) compiles for sm_90 ahead of time, no device
    needed, fits a multiprocessor's shared memory (228 KiB on Hopper), and no attention variant
    spills registers (``compile_variants`` raises)."""
    shared = compiled_ahead("kernels", "compile_variants(90, shapes=((128, 6), (64, 7)), block_ms=(16, 32))")
    assert len(shared) == 2 * (2 + 2 * 4 + 2) + 1, sorted(shared)  # per shape: rope x2, attend x8, combine x2
    assert max(shared.values()) <= 228 * 1024, shared


def compiled_ahead(module: str, call: str) -> dict:
    """``specsplit.engine.<module>.<call>`` (a ``compile_variants``) in a child process without
    Triton's interpreter (the tests' conftest sets it where there is no GPU): {variant: shared
    memory bytes}; the child's error fails the test."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json; from specsplit.engine.{module} import compile_variants; print(json.dumps({call}))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_device_the_kernels_miscompute_on_keeps_the_torch_operations(monkeypatch):
    """At start the Triton body checks one forward against the torch operations' on the pool's
    scratch slot: kernels that agree serve; a kernel that miscomputes (here SiLU x up returning
    zeros) or fails (one that does not build for the device) leaves the fused body in torch
    operations, with the reason logged, and the engine starts."""
    from specsplit.engine.graphs import GraphRunner
    from specsplit.engine.kvpool import KVPool, pool_shape
    from tests.conftest import tiny_model

    model = tiny_model("qwen3")

    def runner() -> GraphRunner:
        pool = KVPool(pool_shape(model, 300, torch.float32), 1, DEVICE, scratch=True)
        return GraphRunner(model.to(DEVICE), pool, model.config.vocab_size, "static", body="triton")

    assert runner().body == "triton"
    monkeypatch.setattr(kernels, "silu_mul", lambda gate_up: gate_up.new_zeros(gate_up.shape[0],
                                                                                gate_up.shape[1] // 2))
    fallen = runner()
    assert fallen.body == "fused" and "differ" in fallen.fused_not
    monkeypatch.undo()

    def fails(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(kernels, "attend", fails)  # a GPU the kernels do not build for
    fallen = runner()
    assert fallen.body == "fused" and "failed" in fallen.fused_not
