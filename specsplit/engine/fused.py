"""The graphs' decoder forward in fewer kernels than transformers' modules launch.

A CUDA graph removes launch overhead but not the kernels: on the H200 a replayed 1-token forward
of the 1.5B target ran 1,345 kernels, ~3.7 ms of device time against a 0.74 ms weight-bytes floor,
most of them elementwise work of a few microseconds each (docs/results.md, GPU). This body runs
the same decoder (llama, qwen2, qwen3: RMSNorm, rotary positions, grouped-query attention, a
SiLU-gated MLP) over the same weights, per layer in ~17 kernels instead of ~48:

- q/k/v in one GEMM and gate/up in one (the modules' weights become views of the fused tensors,
  so the eager path reads the same memory and nothing is stored twice);
- the residual added inside the output GEMMs (``addmm``), RMSNorm as torch's one fused kernel;
- rotary positions as one batched matmul per layer with each token's [D, D] rotation, built
  once per forward from the model's own rotary module (the same cos/sin as transformers');
- new K/V written into the pool with one ``index_put_`` each, keys and values read back in one
  gather of the sessions' (slot, KV head) runs; the query heads of one KV head share one score matmul, scores and
  softmax in float32 (as sdpa keeps them) under a mask expanded once per forward.

Numerics differ from transformers' modules only in rounding (one rounding where they round
twice); tests/test_graphs.py holds its logits and caches to the eager forward's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.models.attention import ACCEL_VALUE_CHUNK, weighted_values

FAMILIES = ("llama", "qwen2", "qwen3")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # cos/sin that depend on the position alone
ATTENTION = ("sdpa", "eager", "specsplit_gqa")  # attention the body's own grouped matmuls replace


class Unsupported(ValueError):
    """The model is not one this body runs (its forwards keep transformers' modules)."""


def _fuse(linears: list[nn.Linear], name: str) -> torch.Tensor | None:
    """One tensor of the ``name`` parameters ("weight" or "bias") of ``linears``, stacked by output
    rows; each module's parameter becomes a view of it, so nothing is stored twice. Already fused
    (the model built before): the existing storage."""
    parts = [getattr(lin, name) for lin in linears]
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise Unsupported(f"some of the fused projections have a {name} and some not")
    fused = _stacked([p.detach() for p in parts])
    if fused is None:
        fused = torch.cat([p.detach() for p in parts])
        at = 0
        for lin, p in zip(linears, parts):
            setattr(lin, name, nn.Parameter(fused[at:at + p.shape[0]], requires_grad=False))
            at += p.shape[0]
    return fused


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """``parts`` as one tensor when they lie back to back in one storage, in order; else None."""
    first = parts[0]
    ptr, at = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in parts:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != ptr or p.storage_offset() != at:
            return None
        at += p.numel()
    return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride(),
                            first.storage_offset())


class _Layer:
    """One decoder layer's tensors, fused where the body runs them as one kernel."""

    def __init__(self, layer, heads: int, kv_heads: int, head_dim: int):
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(p) is not nn.Linear for p in projections):
            raise Unsupported("projections other than nn.Linear (a quantized model)")
        if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None or mlp.down_proj.bias is not None:
            raise Unsupported("an MLP with biases")
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.qkv, self.qkv_bias = _fuse(qkv, "weight"), _fuse(qkv, "bias")
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj], "weight")
        self.o, self.o_bias, self.down = attn.o_proj.weight, attn.o_proj.bias, mlp.down_proj.weight
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.qk_norm, self.qk_eps = None, 0.0
        if hasattr(attn, "q_norm"):  # qwen3: RMSNorm over each query and key head before the rotation
            self.qk_norm = torch.cat([attn.q_norm.weight.detach().expand(heads, head_dim),
                                      attn.k_norm.weight.detach().expand(kv_heads, head_dim)])
            self.qk_eps = attn.q_norm.variance_epsilon
            if attn.k_norm.variance_epsilon != self.qk_eps:
                raise Unsupported("query and key norms with different epsilons")
        self.scaling = attn.scaling


