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
BLOCK_N output rows x BLOCK_K; nothing syncs with the host. Checked in Triton's interpreter
against torch (tests/test_matmul.py) and compiled for sm_90 ahead of time; whether it beats
cuBLAS is for a GPU to say (``ops/gpu_check.sh`` runs both bodies).
"""

from __future__ import annotations

import os

import torch

from specsplit.engine.kernels import _cdiv, _pow2, tl, triton

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

MAX_ROWS = 64  # rows (tokens of every session of a forward) these GEMMs take; more go to torch's
BLOCK_K = 128  # the reduction's step; LONG_BLOCK_K for long rows (the down projection) of few tokens
LONG_K, LONG_BLOCK_K = 4096, 256  # few programs there (1,536 columns): larger tiles keep more bytes in flight
STAGES = 4  # tiles in flight per program (software pipelining): a GEMV is bound by the bytes it streams

if triton is not None:

    @triton.jit(do_not_specialize=["m"])
    def _linear(x, w, bias, res, norm, y, m, n, eps, stride_x, stride_res, stride_y,
                K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                NORM: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                IEEE: tl.constexpr):
        """Program (block of output columns, block of rows): y[rows, cols] = f(x[rows]) @ w[cols]^T
        (+ bias[cols]) (+ res[rows, cols])."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok, col_ok = rows < m, cols < n
        ks = tl.arange(0, BLOCK_K)
        x_at = x + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
        w_at = w + cols[:, None].to(tl.int64) * K + ks[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        squares = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
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
        if NORM:
            acc = acc * tl.rsqrt(squares / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_ok = row_ok[:, None] & col_ok[None, :]
        if HAS_RES:
            acc += tl.load(res + rows[:, None].to(tl.int64) * stride_res + cols[None, :], mask=out_ok,
                           other=0.0).to(tl.float32)
        tl.store(y + rows[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(y.dtype.element_ty), mask=out_ok)


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


def linear(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm: torch.Tensor | None = None, eps: float = 0.0,
           silu: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``f(x) @ weight^T`` (+ ``bias``) (+ ``residual``) for ``x`` [M, K] (``silu``: [M, 2K], gate
    first), M at most MAX_ROWS, ``weight`` [N, K] contiguous; ``f`` RMSNorm with weight ``norm``
    and ``eps``, or SiLU(gate) x up, or nothing. Into ``out`` [M, N] (may be ``residual`` itself:
    each program reads only the residual entries it writes) or a new tensor."""
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows: these GEMMs take at most {MAX_ROWS}")
    if x.shape[1] != (2 * k if silu else k) or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit (silu={silu})")
    out = torch.empty(m, n, dtype=weight.dtype, device=x.device) if out is None else out
    bm, bn, bk = block_m(m), block_n(n, m), block_k(k, m)
    res = out if residual is None else residual
    _linear[(_cdiv(n, bn), _cdiv(m, bm))](
        x, weight, weight if bias is None else bias, res, weight if norm is None else norm, out, m, n, eps,
        x.stride(0), res.stride(0), out.stride(0), K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        NORM=norm is not None, SILU=silu, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        IEEE=weight.dtype == torch.float32, num_warps=4, num_stages=STAGES)
    return out


def compile_variants(capability: int = 90, shapes=((1536, 8960), (896, 4864)), dtype: str = "bf16") -> dict:
    """Compile ahead of time (no device needed) the variants a model of (hidden, intermediate)
    ``shapes`` launches in ``dtype`` (by default the real target's and draft's), for rows in
    tiles of 16, 32 and 64; {variant: shared memory bytes}. Raises the compiler's error, and for
    a variant that spills registers."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specsplit.engine.kernels import _stack_bytes, aligned

    target, ptr, out = GPUTarget("cuda", capability, 32), f"*{dtype}", {}
    signature = {"x": ptr, "w": ptr, "bias": ptr, "res": ptr, "norm": ptr, "y": ptr, "m": "i32", "n": "i32",
                 "eps": "fp32", "stride_x": "i32", "stride_res": "i32", "stride_y": "i32"}
    even = [a for a in signature if a not in ("m", "eps")]  # as a launch specializes them (``aligned``)
    for hidden, inter in shapes:
        # (K, what runs before the product, bias, residual): q/k/v, o, gate/up, down, the head
        uses = ((hidden, "norm", True, False), (hidden, "", False, True), (hidden, "norm", False, False),
                (inter, "silu", False, True))
        for k, pro, has_bias, has_res in uses:
            for bm in (16, 32, 64):
                for bn in (16, 32) if bm == 16 else (16,):
                    constexprs = {"K": k, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": block_k(k, bm),
                                  "NORM": pro == "norm", "SILU": pro == "silu", "HAS_BIAS": has_bias,
                                  "HAS_RES": has_res, "IEEE": False}
                    kernel = triton.compile(
                        ASTSource(fn=_linear, signature={**signature, **{c: "constexpr" for c in constexprs}},
                                  constexprs=constexprs, attrs=aligned(_linear, even)),
                        target=target, options={"num_warps": 4, "num_stages": STAGES})
                    name = f"linear k{k} {pro or 'plain'} bias={has_bias} res={has_res} m{bm} n{bn}"
                    stack = _stack_bytes(kernel.asm["cubin"])
                    if stack:
                        raise RuntimeError(f"{name}: {stack} bytes of stack (registers spilled)")
                    out[name] = kernel.metadata.shared
    return out
