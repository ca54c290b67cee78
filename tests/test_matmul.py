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
    pipelined loads): every variant of the real target's and draft's layers, and every tile tuning
    may take for them (8 warps, split reductions and their sums), builds for the H200, fits its
    shared memory (228 KiB) and keeps every value in registers (``compile_variants`` raises
    otherwise)."""
    from tests.test_kernels import compiled_ahead

    shared = compiled_ahead("matmul", "compile_variants(90)")
    # per model: 4 uses x (16x16, 16x32, 32, 64 rows; 8 warps; the reduction in 2, 4 and 6 or 7 chunks)
    assert len(shared) == 2 * 4 * 8, sorted(shared)
    assert sum("split1" not in name for name in shared) == 2 * 4 * 3
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "n", "k", "split"), [(1, 48, 300, 2), (5, 130, 1000, 3), (20, 64, 512, 4)])
def test_split_reductions_equal_torch(dtype, rows, n, k, split):
    """The reduction cut in chunks run by separate programs, then summed in order by a second
    kernel, with everything folded in (the norm's scale needs every chunk's squares)."""
    g = torch.Generator().manual_seed(rows + n + k + split)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

    x, xs, w = rand(rows, k), rand(rows, 2 * k), rand(n, k, scale=k ** -0.5)
    bias, residual, norm = rand(n), rand(rows, n), (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEVICE)
    tile = matmul.Tile(16, 128, split)
    assert tile.chunks(k) == split
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    kw0 = {"bias": None, "residual": None, "norm": None, "eps": 0.0, "silu": False}
    cases = [({"norm": norm, "eps": 1e-6, "bias": bias}, x), ({"silu": True, "residual": residual}, xs), ({}, x)]
    for kw, inp in cases:
        got = torch.full((rows, n), float("nan"), dtype=dtype, device=DEVICE)
        matmul._launch(inp, w, got, tile, **{**kw0, **kw})
        ref = reference(inp, w, **kw)
        torch.testing.assert_close(got.float(), ref, **tol, msg=lambda m, kw=kw: f"{sorted(kw)}: {m}")
    inplace = residual.clone()
    matmul._launch(x, w, inplace, tile, **{**kw0, "residual": inplace, "norm": norm, "eps": 1e-6})
    torch.testing.assert_close(inplace.float(), reference(x, w, residual=residual, norm=norm, eps=1e-6), **tol)


def test_the_tiles_tuning_tries_for_the_real_pair(monkeypatch):
    """On 132 multiprocessors (the H200): the default and 8 warps everywhere; the reduction split
    where the columns give fewer programs than twice the multiprocessors (q/k/v, o, down), never
    for gate/up or the head; only splits into whole steps, no chunk empty."""
    monkeypatch.setattr(matmul, "INTERPRETED", False)  # the device's column tiles
    def tried(n, k):
        return [(t.split, t.warps, t.chunks(k)) for t in matmul.candidates(n, k, 132)]

    assert tried(2048, 1536) == [(1, 4, 1), (1, 8, 1), (2, 4, 2), (4, 4, 4)]  # target q/k/v: 128 programs
    assert tried(1536, 8960) == [(1, 4, 1), (1, 8, 1), (2, 4, 2), (4, 4, 4)]  # target down: 96
    assert tried(896, 896) == [(1, 4, 1), (1, 8, 1), (4, 4, 4), (8, 4, 7)]  # draft o: 56 programs
    assert tried(17920, 1536) == tried(151936, 1536) == [(1, 4, 1), (1, 8, 1)]
    for n, k in ((2048, 1536), (1536, 8960), (896, 896), (896, 4864), (1152, 896)):
        for t in matmul.candidates(n, k, 132):
            assert t.chunk(k) % t.block_k == 0 and (t.chunks(k) - 1) * t.chunk(k) < k


def test_tuning_takes_the_fastest_tile_that_agrees_and_changes_nothing(monkeypatch):
    """``_tune`` times each candidate on copies: the fastest whose result is the default's is
    taken, a faster one that miscomputes is not, and the caller's residual is left as it was."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 256, generator=g).to(DEVICE), (torch.randn(40, 256, generator=g) / 16).to(DEVICE)
    residual = torch.randn(3, 40, generator=g).to(DEVICE)
    before = residual.clone()
    tiles = [matmul.Tile(16, 128), matmul.Tile(16, 128, warps=8), matmul.Tile(16, 128, split=2)]
    monkeypatch.setattr(matmul, "candidates", lambda n, k, sms: tiles)
    times = {tiles[0]: 3.0, tiles[1]: 2.0, tiles[2]: 1.0}
    launched = []
    real = matmul._launch

    def launch(x, weight, out, tile, **kw):
        launched.append(tile)
        real(x, weight, out, tile, **kw)

    monkeypatch.setattr(matmul, "_launch", launch)

    def bench(launches):  # one launch per copy of the weight (none here: no L2 cache to defeat)
        assert len(launches) == 1
        launches[0]()
        return times[launched[-1]]

    kw = {"bias": None, "residual": residual, "norm": None, "eps": 0.0, "silu": False}
    assert matmul._tune(x, w, kw, bench=bench) == (tiles[2], 3.0)
    torch.testing.assert_close(residual, before, rtol=0, atol=0)

    def wrong(x, weight, out, tile, **kw):  # the split tile drops the residual
        launched.append(tile)
        real(x, weight, out, tile, **{**kw, "residual": None} if tile.split > 1 else kw)

    monkeypatch.setattr(matmul, "_launch", wrong)
    assert matmul._tune(x, w, kw, bench=bench) == (tiles[1], 1.5)


