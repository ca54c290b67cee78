"""Grouped-query attention without ``repeat_kv``, registered with transformers' attention interface.

transformers' ``sdpa`` attention copies every KV head ``num_key_value_groups`` times
(``repeat_kv``) whenever a forward has more than one query and a mask, which is every tree
level a draft expands: with the 0.5B Qwen draft (14 query heads on 2 KV heads) that copy is
7x the session's whole cache per layer per forward. Measured on the 2-core box, one layer,
1 thread, 64-dim heads: at 16K cached tokens and 2 queries, sdpa with ``repeat_kv`` 67 ms,
sdpa with ``enable_gqa`` 6.8 ms, one grouped matmul per KV head 4.0 ms; at 2K cached and 8
queries 3.4 / 1.1 / 0.9 ms; for a 256-token prompt chunk the fused sdpa kernel is best (at 16K:
310 / 258 / 551 ms). ``gqa_attention`` therefore runs a grouped matmul (queries of one KV head
stacked into one [G*M, D] x [D, L] product) for forwards of up to ``SMALL_QUERY`` tokens and
sdpa with ``enable_gqa`` above that. Neither copies the cache.

``grouped_attention`` is also the body of the int8 target's float64 attention
(``specsplit.models.int8.fp64_attention``), which computes in float64 for batch invariance, and of
``specsplit.models.blocked``'s attention for rows that see at most 1024 keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GQA_ATTENTION = "specsplit_gqa"
SMALL_QUERY = 16  # at most this many queries: one grouped matmul; above: sdpa with enable_gqa


def grouped_attention(query, key, value, attention_mask, scaling, compute_dtype: torch.dtype) -> torch.Tensor:
    """Attention computed in ``compute_dtype``, result in the query's dtype: query [B, Hq, M, D],
    key/value [B, Hkv, L, D], an additive float or bool mask [B|1, 1, M, >=L] or None for causal;
    returns [B, M, Hq, D]. The query heads of one KV head share one matmul."""
    b, hq, m, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    groups = hq // hkv
    q = query.to(compute_dtype).reshape(b, hkv, groups * m, d)
    scores = torch.matmul(q, key.to(compute_dtype).transpose(-1, -2))
    scores = scores.view(b, hkv, groups, m, length).mul_(d ** -0.5 if scaling is None else scaling)
    if attention_mask is None:
        causal = torch.ones(m, length, dtype=torch.bool, device=query.device).tril(length - m)
        scores.masked_fill_(~causal, float("-inf"))
    else:
        mask = attention_mask[..., :length][:, :, None]  # [B|1, 1, 1, M, L]
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.to(compute_dtype))
    probs = torch.softmax(scores, dim=-1).view(b, hkv, groups * m, length)
    out = torch.matmul(probs, value.to(compute_dtype)).view(b, hq, m, d)
    return out.transpose(1, 2).to(query.dtype).contiguous()


def gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature; returns ([B, M, Hq, D], None)."""
    m, length = query.shape[2], key.shape[2]
    if m <= SMALL_QUERY:
        return grouped_attention(query, key, value, attention_mask, scaling, query.dtype), None
    if attention_mask is not None:
        mask = attention_mask[..., :length]
    elif m < length:  # causal below cached keys: the last query sees every key (as grouped_attention)
        mask = torch.ones(m, length, dtype=torch.bool, device=query.device).tril(length - m)
    else:
        mask = None
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling,
        is_causal=mask is None, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_gqa_attention() -> str:
    """Register ``gqa_attention`` with transformers' attention interface (masks built as for eager
    attention: a float additive mask); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(GQA_ATTENTION, gqa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_ATTENTION, eager_mask)
    return GQA_ATTENTION


def use_gqa_attention(model) -> bool:
    """Switch ``model`` from sdpa to ``gqa_attention`` (masks built as for eager attention: a
    float additive mask). Only models on sdpa with grouped KV heads change; returns whether
    ``model`` did."""
    cfg = model.config
    heads, kv_heads = getattr(cfg, "num_attention_heads", 0), getattr(cfg, "num_key_value_heads", None)
    if cfg._attn_implementation != "sdpa" or not kv_heads or heads == kv_heads:
        return False
    model.set_attn_implementation(register_gqa_attention())
    return True
