"""Attention in float64, rounded to float32: a token's output the same whatever the forward's shape.

float32 attention sums over keys in an order that depends on the forward's shape (MKL picks
other kernels for 1-3 query rows, a tree lays its keys out differently from sequential
decoding), and for the int8 target (``specsplit.models.int8``) a 1-ulp difference that moves one
activation across an int8 rounding boundary grows through 28 layers (logits differed by ~2 with
float32 attention). ``fp64_attention`` (registered with transformers' attention interface as
``"specsplit_fp64"``) computes scores, softmax and the weighted sum in float64 and rounds the
result to float32: order-dependent differences (~1e-16) then vanish in that rounding, so a
token's attention output is the same in a decoding step, a prefill and a tree, at a small cost
per forward (docs/results.md, commit 5d6f6b2). ``specsplit.models.blocked`` falls back to it
where its own float32 attention is not batch-invariant on this machine.
"""

from __future__ import annotations

import torch

from specsplit.models.attention import grouped_attention

FP64_ATTENTION = "specsplit_fp64"


def fp64_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention in float64, result in the query's dtype (transformers' attention-function
    signature: query [B, Hq, M, D], key/value [B, Hkv, L, D], an additive float or bool mask
    [B|1, 1, M, >=L] or None for causal; returns ([B, M, Hq, D], None)). Grouped-query heads
    share one matmul per KV head; ``softcap`` and sinks (``s_aux``) as ``grouped_attention``."""
    return grouped_attention(query, key, value, attention_mask, scaling, torch.float64,
                             softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux")), None


def use_fp64_attention(model) -> None:
    """Switch ``model`` to ``fp64_attention`` (masks built as for eager attention: always a
    float additive mask)."""
    # transformers (seconds to import) only to register: kernel-only users never load it
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(FP64_ATTENTION, fp64_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FP64_ATTENTION, eager_mask)
    model.set_attn_implementation(FP64_ATTENTION)
