"""Operations a graph body runs, counted on any device (issue 45): a CPU-side proxy for the
kernels a CUDA graph replays, used by tests/test_fused.py and ``ops/graph_ops.py``.

Every aten operation dispatched inside counts once, views and allocations (no kernel) left out,
and every Triton kernel launched (``specsplit.engine.kernels``) once, as "triton:NAME" (what its
launch does on the host, on Triton's interpreter, is not counted). On CPU torch
decomposes RMSNorm into its elementwise steps where CUDA runs one fused kernel, and casts of bf16
inputs that CUDA's float32-output matmuls skip; the counts are therefore an upper bound on a
CUDA replay's kernels, and the comparison between bodies is what they are for.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten operations that launch no kernel (a new view of the same memory)
VIEWS = frozenset({"view", "_unsafe_view", "expand", "permute", "transpose", "slice", "select", "t", "alias",
                   "as_strided", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unflatten",
                   "detach", "_reshape_alias", "unbind", "empty", "empty_like", "empty_strided"})


class CountOps(TorchDispatchMode):
    """``ops``: the aten operations run inside, by name, views and allocations left out, and the
    Triton kernels launched."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self._in_launch = False
        self._patched: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS and not self._in_launch:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from specsplit.engine import kernels, matmul

        for module, name in ((kernels, "_rope_store"), (kernels, "_attend"), (kernels, "_combine"),
                             (kernels, "_silu_mul"), (matmul, "_linear")):
            kernel = getattr(module, name, None)
            if kernel is not None:
                self._patched.append((kernel, kernel.run))
                kernel.run = self._counted(name.lstrip("_"), kernel.run)
        return super().__enter__()

    def __exit__(self, *exc):
        for kernel, run in self._patched:
            kernel.run = run
        self._patched.clear()
        return super().__exit__(*exc)

    def _counted(self, name: str, run):
        def launch(*args, **kwargs):
            self.ops[f"triton:{name}"] += 1
            self._in_launch = True
            try:
                return run(*args, **kwargs)
            finally:
                self._in_launch = False

        return launch


def body_ops(model, body: str, batch: int, tokens: int, keys: int = 256) -> collections.Counter:
    """The operations of one static-shape forward of ``model`` (``batch`` sessions x ``tokens``
    new tokens over ``keys`` cache entries, tree inputs) through graph body ``body``, on the
    model's device."""
    from specsplit.engine.graphs import GraphRunner
    from specsplit.engine.kvpool import KVPool, pool_shape

    p = next(model.parameters())
    pool = KVPool(pool_shape(model, max(keys, 256), p.dtype), batch, p.device, scratch=True)
    run = GraphRunner(model, pool, model.config.vocab_size, "static", body=body)
    if run.body != body:
        raise ValueError(f"{type(model).__name__}: no {body} body ({run.fused_not})")
    inp = run._buffers(batch, tokens, True)
    with torch.no_grad(), CountOps() as count:
        run._body(inp, batch, tokens, keys, True)
    return count.ops


def ops_per_layer(make_model, body: str, batch: int, tokens: int) -> tuple[float, int]:
    """(operations a decoder layer adds, the rest of the forward's): ``make_model(layers)`` builds
    the same model with 2 and with 4 layers."""
    two, four = (sum(body_ops(make_model(n), body, batch, tokens).values()) for n in (2, 4))
    per_layer = (four - two) / 2
    return per_layer, int(two - 2 * per_layer)
