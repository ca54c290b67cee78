"""Prepacked oneDNN weights for bf16/fp16 ``nn.Linear`` layers on CPU.

``torch.nn.functional.linear`` on a bf16 CPU tensor hands the plain weight to oneDNN, which
reorders it into its blocked layout on every call; for a batch of 1-32 tokens that reorder is a
large part of the matmul. Reordering once at load time (what inductor's weight freezing does)
gives bit-identical results — a test checks it — and faster forwards, so that one thread of
packed weights keeps up with two unpacked (docs/results.md, commit 75e0f3e).
"""

from __future__ import annotations

import torch

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)


class PackedLinear(torch.nn.Module):
    """Inference-only stand-in for ``nn.Linear`` holding a oneDNN-packed weight (no autograd).
    ``weight`` is the packed tensor (an opaque layout: use it for ``shape`` only)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(linear: torch.nn.Module) -> bool:
    w = getattr(linear, "weight", None)
    return (type(linear) is torch.nn.Linear and w is not None and w.device.type == "cpu"
            and w.dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available())


def _packing_works(linear: torch.nn.Linear) -> bool:
    """Packed and plain outputs are equal on a few rows (guards against builds where the op
    is missing or behaves differently); any failure means: leave the model as it is."""
    try:
        packed = PackedLinear(linear)
        x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)
        with torch.no_grad():
            return torch.equal(packed(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def packing_supported(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU and torch build pack ``dtype`` weights bit-identically (oneDNN's bf16
    reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU has neither)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return _packing_works(torch.nn.Linear(16, 8, bias=False).to(dtype))


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Replace every packable ``nn.Linear`` of ``model`` in place; returns how many were packed
    (0 for fp32 models, other devices, or a torch build without the oneDNN ops). Weights tied to
    another module (the lm_head to the embeddings) get a packed copy; the original stays."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if can_pack(child)]
    if not targets or not _packing_works(targets[0][2]):
        return 0
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
