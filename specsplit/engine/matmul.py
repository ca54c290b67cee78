"""Triton GEMMs of few rows for the graphs' decoder body (``SPECSPLIT_CUDA_GRAPH_BODY=triton_gemm``),
with the elementwise work around them folded in.

A decode step or a small tree multiplies a few rows of activations by each weight matrix: the
time is the weights' bytes, plus a few microseconds a kernel. Through the Triton body a layer
still runs ten kernels, four of them elementwise (two RMSNorms, SiLU x up) or small reductions
around the GEMMs (docs/hardware.md, GPUs). ``linear`` computes ``y = f(x) @ W^T (+ bias)
(+ residual)`` for at most MAX_ROWS rows in one kernel, ``f`` being
- RMSNorm (``norm``): the row's scale factors out of the product, so each program sums the squares
  of the very tiles it multiplies and scales its accumulator at the end (no second pass over x);
  ``x`` times the norm's weight is rounded to the weights' dtype before the product, where torch
  rounds the normalized row instead: the same relative rounding;
- SiLU of the gate times the up projection (``silu``: ``x`` is [M, 2K], the gate first), the
  gate's SiLU rounded first, as torch does;
so a layer runs six or seven kernels: the q/k/v GEMM with the input norm, the rotation, attention
(and its merge), the output GEMM adding the residual, gate/up with the second norm, down with
SiLU x up adding the residual. Accumulation in float32; no atomics (results do not depend on
timing). Rows are padded to a tile of at least 16 (``tl.dot``), weights streamed in tiles of
BLOCK_N output rows x BLOCK_K; nothing syncs with the host.

Few output columns (q/k/v, o, down: 1,536-2,048 on the real target) give ~100 programs of 16
columns, under one per multiprocessor on an H200 (132): too few bytes in flight to stream the
weights at the card's bandwidth. A ``Tile`` may split the reduction into chunks run by separate
programs; a second kernel adds the chunks' float32 sums in order and applies the norm's scale,
bias and residual. Which tile is fastest only the device knows: with ``tune`` the first product
of each kind times a few ``candidates`` there (SPECSPLIT_CUDA_GEMM_TUNE), replayed in a CUDA graph
as a forward runs them (no host launch overhead, the weights not in the L2 cache). Checked in Triton's
interpreter against torch (tests/test_matmul.py) and compiled for sm_90 ahead of time; whether
it beats cuBLAS is for a GPU to say (``ops/gpu_check.sh`` runs both bodies).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from specsplit.engine.kernels import _cdiv, _pow2, tl, triton

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

MAX_ROWS = 64  # rows (tokens of every session of a forward) these GEMMs take; more go to torch's
BLOCK_K = 128  # the reduction's step; LONG_BLOCK_K for long rows (the down projection) of few tokens
LONG_K, LONG_BLOCK_K = 4096, 256  # few programs there (1,536 columns): larger tiles keep more bytes in flight
STAGES = 4  # tiles in flight per program (software pipelining): a GEMV is bound by the bytes it streams
SUM_BLOCK = 1024  # outputs a program of a split product's sum completes

if triton is not None:

    @triton.jit(do_not_specialize=["m"])
    def _linear(x, w, bias, res, norm, y, part, sq, m, n, eps, stride_x, stride_res, stride_y,
                K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                CHUNK: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, IEEE: tl.constexpr):
        """Program (block of output columns, block of rows, CHUNK of the reduction): y[rows, cols] =
        f(x[rows]) @ w[cols]^T (+ bias[cols]) (+ res[rows, cols]); split (SPLIT > 1), the chunk's
        float32 sum into part[chunk, rows, cols] (and its squares into sq[chunk, rows]) instead,
        which ``_linear_sum`` completes."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        chunk = tl.program_id(2)
        row_ok, col_ok = rows < m, cols < n
        ks = tl.arange(0, BLOCK_K)
        x_at = x + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
        w_at = w + cols[:, None].to(tl.int64) * K + ks[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        squares = tl.zeros([BLOCK_M], tl.float32)
        for step in range(0, CHUNK, BLOCK_K):
            k0 = chunk * CHUNK + step
            k_ok = (k0 + ks) < K
            a = tl.load(x_at + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if SILU:  # the gate's SiLU rounded, then times up, rounded: what the product reads
                gate = a.to(tl.float32)
                up = tl.load(x_at + k0 + K, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                act = (gate * tl.sigmoid(gate)).to(w.dtype.element_ty).to(tl.float32)
                a = (act * up).to(w.dtype.element_ty)
            if NORM:  # the row's squares now, its scale after the loop; x times the norm's weight here
                af = a.to(tl.float32)
                squares += tl.sum(af * af, axis=1)
                g = tl.load(norm + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
                a = (af * g[None, :]).to(w.dtype.element_ty)
            b = tl.load(w_at + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(a.to(b.dtype), tl.trans(b), input_precision="ieee")
            else:
                acc += tl.dot(a.to(b.dtype), tl.trans(b))
        out_ok = row_ok[:, None] & col_ok[None, :]
        if SPLIT > 1:  # the chunk's sums; the norm's scale, bias and residual after all chunks
            tl.store(part + chunk * m * n + rows[:, None] * n + cols[None, :], acc, mask=out_ok)
            if NORM:
                tl.store(sq + chunk * m + rows, squares, mask=row_ok & (tl.program_id(0) == 0))
        else:
            if NORM:
                acc = acc * tl.rsqrt(squares / K + eps)[:, None]
            if HAS_BIAS:
                acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_RES:
                acc += tl.load(res + rows[:, None].to(tl.int64) * stride_res + cols[None, :], mask=out_ok,
                               other=0.0).to(tl.float32)
            tl.store(y + rows[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(y.dtype.element_ty),
                     mask=out_ok)

    @triton.jit(do_not_specialize=["m"])
    def _linear_sum(part, sq, bias, res, y, m, n, eps, stride_res, stride_y, K: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
        """A split product's end: y = (sum of the chunks' sums) x the row's norm scale (+ bias)
        (+ res), the chunks added in order (the result does not depend on timing)."""
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = at < m * n
        row, col = at // n, at % n
        acc = tl.zeros([BLOCK], tl.float32)
        squares = tl.zeros([BLOCK], tl.float32)
        for c in tl.static_range(SPLIT):
            acc += tl.load(part + c * m * n + at, mask=ok, other=0.0)
            if NORM:
                squares += tl.load(sq + c * m + row, mask=ok, other=0.0)
        if NORM:
            acc = acc * tl.rsqrt(squares / K + eps)
        if HAS_BIAS:
            acc += tl.load(bias + col, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            acc += tl.load(res + row.to(tl.int64) * stride_res + col, mask=ok, other=0.0).to(tl.float32)
        tl.store(y + row.to(tl.int64) * stride_y + col, acc.to(y.dtype.element_ty), mask=ok)


def block_m(rows: int) -> int:
    """Rows a program holds: the rows padded to a power of two from 16 (``tl.dot``'s least)."""
    return max(16, _pow2(rows))


def block_n(n: int, rows: int) -> int:
    """Output columns a program computes: 16, or 32 where the columns alone give many programs
    (the larger tile reads each row of x half as often). Triton's interpreter runs programs one
    by one, each step costing about the same at any size: up to 128 there (tests/test_matmul.py
    checks the device's tiles)."""
    if INTERPRETED:
        return max(16, min(128, _pow2(n)))
    return 32 if n >= 32 * 256 and rows <= 16 else 16


def block_k(k: int, rows: int) -> int:
    """The reduction's step: LONG_BLOCK_K over long rows of at most 16 tokens, else BLOCK_K."""
    return LONG_BLOCK_K if k >= LONG_K and rows <= 16 else BLOCK_K


@dataclass(frozen=True)
class Tile:
    """How one product is cut: output columns and reduction step a program takes, chunks of the
    reduction run by separate programs (``split``, summed by a second kernel), warps a program."""

    block_n: int
    block_k: int
    split: int = 1
    warps: int = 4

    def chunk(self, k: int) -> int:
        """Reduction elements a program covers: whole steps, ``split`` chunks at most."""
        return _cdiv(_cdiv(k, self.split), self.block_k) * self.block_k

    def chunks(self, k: int) -> int:
        """Chunks of a reduction of ``k`` (none empty): ``split`` or fewer."""
        return _cdiv(k, self.chunk(k))

    def __str__(self) -> str:
        return f"n{self.block_n} k{self.block_k} split{self.split} w{self.warps}"


def default_tile(n: int, k: int, rows: int) -> Tile:
    return Tile(block_n(n, rows), block_k(k, rows))


def candidates(n: int, k: int, multiprocessors: int) -> list[Tile]:
    """The tiles tuning times for a product of at most 16 rows: the default, with 8 warps, and
    where the output columns give fewer programs than twice the multiprocessors (the small
    projections), the reduction split in the least power of two that fills them and twice that."""
    base = default_tile(n, k, 16)
    out = [base, replace(base, warps=8)]
    programs = _cdiv(n, base.block_n)
    if programs < 2 * multiprocessors:
        split = 2
        while programs * split < multiprocessors:
            split *= 2
        for s in (split, 2 * split):
            tile = replace(base, split=s)
            if tile.chunks(k) > max(t.chunks(k) for t in out):  # whole steps a chunk: maybe fewer chunks
                out.append(tile)
    return out


MAX_TUNED = 256  # products tuned per process (a model has five kinds; more keep the default tile)
# (n, k, flags, dtype, device) -> (tile, its speed-up over the default, or why it was not tuned)
_tuned: dict[tuple, tuple[Tile, float | str]] = {}


def tuned() -> dict[str, str]:
    """What tuning chose in this process: {"N x K flags": "tile (x speed-up over the default)"}."""
    return {f"{n}x{k} {flags}": f"{tile} (x{gain:.2f})" if isinstance(gain, float) else f"{tile} ({gain})"
            for (n, k, flags, _, _), (tile, gain) in _tuned.items()}


def linear(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm: torch.Tensor | None = None, eps: float = 0.0,
           silu: bool = False, out: torch.Tensor | None = None, tune: bool = False) -> torch.Tensor:
    """``f(x) @ weight^T`` (+ ``bias``) (+ ``residual``) for ``x`` [M, K] (``silu``: [M, 2K], gate
    first), M at most MAX_ROWS, ``weight`` [N, K] contiguous; ``f`` RMSNorm with weight ``norm``
    and ``eps``, or SiLU(gate) x up, or nothing. Into ``out`` [M, N] (may be ``residual`` itself:
    each element of the residual is read only where it is written) or a new tensor. With ``tune``
    on a GPU, the first product of its kind outside a graph's capture times ``candidates`` on
    copies (``_tune``) and later ones of any rows take the fastest tile."""
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows: these GEMMs take at most {MAX_ROWS}")
    if x.shape[1] != (2 * k if silu else k) or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit (silu={silu})")
    out = torch.empty(m, n, dtype=weight.dtype, device=x.device) if out is None else out
    kw = {"bias": bias, "residual": residual, "norm": norm, "eps": eps, "silu": silu}
    tile = _tile(x, weight, out, kw) if tune and x.is_cuda and not INTERPRETED else None
    _launch(x, weight, out, default_tile(n, k, m) if tile is None else _for_rows(tile, n, k, m), **kw)
    return out


def _for_rows(tile: Tile, n: int, k: int, rows: int) -> Tile:
    """A tile tuned at 16 rows for ``rows``: its split and warps, the default's steps beyond 16."""
    return tile if rows <= 16 else replace(default_tile(n, k, rows), split=tile.split, warps=tile.warps)


def _launch(x, weight, out, tile: Tile, *, bias, residual, norm, eps, silu) -> None:
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    bm, chunk, split = block_m(m), tile.chunk(k), tile.chunks(k)
    res = out if residual is None else residual
    part = sq = out  # unused unless split
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        sq = torch.empty(split, m, dtype=torch.float32, device=x.device) if norm is not None else part
    _linear[(_cdiv(n, tile.block_n), _cdiv(m, bm), split)](
        x, weight, weight if bias is None else bias, res, weight if norm is None else norm, out, part, sq, m, n, eps,
        x.stride(0), res.stride(0), out.stride(0), K=k, BLOCK_M=bm, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        CHUNK=chunk, SPLIT=split, NORM=norm is not None, SILU=silu, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, IEEE=weight.dtype == torch.float32, num_warps=tile.warps, num_stages=STAGES)
    if split > 1:
        _linear_sum[(_cdiv(m * n, SUM_BLOCK),)](
            part, sq, weight if bias is None else bias, res, out, m, n, eps, res.stride(0), out.stride(0), K=k,
            SPLIT=split, BLOCK=SUM_BLOCK, NORM=norm is not None, HAS_BIAS=bias is not None,
            HAS_RES=residual is not None, num_warps=4)


def _tile(x, weight, out, kw) -> Tile | None:
    """The tuned tile of this kind of product, tuning it first where it may (not while a graph
    is captured: timing syncs the device); None: the default."""
    n, k = weight.shape
    flags = "".join(f for f, on in (("norm", kw["norm"] is not None), ("silu", kw["silu"]),
                                    ("bias", kw["bias"] is not None), ("res", kw["residual"] is not None)) if on)
    key = (n, k, flags or "plain", weight.dtype, x.device)
    if key in _tuned:
        return _tuned[key][0]
    if len(_tuned) >= MAX_TUNED or torch.cuda.is_current_stream_capturing():
        return None
    rows = min(16, x.shape[0])
    residual = kw["residual"]
    try:
        _tuned[key] = _tune(x[:rows], weight, {**kw, "residual": None if residual is None else residual[:rows]})
    except Exception as exc:  # timing failed here: the default tile, and why (``tuned``)
        _tuned[key] = (default_tile(n, k, 16), f"not tuned: {type(exc).__name__}: {exc}"[:200])
    return _tuned[key][0]


def graph_ms(launches: list, replays: int = 20) -> float:
    """Device ms of one of ``launches`` (callables, each one product) as a CUDA graph replays
    them all in turn: what a forward's graph pays, with no launch overhead from the host. Run
    on the weights' copies in turn, the weights of a small product are not read from the L2
    cache, as in a forward, where the other layers' weights evict them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for launch in launches:  # compiled and warm before the capture
            launch()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for launch in launches:
                launch()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(replays):
            graph.replay()
        end.record(stream)
        end.synchronize()
    torch.cuda.current_stream().wait_stream(stream)
    return start.elapsed_time(end) / (replays * len(launches))


COLD_BYTES = 2  # a small product is timed over copies of its weight holding this many times the L2 cache
MAX_COPIES = 64


def _tune(x, weight, kw, bench=graph_ms) -> tuple[Tile, float]:
    """(fastest tile, its speed-up over the default) of ``candidates`` for this product, each
    run on copies (nothing of the caller's changes) and timed by ``bench`` over launches on
    copies of the weight (``graph_ms``); a tile whose result is not the default's, within
    rounding, is not taken."""
    n, k = weight.shape
    props = torch.cuda.get_device_properties(x.device) if x.is_cuda else None
    sms, l2 = (props.multi_processor_count, props.L2_cache_size) if props is not None else (1, 0)
    weights = [weight] + [weight.clone() for _ in range(min(MAX_COPIES, -(-COLD_BYTES * l2 // weight.nbytes)) - 1)]

    def run(tile: Tile) -> tuple[torch.Tensor, float]:
        args = {**kw, "residual": None if kw["residual"] is None else kw["residual"].clone()}
        out = torch.empty(x.shape[0], n, dtype=weight.dtype, device=x.device)
        _launch(x, weight, out, tile, **args)
        got = out.float().clone()
        return got, bench([lambda w=w: _launch(x, w, out, tile, **args) for w in weights])

    base, *others = candidates(n, k, sms)  # the default first
    want, base_ms = run(base)
    best, best_ms = base, base_ms
    scale = want.abs().max().item()
    for tile in others:
        try:
            got, ms = run(tile)
        except Exception:  # a tile this device cannot build (shared memory, registers): not taken
            got, ms = None, float("inf")
        if got is not None and ms < best_ms and torch.allclose(got, want, rtol=2e-2, atol=2e-2 * scale):
            best, best_ms = tile, ms
    return best, base_ms / best_ms if best_ms > 0 else 1.0


def compile_variants(capability: int = 90, shapes=((1536, 8960), (896, 4864)), dtype: str = "bf16") -> dict:
    """Compile ahead of time (no device needed) the variants a model of (hidden, intermediate)
    ``shapes`` launches in ``dtype`` (by default the real target's and draft's), for rows in
    tiles of 16, 32 and 64; {variant: shared memory bytes}. Raises the compiler's error, and for
    a variant that spills registers."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specsplit.engine.kernels import _stack_bytes, aligned

    target, ptr, out = GPUTarget("cuda", capability, 32), f"*{dtype}", {}
    signature = {"x": ptr, "w": ptr, "bias": ptr, "res": ptr, "norm": ptr, "y": ptr, "part": "*fp32", "sq": "*fp32",
                 "m": "i32", "n": "i32", "eps": "fp32", "stride_x": "i32", "stride_res": "i32", "stride_y": "i32"}
    even = [a for a in signature if a not in ("m", "eps")]  # as a launch specializes them (``aligned``)
    for hidden, inter in shapes:
        # (K, what runs before the product, bias, residual): q/k/v, o, gate/up, down, the head
        uses = ((hidden, "norm", True, False), (hidden, "", False, True), (hidden, "norm", False, False),
                (inter, "silu", False, True))
        for k, pro, has_bias, has_res in uses:
            # (rows, columns, split, warps): the default tiles at 16, 32 and 64 rows, and what tuning
            # may take at 16 (``candidates``: 8 warps, the reduction split in 2, 4 or 8)
            tiles = [(16, 16, 1, 4), (16, 32, 1, 4), (32, 16, 1, 4), (64, 16, 1, 4), (16, 16, 1, 8)]
            tiles += [(16, 16, s, 4) for s in sorted({Tile(16, block_k(k, 16), s).chunks(k) for s in (2, 4, 8)})]
            for bm, bn, split, warps in tiles:
                bk = block_k(k, bm)
                constexprs = {"K": k, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                              "CHUNK": Tile(bn, bk, split).chunk(k), "SPLIT": split, "NORM": pro == "norm",
                              "SILU": pro == "silu", "HAS_BIAS": has_bias, "HAS_RES": has_res, "IEEE": False}
                kernel = triton.compile(
                    ASTSource(fn=_linear, signature={**signature, **{c: "constexpr" for c in constexprs}},
                              constexprs=constexprs, attrs=aligned(_linear, even)),
                    target=target, options={"num_warps": warps, "num_stages": STAGES})
                name = f"linear k{k} {pro or 'plain'} bias={has_bias} res={has_res} m{bm} n{bn} split{split} w{warps}"
                stack = _stack_bytes(kernel.asm["cubin"])
                if stack:
                    raise RuntimeError(f"{name}: {stack} bytes of stack (registers spilled)")
                out[name] = kernel.metadata.shared
                if split > 1:  # its sum
                    sums = {"K": k, "SPLIT": split, "BLOCK": SUM_BLOCK, "NORM": pro == "norm", "HAS_BIAS": has_bias,
                            "HAS_RES": has_res}
                    sig = {"part": "*fp32", "sq": "*fp32", "bias": ptr, "res": ptr, "y": ptr, "m": "i32", "n": "i32",
                           "eps": "fp32", "stride_res": "i32", "stride_y": "i32"}
                    triton.compile(ASTSource(fn=_linear_sum, signature={**sig, **{c: "constexpr" for c in sums}},
                                             constexprs=sums, attrs=aligned(_linear_sum, [a for a in sig if a not in ("m", "eps")])),
                                   target=target, options={"num_warps": 4})
    return out