class FusedDecoder:
    """``model``'s decoder over ``pool``'s slots (``forward``); ``build`` raises ``Unsupported``
    for a model it does not run."""

    def __init__(self, model, pool):
        cfg = model.config.get_text_config(decoder=True)
        if cfg.model_type not in FAMILIES:
            raise Unsupported(f"model type {cfg.model_type!r} (runs: {', '.join(FAMILIES)})")
        if model.config._attn_implementation not in ATTENTION:
            raise Unsupported(f"attention {model.config._attn_implementation!r}")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise Unsupported(f"activation {cfg.hidden_act!r}")
        kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"} or getattr(cfg, "use_sliding_window", False):
            raise Unsupported("sliding-window attention")
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope not in STATIC_ROPE:
            raise Unsupported(f"rotary type {rope!r} (its cos/sin depend on more than the position)")
        decoder, head = model.model, model.lm_head
        if type(head) is not nn.Linear or head.bias is not None:
            raise Unsupported("an output head other than a bias-free nn.Linear (a quantized model?)")
        self.heads, self.kv_heads = int(cfg.num_attention_heads), pool.shape.kv_heads
        self.head_dim = pool.shape.head_dim
        if self.heads % self.kv_heads:
            raise Unsupported("query heads that do not split evenly over the KV heads")
        weights = {"dtype": pool.shape.dtype, "device": pool.device}
        if any(p.dtype != weights["dtype"] or p.device != weights["device"] for p in model.parameters()):
            raise Unsupported("weights in another dtype or on another device than the KV pool")
        self.layers = [_Layer(layer, self.heads, self.kv_heads, self.head_dim) for layer in decoder.layers]
        self.embed, self.lm_head = decoder.embed_tokens.weight, head.weight
        self.norm, self.eps = decoder.norm.weight, decoder.norm.variance_epsilon
        self.rotary = decoder.rotary_emb
        self.pool = pool
        d = self.head_dim
        # x @ (cos on the diagonal + sin on the half-rotation) == x * cos + rotate_half(x) * sin
        self._eye = torch.eye(d, **weights)
        self._swap = torch.eye(d, **weights).roll(d // 2, dims=0)  # row j+D/2 of column j (mod D)
        self._sign = torch.cat([-torch.ones(d // 2, **weights), torch.ones(d - d // 2, **weights)])
        self._out_dtype = _score_dtype_supported(pool.device, pool.shape.dtype)
        self.kernels, self.programs, self.block_n = None, 0, 0  # the Triton kernels (``build(kernels=True)``)
        self.gemm, self.matmul = False, None  # and their GEMMs (``build(gemm=True)``: specsplit.engine.matmul)
        self.tune = False  # their tiles tuned on a GPU at the first product of each kind

    # ---- a forward ---------------------------------------------------------------------
    def _embed(self, ids: torch.Tensor, pos: torch.Tensor):
        """The residual stream [N, H] (N = B x T) and the tokens' cos and sin [N, D] (the model's
        rotary module: transformers' values, in the model's dtype)."""
        b, t = ids.shape
        x = F.embedding(ids.reshape(-1), self.embed)
        cos, sin = self.rotary(x, pos)
        return x, cos.reshape(b * t, self.head_dim), sin.reshape(b * t, self.head_dim)

    def _gemms(self, rows: int) -> bool:
        """Whether this forward's GEMMs go through ``specsplit.engine.matmul`` (its few rows)."""
        return self.gemm and self.kernels is not None and rows <= self.matmul.MAX_ROWS

    def _rest_of_layer(self, x: torch.Tensor, out: torch.Tensor, lay: _Layer) -> torch.Tensor:
        """The residual stream after attention's output ``out`` [N, Hq x D]: its projection added,
        then the MLP's."""
        if self._gemms(x.shape[0]):  # three kernels, x updated in place: o, norm + gate/up, SiLU x up + down
            mm, tune = self.matmul.linear, self.tune
            mm(out, lay.o, bias=lay.o_bias, residual=x, out=x, tune=tune)
            gate_up = mm(x, lay.gate_up, norm=lay.norm2, eps=lay.eps2, tune=tune)
            return mm(gate_up, lay.down, silu=True, residual=x, out=x, tune=tune)
        x = torch.addmm(x, out, lay.o.t()) if lay.o_bias is None else x + F.linear(out, lay.o, lay.o_bias)
        h = F.rms_norm(x, (x.shape[-1],), lay.norm2, lay.eps2)
        gate_up = torch.mm(h, lay.gate_up.t())
        if self.kernels is not None:
            act = self.kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate).mul_(up)
        return torch.addmm(x, act, lay.down.t())

    def _head(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        if self._gemms(x.shape[0]):
            self.matmul.linear(x, self.lm_head, norm=self.norm, eps=self.eps, out=logits.view(x.shape[0], -1),
                               tune=self.tune)
            return
        h = F.rms_norm(x, (x.shape[-1],), self.norm, self.eps)
        torch.mm(h, self.lm_head.t(), out=logits.view(x.shape[0], -1))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, where: torch.Tensor,
                visible: torch.Tensor, keys: int, logits: torch.Tensor) -> None:
        """Tokens ``ids`` [B, T] at positions ``pos`` [B, T] of the sessions in pool ``slots`` [B],
        their K/V written at cache rows ``where`` [B, T], each seeing ``visible`` [B, T, keys] of
        its slot's first ``keys`` entries; logits [B, T, V] into ``logits`` (torch operations)."""
        b, t = ids.shape
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        g = hq // hkv
        x, cos, sin = self._embed(ids, pos)
        rotation = torch.addcmul(self._eye * cos[:, None, :], self._swap, (sin * self._sign)[:, None, :])
        # the mask of every layer: [B x Hkv, T x G, keys], rows of one KV head's queries token-major
        mask = torch.zeros(b, hkv, t, g, keys, dtype=torch.float32, device=x.device)
        mask.masked_fill_(~visible[:, None, :, None, :], torch.finfo(torch.float32).min)
        mask = mask.view(b * hkv, t * g, keys)
        slot_idx, head_idx = slots.view(b, 1, 1), torch.arange(hkv, device=x.device).view(1, 1, hkv)
        at = where.view(b, t, 1)
        runs = (slots[:, None] * hkv + head_idx.view(1, hkv)).reshape(-1)  # [B x Hkv] (slot, head) rows
        runs = torch.cat([runs, runs + self.pool.kv[0].shape[1] * hkv])  # ... of the keys, then of the values
        chunk = 0 if x.device.type == "cpu" else ACCEL_VALUE_CHUNK
        for i, lay in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],), lay.norm1, lay.eps1)
            qkv = F.linear(h, lay.qkv, lay.qkv_bias).view(b * t, hq + 2 * hkv, d)
            qk = qkv[:, : hq + hkv]
            if lay.qk_norm is not None:
                qk = F.rms_norm(qk, (d,), None, lay.qk_eps).mul_(lay.qk_norm)
            qk = torch.bmm(qk, rotation).view(b, t, hq + hkv, d)
            for buf, new in ((self.pool.keys[i], qk[:, :, hq:]),
                             (self.pool.values[i], qkv.view(b, t, hq + 2 * hkv, d)[:, :, hq + hkv:])):
                buf.index_put_((slot_idx, head_idx, at), new)
            kv = self.pool.kv[i]  # [2, slots, Hkv, max_len, D]: both read in one gather
            k, v = kv.view(-1, kv.shape[3] * d)[:, : keys * d].index_select(0, runs).view(2, b * hkv, keys, d)
            q = qk[:, :, :hq].view(b, t, hkv, g, d).transpose(1, 2).reshape(b * hkv, t * g, d)
            if self._out_dtype:
                scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=lay.scaling, out_dtype=torch.float32)
            else:
                scores = torch.baddbmm(mask, q.float(), k.float().transpose(1, 2), alpha=lay.scaling)
            probs = torch.softmax(scores, dim=-1).to(v.dtype)
            out = weighted_values(probs.view(b, hkv, t * g, keys), v.view(b, hkv, keys, d), chunk)
            x = self._rest_of_layer(x, out.view(b, hkv, t, g * d).transpose(1, 2).reshape(b * t, hq * d), lay)
        self._head(x, logits)

    def forward_kernels(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                        vis: torch.Tensor, compact: bool, keys: int, logits: torch.Tensor) -> None:
        """The same forward through the Triton kernels (``specsplit.engine.kernels``): each
        session's new tokens written at its ``lengths`` [B] on, seeing every cached entry and
        ``vis`` [B, T, T] among themselves (``compact``), or ``vis`` [B, T, >= keys] of the slot."""
        kern = self.kernels
        b, t = ids.shape
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        x, cos, sin = self._embed(ids, pos)
        slots, lengths = slots.contiguous(), lengths.contiguous()  # the kernels read them as plain arrays
        out = torch.empty(b * t, hq * d, dtype=x.dtype, device=x.device)
        gemms = self._gemms(b * t)
        for i, lay in enumerate(self.layers):
            if gemms:  # the input norm inside the q/k/v GEMM
                qkv = self.matmul.linear(x, lay.qkv, bias=lay.qkv_bias, norm=lay.norm1, eps=lay.eps1, tune=self.tune)
            else:
                qkv = F.linear(F.rms_norm(x, (x.shape[-1],), lay.norm1, lay.eps1), lay.qkv, lay.qkv_bias)
            qkv = qkv.view(b * t, hq + 2 * hkv, d)
            kern.rope_store(qkv, cos, sin, lay.qk_norm, lay.qk_eps, self.pool.kv[i], slots, lengths, hq, hkv)
            kern.attend(qkv, self.pool.kv[i], slots, lengths, vis, compact, keys, lay.scaling, hq, hkv, out,
                        self.programs, self.block_n)
            x = self._rest_of_layer(x, out, lay)
        self._head(x, logits)


