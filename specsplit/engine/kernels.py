"""Triton kernels for the graphs' fused decoder body (``SPECSPLIT_CUDA_GRAPH_BODY=triton``).

The fused body in torch operations still runs ~17 kernels a layer, most of them a few microseconds
of elementwise work or copies (the rotation's matmul, two ``index_put_``, the gather of a
session's keys and values, the mask, scores, softmax and its cast, the weighted values, two
transposes, SiLU and its product). These kernels do the same work in three launches a layer:

- ``rope_store``: rotary positions (and qwen3's per-head RMSNorm) applied to the q/k/v GEMM's
  output; queries rotated in place, keys rotated and values written straight into the session's
  KV pool slot at its cache positions;
- ``attend``: attention of each session's new tokens over its own pool slot, read in place (no
  gather): the query heads of one KV head together, scores and softmax in float32 as sdpa keeps
  them, online softmax over blocks of keys (flash-decoding), the keys split over several
  programs when one session's few rows would leave the device idle, and a second small kernel
  (``combine``) merging the splits. Visibility comes from the graph's static inputs: every cached
  entry plus the new tokens' own tree (``new_vis``), or a full row per token (``vis``). Only the
  keys up to the session's own length are read, whatever the bucket's;
- ``silu_mul``: SiLU of the gate times the up projection.

RMSNorm and the GEMMs stay torch's (one kernel each). Nothing here syncs with the host: grids and
splits follow from the bucket's static shape. On CPU the tests run the same kernels through
Triton's interpreter (``TRITON_INTERPRET=1``) and compile them for sm_90 with the Triton version
the lent H200 runs (tests/test_kernels.py).
"""

from __future__ import annotations

import os
import re

import numpy
import torch

BLOCK_N = 64  # keys per step of a program's loop
MIN_SPLIT_KEYS = 256  # a program reads at least this many keys before the keys are split further
MAX_BLOCK_M = 32  # query rows (tokens x query heads of one KV head) a program holds (64 spill registers on sm_90)
ROPE_ROWS = 16  # (token, head) rows a program of rope_store rotates
SILU_BLOCK = 1024  # elements a program of silu_mul writes
NEG = -1.0e30  # a masked score: finite, so a row with nothing visible stays finite (padding rows)

try:  # Triton comes with torch's CUDA builds; a CPU install has none (the body then stays torch's)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None


def _interpreter_fixes() -> None:
    """Two gaps of Triton 3.6's interpreter (TRITON_INTERPRET=1: how the tests and the op counts
    run these kernels on CPU) that its compiled kernels do not have: a scalar (a 1-element array
    to it) becomes a loop bound through ``int(array)``, which NumPy 2.4 refuses (take the
    element); and ``tl.dot`` multiplies bfloat16 operands as the raw 16-bit integers it stores
    them in (multiply their float32 values: exact products, as the tensor cores')."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - another Triton
        return
    patch_tensor, dot = interpreter._patch_lang_tensor, interpreter.InterpreterBuilder.create_dot

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def as_float(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(numpy.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def patched_dot(self, a, b, d, *args):
        return dot(self, as_float(a), as_float(b), d, *args)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot


if triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_fixes()


def available(device: torch.device) -> str | None:
    """None when the kernels run on ``device``, else why not."""
    if triton is None:
        return "Triton is not installed"
    if torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1), not {device}"


def supported(head_dim: int, dtype: torch.dtype) -> str | None:
    """None when the kernels take heads of ``head_dim`` in ``dtype``, else why not."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head size {head_dim} (the kernels take powers of two from 16)"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype}"
    return None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _warps(block_m: int, head_dim: int) -> int:
    """Warps of an attention program: 8 from 32 x 128 query elements. Compiled for sm_90 as a
    launch specializes them (16-byte aligned pointers: vectorized, pipelined loads), 4 warps
    hold a 32-row block of 128-wide heads at the 255-register limit and 8 spill a 16-row one
    (tests/test_kernels.py compiles every variant the real pair launches)."""
    return 8 if block_m * head_dim >= 4096 else 4


