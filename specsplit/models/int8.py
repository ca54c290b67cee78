"""int8 Linear layers whose every output row depends on its own input row only.

``torch.ao`` dynamic int8 quantizes a forward's activations with ONE scale for the whole batch
(min/max over every row), so a token's logits depend on which other tokens share its forward: a
1-token decoding step and a 16-node tree verification round the same hidden state differently,
and a quantized target's speculative output drifts from its own greedy decoding.

``RowInt8Linear`` quantizes each activation row by its own absolute maximum (per token), with the
int8 weights quantized per output channel:

- each row ``x_i`` is divided by ``s_i = max|x_i|`` (exact IEEE division: the row's values land in
  [-1, 1] and its extreme lands exactly on +-1);
- two constant columns holding +1 and -1 are appended to every row (and two zero columns to the
  weights, so they add nothing), so the range fbgemm's dynamic kernel measures is always exactly
  [-1, 1]: its activation scale and zero point are the same constants in every forward, and a
  row's 8-bit codes depend on that row alone (columns, not an extra row: a 1-row GEMM keeps
  fbgemm's faster 1-row path);
- the int8 x int8 products accumulate in int32 (exact; activations use fbgemm's reduced 7-bit range,
  so its 16-bit pairwise sums cannot saturate on AVX2), are dequantized element by element, scaled
  back by ``s_i`` and the bias added in float32.

So a row's output is bit-identical whatever else is in the batch (a test checks every batch
size and offset), and per-row scales are also closer to the float model than one scale per batch.
The extra columns and the row scaling cost little at batch 1 (docs/results.md, commit 5d6f6b2).

Where oneDNN has an exact int8 GEMM (AMX or VNNI: int32 accumulation without 16-bit saturation,
checked once per process by ``onednn_int8_supported``), the same per-row scheme runs there
instead (``kernel="onednn"``): every row is quantized to 8-bit codes by its own max|x| (u8 with zero
point 128), oneDNN multiplies u8 x s8 into int32 (exact, in any order) and dequantizes element by
element, and the row scale comes back after. No range columns are needed (the scale is ours, not
measured by the kernel), activations keep 8 bits instead of fbgemm's 7, and on AMX a 16-token
forward costs little more than a 1-token one: the int8 weights stream from memory either way, and
fbgemm's GEMMs become compute-bound past a few rows (docs/results.md, commit a2b7f60).

That alone is not enough: float32 attention sums over keys in an order that depends on the
forward's shape, so a batch-invariant target also runs a batch-invariant attention
(``quantize_int8``: ``specsplit.models.blocked``'s, else ``specsplit.models.fp64``'s).
"""

from __future__ import annotations

import concurrent.futures
import warnings

import torch

from specsplit.models.attention import register_gqa_attention
from specsplit.models.blocked import BLOCKED_ATTENTION, use_invariant_attention
from specsplit.models.fp64 import FP64_ATTENTION
from specsplit.models.fp64 import fp64_attention as fp64_attention  # re-exported: its home was here
from specsplit.models.fp64 import use_fp64_attention as use_fp64_attention  # re-exported, as above
from specsplit.models.int8_cache import Int8Codes

_TINY = torch.finfo(torch.float32).tiny


def prompt_attention_name(model) -> str | None:
    """The attention a model on ``fp64_attention`` (or ``specsplit.models.blocked``'s attention,
    which computes short contexts the same way) prefills long prompts with: the registered name
    of ``specsplit.models.attention.gqa_attention`` (float32; sdpa with ``enable_gqa`` for chunks
    of more than 16 tokens). float64 keeps a token's attention output the same in a decoding step,
    a prefill and a tree, which a prompt does not need: it is always prefilled the same way
    (``TargetEngine``: the same chunks from position 0, and only the prompt's tokens), so its
    cache is the same every time, and float32 prefills long prompts much faster
    (docs/results.md, commit 757c61d). None: any other attention (prompts as every forward)."""
    if model.config._attn_implementation not in (FP64_ATTENTION, BLOCKED_ATTENTION):
        return None
    return register_gqa_attention()