def _score_dtype_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``baddbmm`` writes float32 scores of ``dtype`` inputs directly (CUDA's
    ``out_dtype``) and gets them right; else the body casts queries and keys first."""
    if dtype == torch.float32:
        return False
    try:
        a = torch.randn(2, 3, 8, dtype=dtype, device=device)
        b = torch.randn(2, 8, 5, dtype=dtype, device=device)
        m = torch.randn(2, 3, 5, dtype=torch.float32, device=device)
        got = torch.baddbmm(m, a, b, alpha=0.5, out_dtype=torch.float32)
        want = torch.baddbmm(m, a.float(), b.float(), alpha=0.5)
        return got.dtype == torch.float32 and bool(torch.allclose(got, want, atol=1e-2, rtol=1e-2))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def build(model, pool, kernels: bool = False, gemm: bool = False,
          tune: bool = True) -> tuple[FusedDecoder | None, str | None]:
    """The fused body of ``model`` over ``pool`` (with ``kernels``: through the Triton kernels
    where they run; with ``gemm`` too, their GEMMs of few rows, tiles tuned on a GPU with ``tune``:
    ``specsplit.engine.matmul``), or None; and why not (or why
    without the kernels or their GEMMs). Each is checked once against what it replaces before it
    serves (``_disagreement``)."""
    try:
        decoder = FusedDecoder(model, pool)
    except Unsupported as exc:
        return None, str(exc)
    why = _disagreement(decoder, model, "torch")
    if why is not None:  # the torch operations miscompute here: the model's own modules instead
        return None, why
    if not kernels:
        return decoder, None
    from specsplit.engine import kernels as triton_kernels

    why = triton_kernels.available(pool.device) or triton_kernels.supported(decoder.head_dim, pool.shape.dtype)
    if why is None:
        decoder.kernels, decoder.block_n = triton_kernels, triton_kernels.BLOCK_N
        # programs an attention aims for: twice the multiprocessors. Triton's interpreter runs
        # programs one by one, each step costing the same at any size: no split of the keys and
        # larger steps there (tests/test_kernels.py checks the device's splits and steps)
        if pool.device.type == "cuda":
            decoder.programs = 2 * torch.cuda.get_device_properties(pool.device).multi_processor_count
        else:
            decoder.programs, decoder.block_n = 1, 256
        if gemm:
            from specsplit.engine import matmul

            decoder.gemm, decoder.matmul, decoder.tune = True, matmul, tune
        why = _disagreement(decoder, model, "triton")
        if why is not None and decoder.gemm:  # without the GEMMs, the other kernels may still serve
            decoder.gemm = False
            rest = _disagreement(decoder, model, "triton")
            why = f"{why}; without the Triton GEMMs: {rest or 'they agree'}"
            if rest is None:
                return decoder, why
        if why is not None:  # a kernel that misbehaves on this device: the torch operations instead
            decoder.kernels = None
    return decoder, why


CHECK_TOKENS = 8  # the start-up check's forward: a short causal run on the pool's scratch slot
CHECK_ERROR = 0.1  # the largest mean error of one token's logits, relative to the mean logit


@torch.no_grad()
def _disagreement(decoder: FusedDecoder, model, body: str) -> str | None:
    """None when a forward through ``body`` gives the logits of what it replaces on this device
    (the Triton kernels: the torch operations'; the torch operations: the model's own modules'),
    else what differs or failed. Rounding differs (bf16: ~2 % of the mean logit); a broken
    kernel's output is another matter: each token's mean error must stay within CHECK_ERROR of
    the mean logit. The bodies are checked against the modules on CPUs (tests/test_graphs.py) and
    the kernels in Triton's interpreter, compiled for sm_90 only: a device they miscompute on, or
    cannot build them for, must not serve through them. Runs once at start on the pool's scratch
    slot."""
    pool = decoder.pool
    if pool.scratch is None:
        return None
    what = "the Triton kernels" if body == "triton" else "the fused body's torch operations"
    try:
        return _compare_bodies(decoder, model, body, min(CHECK_TOKENS, pool.shape.max_len), what)
    except Exception as exc:  # a kernel that does not build or run here (an older GPU): not a crash
        return f"{what} failed on {pool.device}: {type(exc).__name__}: {exc}"[:500]


def _compare_bodies(decoder: FusedDecoder, model, body: str, t: int, what: str) -> str | None:
    """``_disagreement``'s forwards: ``t`` causal tokens through ``body`` and what it replaces."""
    pool = decoder.pool
    dev = pool.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, decoder.embed.shape[0], (1, t), generator=g).to(dev)
    pos = torch.arange(t, device=dev)[None]
    slots, lengths = torch.tensor([pool.scratch], device=dev), torch.zeros(1, dtype=torch.long, device=dev)
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None]
    out = []
    for run in ((body, "torch") if body == "triton" else (body, "modules")):
        logits = torch.empty(1, t, decoder.lm_head.shape[0], dtype=pool.shape.dtype, device=dev)
        if run == "triton":
            decoder.forward_kernels(ids, pos, slots, lengths, causal, True, t, logits)
        elif run == "torch":
            held, decoder.kernels = decoder.kernels, None
            try:
                decoder.forward(ids, pos, slots, pos.clone(), causal, t, logits)
            finally:
                decoder.kernels = held
        else:
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        out.append(logits.float())
    got, want = out
    err, scale = (got - want).abs().mean(dim=-1).max().item(), want.abs().mean().item()
    if not err <= CHECK_ERROR * scale:  # NaN fails too
        against = "the torch operations'" if body == "triton" else "the model's own modules'"
        return (f"{what}' logits differ from {against} on {dev}: a token's mean error {err:.3g} against a mean "
                f"logit of {scale:.3g}")
    return None
