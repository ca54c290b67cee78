"""The Triton GEMMs of few rows (``specsplit.engine.matmul``, issue 45) against torch: plain, with
a bias, adding a residual (in place too), after an RMSNorm folded in, after SiLU x up folded in;
rows 1 to 64, sizes that are and are not multiples of the tiles, fp32 and bf16; the tiles a GPU
launches; and every variant the real pair launches compiled for sm_90 without spilling registers.
On CPU the kernels run in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from specsplit.engine import kernels, matmul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(kernels.available(DEVICE) is not None, reason="Triton is not installed")


def reference(x, w, *, bias=None, residual=None, norm=None, eps=0.0, silu=False):
    """The same product in float32 through torch, as the fused body's torch operations compute it."""
    x, w = x.float(), w.float()
    if silu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if norm is not None:
        x = F.rms_norm(x, (x.shape[-1],), norm.float(), eps)
    y = x @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y if residual is None else y + residual.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 48, 64), (3, 130, 200), (16, 64, 300), (17, 32, 128),
                                              (64, 96, 4096 + 72)])
def test_products_equal_torch(dtype, rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

    x, xs, w = rand(rows, k), rand(rows, 2 * k), rand(n, k, scale=k ** -0.5)
    bias, residual, norm = rand(n), rand(rows, n), (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEVICE)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    cases = [({}, x), ({"bias": bias}, x), ({"residual": residual}, x), ({"norm": norm, "eps": 1e-6}, x),
             ({"norm": norm, "eps": 1e-6, "bias": bias}, x), ({"silu": True, "residual": residual}, xs)]
    for kw, inp in cases:
        got = matmul.linear(inp, w, **kw)
        assert got.shape == (rows, n) and got.dtype == dtype
        torch.testing.assert_close(got.float(), reference(inp, w, **kw), **tol, msg=lambda m, kw=kw: f"{kw}: {m}")
    inplace = residual.clone()  # the residual stream updated in place, as the body does
    assert matmul.linear(xs, w, silu=True, residual=inplace, out=inplace) is inplace
    torch.testing.assert_close(inplace.float(), reference(xs, w, silu=True, residual=residual), **tol)


def test_refusals_and_the_device_tiles():
    x, w = torch.zeros(matmul.MAX_ROWS + 1, 32, device=DEVICE), torch.zeros(16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        matmul.linear(x, w)
    with pytest.raises(ValueError, match="do not fit"):
        matmul.linear(x[:4, :16], w)
    with pytest.raises(ValueError, match="do not fit"):
        matmul.linear(x[:4], w, silu=True)  # SiLU x up needs [M, 2K]
    assert [matmul.block_m(m) for m in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    assert matmul.block_k(1536, 1) == matmul.block_k(8960, 17) == 128 and matmul.block_k(8960, 16) == 256
    if not matmul.INTERPRETED:  # the interpreter takes larger column tiles (fewer programs to step)
        assert matmul.block_n(151936, 1) == 32 and matmul.block_n(2048, 1) == 16 and matmul.block_n(17920, 17) == 16


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="Triton's sm_90 compiler ships for Linux")
def test_every_variant_the_real_pair_launches_compiles_for_sm90_without_spilling():
    """Compiled ahead of time as a launch specializes them (aligned pointers: vectorized,
    pipelined loads): every variant of the real target's and draft's layers builds for the H200,
    fits its shared memory (228 KiB) and keeps every value in registers (``compile_variants``
    raises otherwise)."""
    from tests.test_kernels import compiled_ahead

    shared = compiled_ahead("matmul", "compile_variants(90)")
    assert len(shared) == 2 * 4 * 4, sorted(shared)  # per model: 4 uses x (16x16, 16x32, 32, 64 rows)
    assert max(shared.values()) <= 228 * 1024, shared


def test_gemms_that_miscompute_here_leave_the_other_kernels(monkeypatch):
    """The ``triton_gemm`` body checks one forward against the torch operations at start, as the
    ``triton`` body does: where only its GEMMs disagree (here: they drop the residual), the other
    Triton kernels serve with torch's GEMMs, the reason logged."""
    from specsplit.engine.graphs import GraphRunner
    from specsplit.engine.kvpool import KVPool, pool_shape
    from tests.conftest import tiny_model

    model = tiny_model("qwen2").to(DEVICE)

    def runner() -> GraphRunner:
        pool = KVPool(pool_shape(model, 300, torch.float32), 1, DEVICE, scratch=True)
        return GraphRunner(model, pool, model.config.vocab_size, "static", body="triton_gemm")

    assert runner().body == "triton_gemm"
    real = matmul.linear
    monkeypatch.setattr(matmul, "linear", lambda x, w, **kw: real(x, w, **{**kw, "residual": None}))
    fallen = runner()
    assert fallen.body == "triton" and fallen.fused.kernels is not None and not fallen.fused.gemm
    assert "differ" in fallen.fused_not and "without the Triton GEMMs: they agree" in fallen.fused_not