def plan(batch: int, tokens: int, keys: int, kv_heads: int, group: int, programs: int,
         block_n: int = BLOCK_N) -> tuple[int, int, int]:
    """(BLOCK_M, splits, keys a split) for a bucket's attention: rows of query heads x tokens in
    blocks, and the keys split until about ``programs`` programs run (each reading at least
    MIN_SPLIT_KEYS, in steps of ``block_n``)."""
    rows = tokens * group
    block_m = max(16, min(MAX_BLOCK_M, _pow2(rows)))
    blocks = batch * kv_heads * _cdiv(rows, block_m)
    splits = max(1, min(_cdiv(keys, MIN_SPLIT_KEYS), _cdiv(programs, blocks)))
    per_split = _cdiv(_cdiv(keys, splits), block_n) * block_n
    return block_m, _cdiv(keys, per_split), per_split


if triton is not None:

    _NEG = tl.constexpr(NEG)

    @triton.jit(do_not_specialize=["tokens", "rows"])
    def _rope_store(qkv, cos, sin, qk_norm, kv, slots, lengths, tokens, rows, eps,
                    stride_half, stride_slot, stride_head,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr, QK_NORM: tl.constexpr):
        """Program p: R of the ``rows`` (token n, head h) pairs of the q and k heads, token-major.
        Queries rotate in place; keys rotate and go, with the values, into the pool at (slot,
        head, length + i)."""
        r = tl.program_id(0) * R + tl.arange(0, R)[:, None]  # offsets in int32 but the pool's (fewer registers)
        live = r < rows
        n = r // (HQ + HKV)
        h = r % (HQ + HKV)
        j = tl.arange(0, D)[None, :]
        jp = (j + D // 2) % D  # the partner of x[j] in rotate_half
        row = qkv + n * ((HQ + 2 * HKV) * D)
        x = tl.load(row + h * D + j, mask=live, other=0.0).to(tl.float32)
        xp = tl.load(row + h * D + jp, mask=live, other=0.0).to(tl.float32)
        if QK_NORM:  # qwen3: RMSNorm over each head (normalized, rounded, times the weight, rounded)
            norm = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            x = (x * norm).to(qkv.dtype.element_ty).to(tl.float32)
            xp = (xp * norm).to(qkv.dtype.element_ty).to(tl.float32)
            x = (x * tl.load(qk_norm + h * D + j, mask=live, other=0.0).to(tl.float32))
            x = x.to(qkv.dtype.element_ty).to(tl.float32)
            xp = (xp * tl.load(qk_norm + h * D + jp, mask=live, other=0.0).to(tl.float32))
            xp = xp.to(qkv.dtype.element_ty).to(tl.float32)
        c = tl.load(cos + n * D + j, mask=live, other=0.0).to(tl.float32)
        s = tl.load(sin + n * D + j, mask=live, other=0.0).to(tl.float32)
        y = (x * c + tl.where(j < D // 2, -xp, xp) * s).to(qkv.dtype.element_ty)
        tl.store(row + h * D + j, y, mask=live & (h < HQ))
        is_key = live & (h >= HQ)
        b = n // tokens
        slot = tl.load(slots + b, mask=is_key, other=0).to(tl.int64)
        at = tl.load(lengths + b, mask=is_key, other=0).to(tl.int32) + n % tokens
        dst = kv + slot * stride_slot + (h - HQ) * stride_head + at * D + j
        tl.store(dst, y.to(kv.dtype.element_ty), mask=is_key)
        value = tl.load(row + (h + HKV) * D + j, mask=is_key, other=0.0)
        tl.store(dst + stride_half, value.to(kv.dtype.element_ty), mask=is_key)

    @triton.jit
    def _program_rows(tokens, HKV: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr):
        """An attention program's (session x KV head, session, KV head, its block of query rows,
        which of them exist): rows are the T x G queries of one KV head, token-major."""
        bh = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        return bh, bh // HKV, bh % HKV, rows, rows < tokens * G

    @triton.jit
    def _out_at(out, b, head, rows, tokens, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
        """Where the query rows' outputs go in ``out`` [N, HQ x D]."""
        return (out + (b * tokens).to(tl.int64) * (HQ * D) + head * G * D
                + ((rows // G) * HQ + rows % G)[:, None] * D + tl.arange(0, D)[None, :])

    # integers that change with the bucket are not specialized on (each value would compile anew)
    @triton.jit(do_not_specialize=["tokens", "per_split", "splits", "stride_vis_b", "stride_vis_t"])
    def _attend(qkv, kv, slots, lengths, vis, out, part_o, part_ml,
                tokens, per_split, splits, scaling, stride_vis_b, stride_vis_t,
                stride_half, stride_slot, stride_head,
                HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPACT: tl.constexpr,
                SPLIT: tl.constexpr, IEEE: tl.constexpr):
        """Program (session x KV head, block of rows, split of keys): the rows' attention over
        the split's keys of the session's slot; the normalized output into ``out`` [N, HQ x D],
        or (SPLIT) the unnormalized sums with their running max and total into the partials."""
        bh, b, head, rows, live = _program_rows(tokens, HKV, G, BLOCK_M)
        sp = tl.program_id(2)
        i = rows // G  # the row's token; its query head is head x G + rows % G
        d = tl.arange(0, D)
        # 64-bit scalar bases, 32-bit offsets within a tile (64-bit tiles of pointers spill registers)
        heads = (i * (HQ + 2 * HKV) + rows % G)[:, None] * D + d[None, :]
        q = tl.load(qkv + (b * tokens).to(tl.int64) * ((HQ + 2 * HKV) * D) + head * G * D + heads,
                    mask=live[:, None], other=0.0)
        slot = tl.load(slots + b).to(tl.int64)
        length = tl.load(lengths + b).to(tl.int32)
        start = sp * per_split
        stop = tl.minimum(start + per_split, length + tokens)  # the new tokens' K/V were written
        base = kv + slot * stride_slot + head * stride_head
        seen_at = vis + b.to(tl.int64) * stride_vis_b + i[:, None] * stride_vis_t
        m_i = tl.full([BLOCK_M], _NEG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for n0 in range(start, stop, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            inside = cols < stop
            k = tl.load(base + cols[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scaling
            if COMPACT:  # every cached entry, and among the new tokens what new_vis says
                rel = cols - length
                new = tl.load(seen_at + rel[None, :],
                              mask=live[:, None] & (rel[None, :] >= 0) & (rel[None, :] < tokens), other=0)
                seen = (rel[None, :] < 0) | (new != 0)
            else:
                seen = tl.load(seen_at + cols[None, :], mask=live[:, None] & inside[None, :], other=0) != 0
            s = tl.where(seen, s, _NEG)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.where(inside[None, :], tl.exp(s - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(base + stride_half + cols[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLIT:
            at = (bh * splits + sp).to(tl.int64) * (tokens * G)
            tl.store(part_o + at * D + rows[:, None] * D + d[None, :], acc, mask=live[:, None])
            tl.store(part_ml + at * 2 + rows * 2, m_i, mask=live)
            tl.store(part_ml + at * 2 + rows * 2 + 1, l_i, mask=live)
        else:
            tl.store(_out_at(out, b, head, rows, tokens, HQ, G, D), (acc / l_i[:, None]).to(out.dtype.element_ty),
                     mask=live[:, None])

    @triton.jit(do_not_specialize=["tokens", "splits"])
    def _combine(part_o, part_ml, out, tokens, splits,
                 HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
        """Program (session x KV head, block of rows): the splits' partial sums merged."""
        bh, b, head, rows, live = _program_rows(tokens, HKV, G, BLOCK_M)
        d = tl.arange(0, D)
        m = tl.full([BLOCK_M], _NEG, tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for sp in range(splits):
            at = (bh * splits + sp).to(tl.int64) * (tokens * G)
            m_s = tl.load(part_ml + at * 2 + rows * 2, mask=live, other=_NEG)
            l_s = tl.load(part_ml + at * 2 + rows * 2 + 1, mask=live, other=0.0)
            o_s = tl.load(part_o + at * D + rows[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
            m_new = tl.maximum(m, m_s)
            old, now = tl.exp(m - m_new), tl.exp(m_s - m_new)
            total = total * old + l_s * now
            acc = acc * old[:, None] + o_s * now[:, None]
            m = m_new
        tl.store(_out_at(out, b, head, rows, tokens, HQ, G, D),
                 (acc / tl.maximum(total, 1e-30)[:, None]).to(out.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _silu_mul(gate_up, out, inter, total, BLOCK: tl.constexpr):
        """Program p: elements p x BLOCK.. of out [N, I] = silu(gate) x up (the gate rounded
        first, as torch does)."""
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = e < total
        at = (e // inter) * 2 * inter + e % inter
        gate = tl.load(gate_up + at, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up + at + inter, mask=ok, other=0.0).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(out.dtype.element_ty).to(tl.float32)
        tl.store(out + e, (act * up).to(out.dtype.element_ty), mask=ok)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_norm: torch.Tensor | None, eps: float,
               kv: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, heads: int, kv_heads: int) -> None:
    """``qkv`` [N = B x T, Hq + 2 Hkv, D] (contiguous) rotated by ``cos``/``sin`` [N, D]: queries
    in place, keys and values into ``kv`` [2, slots, Hkv, max_len, D] at each session's
    ``slots`` [B] from its ``lengths`` [B] on."""
    n, _, d = qkv.shape
    tokens = n // slots.shape[0]
    rows = n * (heads + kv_heads)
    _rope_store[(_cdiv(rows, ROPE_ROWS),)](
        qkv, cos, sin, qkv if qk_norm is None else qk_norm, kv, slots, lengths, tokens, rows, eps,
        kv.stride(0), kv.stride(1), kv.stride(2), HQ=heads, HKV=kv_heads, D=d, R=ROPE_ROWS,
        QK_NORM=qk_norm is not None)


def attend(qkv: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, vis: torch.Tensor,
           compact: bool, keys: int, scaling: float, heads: int, kv_heads: int, out: torch.Tensor,
           programs: int, block_n: int = BLOCK_N) -> None:
    """Each session's T new tokens (queries in ``qkv`` [B x T, Hq + 2 Hkv, D]) over its pool
    slot's entries up to its length + T (at most ``keys``) under ``vis`` (compact: [B, T, T]
    among the new tokens, every cached entry seen; else [B, T, >= keys]); ``out`` [B x T, Hq x D].
    ``programs``: how many programs to aim for; ``block_n``: keys a program's step reads."""
    b = slots.shape[0]
    n, _, d = qkv.shape
    tokens, group = n // b, heads // kv_heads
    block_m, splits, per_split = plan(b, tokens, keys, kv_heads, group, programs, block_n)
    grid = (b * kv_heads, _cdiv(tokens * group, block_m), splits)
    ieee = qkv.dtype == torch.float32
    if splits == 1:
        part_o = part_ml = out
    else:
        part_o = torch.empty(b * kv_heads * splits * tokens * group, d, dtype=torch.float32, device=qkv.device)
        part_ml = torch.empty(b * kv_heads * splits * tokens * group, 2, dtype=torch.float32, device=qkv.device)
    _attend[grid](qkv, kv, slots, lengths, vis, out, part_o, part_ml, tokens, per_split, splits, scaling,
                  vis.stride(0), vis.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
                  HQ=heads, HKV=kv_heads, G=group, D=d, BLOCK_M=block_m, BLOCK_N=block_n, COMPACT=compact,
                  SPLIT=splits > 1, IEEE=ieee, num_warps=_warps(block_m, d))
    if splits > 1:
        _combine[grid[:2]](part_o, part_ml, out, tokens, splits, HQ=heads, HKV=kv_heads, G=group, D=d,
                           BLOCK_M=block_m, num_warps=_warps(block_m, d))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) x up of ``gate_up`` [N, 2I] (the gate first): [N, I]."""
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul[(_cdiv(n * inter, SILU_BLOCK),)](gate_up, out, inter, n * inter, BLOCK=SILU_BLOCK)
    return out


def _stack_bytes(cubin: bytes) -> int:
    """The stack frame of a compiled kernel (spilled registers), by Triton's own cuobjdump."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True, timeout=60).stdout
    return max((int(m) for m in re.findall(r"STACK:(\d+)", usage)), default=0)


def aligned(fn, names) -> dict:
    """ASTSource ``attrs`` marking ``fn``'s arguments ``names`` divisible by 16, as Triton's JIT
    specializes them at a launch (pointers to torch's allocations, strides and sizes that are
    multiples of 16): compiled without, loads stay scalar and are not pipelined, and register
    counts differ from the kernels that run."""
    return {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in names}


def compile_variants(capability: int = 90, shapes=((128, 6), (64, 7)), block_ms=(16, 32),
                     dtype: str = "bf16") -> dict:
    """Compile (no device needed: ahead of time, for CUDA compute ``capability``) every variant
    of the kernels that models of ``shapes`` (head size, query heads a KV head; by default the
    real target's and draft's) launch in ``dtype``; {variant: shared memory bytes}. Raises the
    compiler's error for a kernel that does not build, and for an attention variant that spills
    registers (ptxas's count, in the compiled kernel). How the CPU tests check that the kernels
    build for the lent GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    ptr, out = f"*{dtype}", {}

    def build(fn, signature: dict, constexprs: dict, name: str, warps: int = 4) -> None:
        # what a launch specializes as multiples of 16: pointers (``lengths`` points 8 bytes into
        # the graph's inputs), strides and sizes that are not exempt (``do_not_specialize``)
        even = [a for a, kind in signature.items() if (kind.startswith("*") and a != "lengths")
                or (a.startswith("stride_") and a not in ("stride_vis_b", "stride_vis_t"))
                or a in ("inter", "total")]
        signature = {**signature, **{k: "constexpr" for k in constexprs}}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned(fn, even)),
                                target=target, options={"num_warps": warps})
        stack = _stack_bytes(kernel.asm["cubin"])
        if fn is _attend and stack:
            raise RuntimeError(f"{name}: {stack} bytes of stack (registers spilled)")
        out[name] = kernel.metadata.shared

    kv_args = {"stride_half": "i64", "stride_slot": "i64", "stride_head": "i32"}
    hkv = 2  # the real pair's KV heads (the kernels take any)
    for d, g in shapes:
        for norm in (False, True):
            build(_rope_store, {"qkv": ptr, "cos": ptr, "sin": ptr, "qk_norm": ptr, "kv": ptr, "slots": "*i64",
                                "lengths": "*i64", "tokens": "i32", "rows": "i32", "eps": "fp32", **kv_args},
                  {"HQ": g * hkv, "HKV": hkv, "D": d, "R": ROPE_ROWS, "QK_NORM": norm},
                  f"rope_store d{d} g{g} norm={norm}")
        for block_m in block_ms:
            for compact in (True, False):
                for split in (False, True):
                    build(_attend, {"qkv": ptr, "kv": ptr, "slots": "*i64", "lengths": "*i64", "vis": "*i1",
                                    "out": ptr, "part_o": "*fp32", "part_ml": "*fp32", "tokens": "i32",
                                    "per_split": "i32", "splits": "i32", "scaling": "fp32",
                                    "stride_vis_b": "i32", "stride_vis_t": "i32", **kv_args},
                          {"HQ": g * hkv, "HKV": hkv, "G": g, "D": d, "BLOCK_M": block_m, "BLOCK_N": BLOCK_N,
                           "COMPACT": compact, "SPLIT": split, "IEEE": False},
                          f"attend d{d} g{g} m{block_m} compact={compact} split={split}", _warps(block_m, d))
            build(_combine, {"part_o": "*fp32", "part_ml": "*fp32", "out": ptr, "tokens": "i32", "splits": "i32"},
                  {"HQ": g * hkv, "HKV": hkv, "G": g, "D": d, "BLOCK_M": block_m}, f"combine d{d} g{g} m{block_m}",
                  _warps(block_m, d))
    build(_silu_mul, {"gate_up": ptr, "out": ptr, "inter": "i32", "total": "i32"}, {"BLOCK": SILU_BLOCK}, "silu_mul")
    return out
