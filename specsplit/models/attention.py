"""Grouped-query attention without ``repeat_kv``, registered with transformers' attention interface.

transformers' ``sdpa`` attention copies every KV head ``num_key_value_groups`` times
(``repeat_kv``) whenever a forward has more than one query and a mask, which is every tree
level a draft expands: with the 0.5B Qwen draft (14 query heads on 2 KV heads) that copy is
7x the session's whole cache per layer per forward. On a CPU, for a few queries one grouped
matmul per KV head is fastest, ahead of sdpa with ``enable_gqa``; for a prompt chunk the fused
sdpa kernel is (docs/results.md, commit 6362e12). ``gqa_attention`` therefore runs a grouped
matmul (queries of one KV head stacked into one [G*M, D] x [D, L] product) for forwards of up
to ``SMALL_QUERY`` tokens and sdpa with ``enable_gqa`` above that. Neither copies the cache.

On CUDA (``specsplit.backends.CudaBackend`` switches every sdpa model, grouped or not) the
grouped matmuls serve forwards of up to ``ACCEL_SMALL_QUERY`` tokens over at least
``ACCEL_MIN_KEYS`` keys, with probabilities x values split into chunks of ``ACCEL_VALUE_CHUNK``
keys (``weighted_values``); everything else goes through transformers' own sdpa function (with
a mask, torch's sdpa takes grouped KV heads only through its math kernel). For a few queries
against a long cache sdpa's masked kernel runs one block of threads per head and query block,
so grouped matmuls verify faster over long caches (over a few thousand tokens, the extra
kernel launches cost more than they save); one matmul for probabilities x values (a few
rows over a long inner dimension) again runs few blocks of threads, hence the chunks. Figures:
docs/results.md (GPU), ``ops/results/gpu-attention-*`` and ``ops/results/gpu-longctx-*-grouped*``.
The scores of one forward are bounded (``ACCEL_MAX_SCORES`` elements).

``grouped_attention`` is also the body of the int8 target's float64 attention
(``specsplit.models.fp64.fp64_attention``), which computes in float64 for batch invariance, and of
``specsplit.models.blocked``'s attention for rows that see at most 1024 keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GQA_ATTENTION = "specsplit_gqa"
SMALL_QUERY = 16  # at most this many queries: one grouped matmul; above: sdpa with enable_gqa
ACCEL_SMALL_QUERY = 64  # the same on an accelerator (its matmuls keep their speed up to this)
ACCEL_MAX_SCORES = 1 << 27  # ... while the forward's scores [B, Hq, M, L] stay this small (512 MiB in fp32)
ACCEL_MIN_KEYS = 8192  # ... over at least this many keys (below, sdpa's one kernel launches less)
ACCEL_VALUE_CHUNK = 1024  # probabilities x values as a batch of matmuls over this many keys each (0: one)


def weighted_values(probs: torch.Tensor, value: torch.Tensor, chunk: int) -> torch.Tensor:
    """probs [B, Hkv, R, L] x value [B, Hkv, L, D] -> [B, Hkv, R, D]. With ``chunk``, the keys are
    split into chunks of ``chunk`` multiplied as one batch and summed in float32 (or wider): a
    product with a few rows and a long inner dimension otherwise runs on a few blocks of threads."""
    length = value.shape[2]
    n = length // chunk if chunk else 0
    if n < 2:
        return torch.matmul(probs, value)
    main = n * chunk
    parts = torch.matmul(probs[..., :main].unflatten(-1, (n, chunk)).transpose(2, 3),
                         value[:, :, :main].unflatten(2, (n, chunk)))  # [B, Hkv, n, R, D]
    out = parts.sum(dim=2, dtype=torch.promote_types(value.dtype, torch.float32))
    if main < length:
        out += torch.matmul(probs[..., main:], value[:, :, main:])
    return out.to(value.dtype)


def grouped_attention(query, key, value, attention_mask, scaling, compute_dtype: torch.dtype,
                      value_chunk: int = 0, softcap: float | None = None, sinks: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Attention computed in ``compute_dtype``, result in the query's dtype: query [B, Hq, M, D],
    key/value [B, Hkv, L, D], an additive float or bool mask [B|1, 1, M, >=L] or None for causal;
    returns [B, M, Hq, D]. The query heads of one KV head share one matmul (``value_chunk``:
    ``weighted_values``). ``softcap`` (Gemma 2's attention logit softcapping): scores become
    ``softcap * tanh(scores / softcap)`` before the mask, as transformers' eager attention does.
    ``sinks`` [Hq] (gpt-oss's attention sinks): one more logit a head in each row's softmax,
    whose probability is dropped."""
    b, hq, m, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    groups = hq // hkv
    q = query.to(compute_dtype).reshape(b, hkv, groups * m, d)
    scores = torch.matmul(q, key.to(compute_dtype).transpose(-1, -2))
    scores = scores.view(b, hkv, groups, m, length).mul_(d ** -0.5 if scaling is None else scaling)
    if softcap:
        scores.div_(softcap).tanh_().mul_(softcap)
    if attention_mask is None:
        causal = torch.ones(m, length, dtype=torch.bool, device=query.device).tril(length - m)
        scores.masked_fill_(~causal, float("-inf"))
    else:
        mask = attention_mask[..., :length][:, :, None]  # [B|1, 1, 1, M, L]
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.to(compute_dtype))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).view(b, hkv, groups * m, length)
    else:
        sink = sinks.to(compute_dtype).view(1, hkv, groups, 1, 1).expand(b, hkv, groups, m, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :length]
        probs = probs.reshape(b, hkv, groups * m, length)
    out = weighted_values(probs, value.to(compute_dtype), value_chunk).view(b, hq, m, d)
    return out.transpose(1, 2).to(query.dtype).contiguous()


def grouped(query: torch.Tensor, length: int) -> bool:
    """Whether a forward of ``query`` [B, Hq, M, D] over ``length`` keys runs the grouped matmuls."""
    m = query.shape[2]
    if query.device.type == "cpu":
        return m <= SMALL_QUERY
    return (m <= ACCEL_SMALL_QUERY and length >= ACCEL_MIN_KEYS
            and query.shape[0] * query.shape[1] * m * length <= ACCEL_MAX_SCORES)


def gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature; returns ([B, M, Hq, D], None)."""
    m, length = query.shape[2], key.shape[2]
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap or sinks is not None or grouped(query, length):  # sdpa has neither softcapping nor sinks
        chunk = 0 if query.device.type == "cpu" else ACCEL_VALUE_CHUNK
        return grouped_attention(query, key, value, attention_mask, scaling, query.dtype, chunk, softcap,
                                 sinks), None
    if query.device.type != "cpu":
        # transformers' own: with a mask, torch's sdpa serves grouped KV heads only through its
        # math kernel (repeat_kv, or one query's heads packed, keeps the memory-efficient one)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
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


def use_gqa_attention(model, *, grouped_only: bool = True) -> bool:
    """Switch ``model`` from sdpa to ``gqa_attention`` (masks built as for eager attention: a
    float additive mask). Only models on sdpa change, and with ``grouped_only`` only those with
    grouped KV heads; returns whether ``model`` did."""
    cfg = model.config
    heads, kv_heads = getattr(cfg, "num_attention_heads", 0), getattr(cfg, "num_key_value_heads", None)
    if cfg._attn_implementation != "sdpa" or (grouped_only and (not kv_heads or heads == kv_heads)):
        return False
    model.set_attn_implementation(register_gqa_attention())
    return True
