"""Operations a graph body runs, counted on any device (issue 45): a CPU-side proxy for the
kernels a CUDA graph replays, used by tests/test_fused.py and ``ops/graph_ops.py``.

Every aten operation dispatched inside counts once, views (no kernel) left out. On CPU torch
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
                   "detach", "_reshape_alias", "unbind"})


class CountOps(TorchDispatchMode):
    """``ops``: the aten operations run inside, by name, views left out."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def body_ops(model, body: str, batch: int, tokens: int, keys: int = 256) -> collections.Counter:
    """The operations of one static-shape forward of ``model`` (``batch`` sessions x ``tokens``
    new tokens over ``keys`` cache entries, tree inputs) through graph body ``body``, on the
    model's device."""
    from specsplit.engine.graphs import GraphRunner
    from specsplit.engine.kvpool import KVPool, pool_shape

    p = next(model.parameters())
    pool = KVPool(pool_shape(model, max(keys, 256), p.dtype), batch, p.device, scratch=True)
    run = GraphRunner(model, pool, model.config.vocab_size, "static", body=body)
    if (run.fused is not None) != (body == "fused"):
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