def test_a_kind_is_tuned_once_never_while_a_graph_is_captured(monkeypatch):
    """``_tile``: the first product of a kind tunes it (on its first 16 rows), later ones of any
    rows reuse the choice; while a graph is being captured (timing would sync) or once MAX_TUNED
    kinds are known, the default tile. Past 16 rows a tuned tile keeps its split and warps."""
    calls = []
    tile = matmul.Tile(16, 128, split=2)
    monkeypatch.setattr(matmul, "_tuned", {})
    monkeypatch.setattr(matmul, "_tune", lambda x, w, kw: calls.append(x.shape[0]) or (tile, 1.4))
    w, kw = torch.zeros(64, 256), {"bias": None, "residual": None, "norm": None, "eps": 0.0, "silu": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert matmul._tile(torch.zeros(40, 256), w, torch.zeros(40, 64), kw) is None and calls == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert matmul._tile(torch.zeros(40, 256), w, torch.zeros(40, 64), kw) == tile and calls == [16]
    assert matmul._tile(torch.zeros(2, 256), w, torch.zeros(2, 64), kw) == tile and calls == [16]
    assert matmul.tuned() == {"64x256 plain": "n16 k128 split2 w4 (x1.40)"}
    wide = matmul._for_rows(tile, 64, 256, 40)
    assert (wide.split, wide.warps) == (2, 4) and wide.block_n == matmul.block_n(64, 40)
    def broken(x, w, kw):
        raise RuntimeError("no graph here")

    monkeypatch.setattr(matmul, "_tune", broken)  # a failed timing serves the default tile, and says so
    assert matmul._tile(torch.zeros(2, 256), torch.zeros(48, 256), torch.zeros(2, 48), kw) == matmul.default_tile(48, 256, 16)
    assert matmul.tuned()["48x256 plain"].endswith("(not tuned: RuntimeError: no graph here)")
    monkeypatch.setattr(matmul, "MAX_TUNED", 2)
    assert matmul._tile(torch.zeros(2, 256), torch.zeros(32, 256), torch.zeros(2, 32), kw) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs time the tiles on a GPU")
def test_tiles_tuned_on_the_gpu_compute_what_torch_does():
    """On a GPU: the first product of each kind (the real target's down projection, its q/k/v
    with the norm) times its candidates in CUDA graphs, then products of 1, 16 and 40 rows through
    the chosen tile equal torch's; the timing itself is finite and positive."""
    g = torch.Generator(device="cuda").manual_seed(0)
    matmul._tuned.clear()
    for n, k, kw in ((1536, 8960, {"silu": True}), (2048, 1536, {"norm": "n", "eps": 1e-6})):
        w = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)
        norm = (torch.rand(k, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
        kw = {**kw, "norm": norm} if "norm" in kw else kw
        for rows in (1, 16, 40):
            x = torch.randn(rows, 2 * k if kw.get("silu") else k, generator=g, device="cuda").to(torch.bfloat16)
            got = matmul.linear(x, w, tune=True, **kw)
            torch.testing.assert_close(got.float(), reference(x, w, **kw), rtol=2e-2, atol=3e-2)
    chosen = matmul.tuned()
    assert len(chosen) == 2 and all("x" in v and "not tuned" not in v for v in chosen.values()), chosen
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(4, 256, device="cuda", dtype=torch.bfloat16)
    ms = matmul.graph_ms([lambda: torch.mm(x, w.t(), out=out)] * 3)
    assert 0 < ms < 10