class RowInt8Linear(torch.nn.Module):
    """Inference-only stand-in for a CPU ``nn.Linear``: int8 GEMM, per-channel int8 weights,
    per-row activation scales (see the module docstring). float32 in, float32 out. ``kernel``:
    "onednn" or "fbgemm" (None: oneDNN where ``onednn_int8_supported``, else fbgemm)."""

    def __init__(self, linear: torch.nn.Linear, kernel: str | None = None, codes: dict | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel or default_kernel()
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()
        if codes is None:  # else ``weight_codes`` of this weight and kernel, kept (``specsplit.models.int8_cache``)
            codes = weight_codes(linear.weight.detach(), self.kernel)
        zero = torch.zeros(self.out_features, dtype=torch.long)
        if self.kernel == "onednn":
            self._w_scale = codes["scale"]
            self._packed = torch.ops.onednn.qlinear_prepack(codes["codes"], None)
            self._ones = torch.ones(self.out_features)
            self._zeros = zero.int()
            return
        with warnings.catch_warnings():  # quantized tensor creation is deprecated; fbgemm still takes them
            warnings.simplefilter("ignore")
            w_q = torch._make_per_channel_quantized_tensor(codes["codes"], codes["scale"], zero, 0)
        self._packed = torch.ops.quantized.linear_prepack(w_q, None)
        self._range = torch.tensor([[1.0, -1.0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min_(_TINY)  # [M, 1] (faster than an inf-norm here)
        if self.kernel == "onednn":
            out = _onednn_gemm(_bucketed(_row_codes(rows, scale)), self._packed, self._ones, self._zeros)
            out = out[: rows.shape[0]].mul_(self._w_scale)  # [M, N]
        else:
            rows = torch.cat([rows / scale, self._range.expand(rows.shape[0], 2)], dim=1)
            out = torch.ops.quantized.linear_dynamic(rows, self._packed, True)
        out = out.mul_(scale) if self.bias is None else torch.addcmul(self.bias, out, scale, out=out)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernel={self.kernel}")


KERNELS = ("onednn", "fbgemm")
_CODE_ZERO = 128  # u8 activation codes: round(127 * x / max|x|) + 128, in [1, 255]
EXACT_ROWS = 16  # GEMMs of up to this many rows run at their size; more are padded to a bucket


def row_bucket(m: int) -> int:
    """The row count a GEMM of ``m`` rows runs at: ``m`` up to EXACT_ROWS (decoding steps and
    trees), else the next multiple of 16 up to 256 (batched verification), else of 256 (prompt
    chunks). oneDNN keeps a primitive (JIT code, scratchpad) per shape in a process-wide cache
    of 1024; with every row count its own shape, a worker's RSS kept growing as new batch sizes
    appeared (the tiny soak; docs/results.md, commit 7813a66). Buckets bound the shapes at
    about 50 row counts per layer shape, so the cache fills early and stays put; padded rows are
    zeros (code 128) and are dropped, and rows never depend on each other."""
    if m <= EXACT_ROWS:
        return m
    step = 16 if m <= 256 else 256
    return -(-m // step) * step


def row_buckets(lo: int, hi: int) -> list[int]:
    """The distinct row counts ``row_bucket`` runs GEMMs of ``lo``..``hi`` rows at, ascending."""
    out, m = [], max(1, lo)
    while m <= hi:
        out.append(row_bucket(m))
        m = out[-1] + 1
    return out


def warm_gemms(layers, rows) -> int:
    """Create oneDNN's primitives for the int8 GEMMs ``layers`` run at the row counts ``rows``
    (each distinct weight shape once per row bucket: layers of one shape share a primitive), on
    the calling thread's torch thread count (part of oneDNN's key). A worker that did not meet
    every bucket by its warm sample kept creating them later, and its RSS grew with each (the
    tiny soak; docs/results.md, commit c790546). Zero codes (the zero point) in, nothing kept;
    returns the GEMMs run."""
    shapes: dict[tuple[int, int], RowInt8Linear] = {}
    for layer in layers:
        if isinstance(layer, RowInt8Linear) and layer.kernel == "onednn":
            shapes.setdefault((layer.in_features, layer.out_features), layer)
    buckets = sorted({row_bucket(m) for m in rows})
    with torch.no_grad():
        for (k, _), layer in shapes.items():
            for m in buckets:
                codes = torch.full((m, k), _CODE_ZERO, dtype=torch.uint8)
                _onednn_gemm(codes, layer._packed, layer._ones, layer._zeros)
    return len(shapes) * len(buckets)


def _bucketed(codes: torch.Tensor) -> torch.Tensor:
    pad = row_bucket(codes.shape[0]) - codes.shape[0]
    return torch.nn.functional.pad(codes, (0, 0, 0, pad), value=_CODE_ZERO) if pad else codes


def weight_codes(weight: torch.Tensor, kernel: str) -> dict[str, torch.Tensor]:
    """What ``RowInt8Linear`` packs for ``kernel`` from a weight [N, K] (any float dtype): its int8
    ``codes`` and per output channel ``scale``. oneDNN: symmetric codes in [-127, 127] [N, K] and
    the dequantization scale (the weight's scale / 127, the activation codes') in float32; fbgemm:
    per-channel codes [N, K + 2] (two zero columns for the range columns) and their scales in
    float64."""
    w = weight.float()
    if kernel == "onednn":
        lo, hi = torch.aminmax(w, dim=1)  # max |w| per row without an |w| copy (a 1.5B target's start)
        scales = torch.maximum(hi, lo.neg_()).clamp_min_(1e-12).div_(127.0)  # [N]
        codes = w.div(scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # [N, K]
        return {"codes": codes, "scale": (scales / 127.0).float().contiguous()}
    scales = (w.abs().amax(dim=1).clamp_min(1e-12) / 127.0).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    w = torch.cat([w, w.new_zeros(w.shape[0], 2)], dim=1)  # the two range columns
    with warnings.catch_warnings():  # quantized tensor creation is deprecated; fbgemm still takes them
        warnings.simplefilter("ignore")
        codes = torch.quantize_per_channel(w, scales, zero, 0, torch.qint8).int_repr()
    return {"codes": codes, "scale": scales}


def _onednn_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantization scale [N], oneDNN-packed int8 weights) of a float weight [N, K] (``weight_codes``)."""
    c = weight_codes(w, "onednn")
    return c["scale"], torch.ops.onednn.qlinear_prepack(c["codes"], None)


def _row_codes(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """u8 codes [M, K] of float rows [M, K], each row by its own scale [M, 1] (element-wise: a
    row's codes depend on that row alone)."""
    return torch.round(rows / scale * 127.0).add_(_CODE_ZERO).to(torch.uint8)


def _onednn_gemm(codes: torch.Tensor, packed: torch.Tensor, ones: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """float32 [M, N] = (codes - 128) @ int8 weights.T, accumulated in int32 and converted once
    (unit scales: oneDNN picks other kernels for other shapes, e.g. a 1-row GEMV, and they apply
    non-unit scales in different orders, 1 ulp apart; the caller scales element-wise instead).
    ``ones`` [N] float32, ``zeros`` [N] int32."""
    return torch.ops.onednn.qlinear_pointwise(codes, 1.0, _CODE_ZERO, packed, ones, zeros, None,
                                              1.0, 0, torch.float32, "none", [], "")


_ONEDNN_OK: bool | None = None


def onednn_int8_supported() -> bool:
    """Whether oneDNN's int8 GEMM is exact here (checked once): int32 accumulation of u8 x s8
    products with no 16-bit saturation (AMX or VNNI; an AVX2-only CPU's pairwise 16-bit sums
    saturate at these extremes), and a row's result independent of the rows beside it."""
    global _ONEDNN_OK
    if _ONEDNN_OK is None:
        _ONEDNN_OK = _onednn_exact()
    return _ONEDNN_OK


def _onednn_exact() -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        k, n = 256, 48
        w = torch.randint(-127, 128, (n, k), generator=g).float()
        w[:, 0] = 127.0  # every row's scale is exactly 1, so its codes are w itself
        w[0], w[1] = 127.0, -127.0  # products of extreme codes: pairwise 16-bit sums would saturate
        codes = torch.randint(1, 256, (7, k), generator=g, dtype=torch.uint8)
        codes[0], codes[1] = 255, 1
        _, packed = _onednn_weights(w)
        ones, zeros = torch.ones(n), torch.zeros(n, dtype=torch.int32)
        with torch.no_grad():
            out = _onednn_gemm(codes, packed, ones, zeros)  # [7, N]
            exact = (codes.double() - _CODE_ZERO) @ w.double().t()  # |values| < 2^24: exact in float32
            if not torch.equal(out.double(), exact):
                return False
            return all(torch.equal(_onednn_gemm(codes[i:i + 1], packed, ones, zeros), out[i:i + 1])
                       for i in range(codes.shape[0]))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def default_kernel() -> str:
    return "onednn" if onednn_int8_supported() else "fbgemm"


def int8_supported() -> bool:
    """Whether this torch build has the fbgemm int8 kernels (x86 CPUs)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def code_shapes(linear: torch.nn.Linear, kernel: str) -> dict[str, tuple[int, ...]]:
    """The shapes of ``weight_codes`` of ``linear``'s weight for ``kernel``."""
    n, k = linear.out_features, linear.in_features
    return {"codes": (n, k if kernel == "onednn" else k + 2), "scale": (n,)}


CODE_DTYPES = {"onednn": {"codes": torch.int8, "scale": torch.float32},
               "fbgemm": {"codes": torch.int8, "scale": torch.float64}}


def _linears(model) -> list[tuple[str, torch.nn.Module, str, torch.nn.Linear]]:
    """(qualified name, parent, attribute, layer) of every plain Linear layer of ``model``."""
    return [(f"{pname}.{name}" if pname else name, parent, name, child) for pname, parent in model.named_modules()
            for name, child in parent.named_children() if type(child) is torch.nn.Linear]


def _codes_of(model_dir, kernel: str, linears) -> Int8Codes:
    """The kept codes of ``linears`` (``_linears``: a model's, loaded from ``model_dir``) for ``kernel``."""
    return Int8Codes(model_dir, kernel, [(q, code_shapes(child, kernel)) for q, _, _, child in linears],
                     CODE_DTYPES[kernel], linears[0][3].weight.dtype if linears else torch.float32)


def keep_codes(model_dir, dtype: str = "bfloat16", kernels=KERNELS) -> dict[str, str]:
    """Write the int8 codes of the model in ``model_dir``, loaded in ``dtype`` (the target's), beside
    it for each of ``kernels``, as a target's first start would (``specsplit models pull
    --int8-codes``: for a model volume the workers mount read-only, so their starts only pack). No
    kernel is needed to compute codes, so any machine can write the codes of both. Returns each
    kernel's ``Int8Codes.status`` ("hit": already there)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), local_files_only=True)
    linears = _linears(model)
    out = {}
    for kernel in kernels:
        cache = _codes_of(model_dir, kernel, linears)
        if cache.status != "hit":
            for qname, _, _, child in linears:
                cache.put(qname, weight_codes(child.weight.detach(), kernel))
        cache.close()
        out[kernel] = cache.status
    return out


def _dynamic_int8(linear: torch.nn.Linear) -> torch.nn.Module:
    """torch.ao's dynamic int8 of one Linear layer (float32 first), one activation scale a forward."""
    wrapped = torch.nn.Sequential(linear.float())
    torch.ao.quantization.quantize_dynamic(wrapped, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    return wrapped[0]


def quantize_int8(model, *, batch_invariant: bool = True, kernel: str | None = None, cache_dir=None,
                  report: dict | None = None):
    """int8 Linear layers, converted layer by layer (each goes to float32 just before it is
    quantized; a draft's, a few side by side on the caller's threads), then the rest (embeddings,
    norms) to float32, the activations int8 layers take. Peak memory stays near the loaded
    model's instead of a whole float32 copy (a 1.5B target: ~5 GB instead of ~11 GB).

    ``batch_invariant`` (a target, which must equal its own greedy decoding whatever the tree's
    shape): ``RowInt8Linear`` layers and a batch-invariant attention
    (``specsplit.models.blocked.use_invariant_attention``: blocked float32 where this machine's
    kernels pass its check, else ``fp64_attention``). Otherwise (a draft, which only
    proposes): torch.ao dynamic int8 with one activation scale per forward, the fastest at one
    row.

    ``cache_dir`` (a target's model directory): its layers' codes are read from there when a
    quantization of these weights left them (``specsplit.models.int8_cache``), else kept there for
    the next start; ``report["int8_cache"]`` says which ("hit", "written", "stale", "unwritable",
    "miss": no weight files there)."""
    if not int8_supported():
        raise RuntimeError("int8 quantization needs torch's fbgemm kernels (an x86 CPU build); "
                           "set SPECSPLIT_*_QUANTIZE=none")
    torch.backends.quantized.engine = "fbgemm"
    linears = _linears(model)
    cache = None
    if batch_invariant:
        kernel = kernel or default_kernel()
        cache = _codes_of(cache_dir, kernel, linears) if cache_dir is not None else None
    try:
        with warnings.catch_warnings():  # torch.ao dynamic quantization is deprecated, still the fastest here
            warnings.simplefilter("ignore")
            if batch_invariant:
                for qname, parent, name, child in linears:
                    codes = cache.get(qname) if cache is not None else None
                    if codes is None:
                        codes = weight_codes(child.weight.detach(), kernel)
                        if cache is not None:
                            cache.put(qname, codes)
                    setattr(parent, name, RowInt8Linear(child, kernel, codes))
            else:
                # fbgemm packs a layer on one thread (most of the time here) and lets go of the
                # interpreter meanwhile: layers side by side on the caller's threads (a worker's
                # prefill threads, every core at a start) take 0.6-0.85x the time on 2 cores
                with concurrent.futures.ThreadPoolExecutor(max(1, torch.get_num_threads()),
                                                           thread_name_prefix="int8") as pool:
                    for (_, parent, name, _), quantized in zip(linears, pool.map(_dynamic_int8, [c for *_, c in linears])):
                        setattr(parent, name, quantized)
    finally:
        if cache is not None:
            cache.close()
            if report is not None:
                report["int8_cache"] = cache.status
    if batch_invariant:
        use_invariant_attention(model)
    return model.float()
