"""Batch-invariant float32 attention: a token's output is the same in a decoding step and in a
tree, without computing in float64.

Why: the int8 target must equal its own greedy decoding, so a tree node's attention output must
be bit-identical to the one a decoding step at the same position computes. float32 BLAS does not
promise that (MKL picks other kernels for 1-3 rows, splits columns by thread and shape, and a tree
lays its keys out differently from the decoding cache), so ``fp64_attention`` computes everything
in float64 and lets the rounding hide the order. At long contexts that is where decoding's time
goes, several times what float32 attention costs (docs/results.md, commit 9f0f077).

How, per query row (a token at position ``p``, seeing ``p + 1`` keys: the committed cache in slot
order and its own ancestors; its *rank* ``t`` is a key's index in that sequence, which is the key's
position):

- **Scores** of every row against every key slot come from one batched matmul per KV head whose
  items all have one shape, ``[R, D] x [D, BLOCK]`` (the keys cut into blocks of ``BLOCK`` slots,
  the last one zero-padded): a score is then the same float32 number whatever the forward's rows
  or length, because every item runs the same kernel (at least ``MIN_ROWS`` rows: MKL uses other
  kernels for 1-3 rows; fewer are padded with zero rows).
- **Far keys** (ranks below ``F(p) = max(0, BLOCK * (p // BLOCK) - BLOCK)``, whole blocks, always
  committed cache, so rank = slot): probabilities ``exp(s - max)`` in float32 and one
  ``[R, BLOCK] x [BLOCK, D]`` matmul per block (again one shape), then the blocks' partial sums
  added one block at a time in block order. A row whose far region ends earlier than another's
  has the extra blocks masked to exact zeros, which change no sum.
- **Near keys** (ranks ``F(p)..p``: between ``BLOCK`` and ``2 * BLOCK - 1`` keys, where a tree's
  own nodes and the keys just before them live, in an order that differs between a tree and the
  cache) in float64 over the slot layout, whose order-dependent differences (~1e-16) vanish when
  the result is rounded to float32, exactly as ``fp64_attention`` does for every key.

A sliding-window layer's mask hides a row's oldest keys: its position is then its visible keys'
count less one plus the hidden ones before them, and its far region starts at the first visible
slot, the hidden far slots masked to exact zeros as the blocks past ``F(p)`` are (so a row computes
the same sums in a tree as in a decoding step whose cache keeps every key).

Since a tree is at most ``MAX_TREE_DEPTH`` (64) < ``BLOCK`` deep, a tree node's far keys are all
committed cache. The float32 parts are equal by construction as long as the kernels are
deterministic per shape; ``invariance_holds`` checks that on this machine (decoding steps against
trees that straddle block boundaries, on 1 and 2 threads) before a model is switched to this
attention, else it keeps ``fp64_attention``. Its cost against float64, one layer:
``ops/attention_cost.py``, ops/results/attention-cost-1thread-cpu2-avx2-epyc.json.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from dataclasses import dataclass

import structlog
import torch

from specsplit.engine.masks import additive_mask, tree_visibility
from specsplit.models.attention import grouped_attention
from specsplit.models.fp64 import FP64_ATTENTION, use_fp64_attention

BLOCKED_ATTENTION = "specsplit_blocked"
BLOCK = 128  # keys per block; > MAX_TREE_DEPTH, so a tree node's far keys are committed cache
SHORT = 1024  # rows that see at most this many keys take float64 attention (cheaper there, measured)
MEMO_PLANS = 1024  # forward plans kept per thread (one per live mask: a batched forward's sessions)
MIN_ROWS = 4  # the fewest rows a float32 matmul here gets (MKL's 1-3-row kernels round differently)
_NEG = float("-inf")


@dataclass(frozen=True, slots=True)
class _Plan:
    """What every layer of one forward shares (derived from its mask once): ``far`` [m] the far
    region's end per row (a multiple of BLOCK), ``far_blocks`` its largest value in blocks,
    ``near_start`` its smallest (the near region's first slot), ``far_bias`` [JF, m, BLOCK]
    additive (0 inside a row's far region, -inf after), ``near_visible`` [m, W] bool over slots
    near_start.. (padded to whole blocks): visible and not far."""

    length: int
    short: torch.Tensor | None  # rows at positions below SHORT (float64 attention), None if none
    long: torch.Tensor | None  # the other rows, None if none
    far_blocks: int
    near_start: int
    far_bias: torch.Tensor | None
    near_visible: torch.Tensor


_memo = threading.local()


def _visible(attention_mask: torch.Tensor | None, m: int, length: int, device) -> torch.Tensor:
    if attention_mask is None:  # causal: the last query sees every key
        return torch.ones(m, length, dtype=torch.bool, device=device).tril(length - m)
    mask = attention_mask[0, 0, :, :length]
    if mask.dtype == torch.bool:
        return mask
    return mask == 0


def _memo_get(attention_mask: torch.Tensor | None, m: int, length: int) -> _Plan | None:
    plans = getattr(_memo, "plans", None)
    if plans is None:
        return None
    hit = plans.get(None if attention_mask is None else id(attention_mask))
    if hit is None or hit[1] != m or hit[2] != length:
        return None
    if attention_mask is not None and hit[0]() is not attention_mask:
        return None
    return hit[3]


def _memo_put(attention_mask: torch.Tensor | None, m: int, length: int, plan: _Plan) -> None:
    """Keep ``plan`` while its mask lives. A batched forward (``specsplit.engine.batch``) calls
    every layer once per session, each with that session's mask, so remembering only the last
    mask recomputed every session's plan in every layer (a host sync each; docs/results.md,
    commit df8e310); an entry leaves when its mask is collected (the forward is over), and at
    most ``MEMO_PLANS`` are kept."""
    plans = getattr(_memo, "plans", None)
    if plans is None:
        plans = _memo.plans = {}
    if len(plans) >= MEMO_PLANS:
        plans.clear()
    if attention_mask is None:
        plans[None] = (None, m, length, plan)
        return
    key = id(attention_mask)
    ref = weakref.ref(attention_mask, lambda _r, key=key, plans=plans: plans.pop(key, None))
    plans[key] = (ref, m, length, plan)


def _far_region(vis: torch.Tensor, count: torch.Tensor):
    """(lo, F, holes) per row of a visibility [m, L] with ``count`` visible keys a row: the far
    region is slots [lo, F) (lo: the hidden slots before a sliding window's first key, None where
    no row hides its first slot; F = F(p), p = count - 1 + lo the row's position), ``holes``
    whether a row hides any of it. Reading slot 0 first (a host read; blocked attention is the
    CPU target's) keeps forwards without a window on one pass over the mask for the check."""
    if bool(vis[:, 0].all()):
        far = ((count - 1) // BLOCK * BLOCK - BLOCK).clamp_min(0)
        prefix = vis.to(torch.int8).cummin(dim=1).values.sum(dim=1)  # leading visible slots per row
        return None, far, far > prefix
    lo = vis.to(torch.int8).argmax(dim=1)  # the first visible slot (argmax: the first of the maxima)
    far = ((count - 1 + lo) // BLOCK * BLOCK - BLOCK).clamp_min(0)
    seen = vis.cumsum(dim=1).gather(1, (far - 1).clamp_min(0)[:, None])[:, 0] * (far > 0)  # visible before F
    return lo, far, seen != (far - lo).clamp_min(0)


def _plan(attention_mask: torch.Tensor | None, m: int, length: int, device) -> _Plan:
    """The forward's plan, computed once per mask (every layer gets the same mask object)."""
    memo = _memo_get(attention_mask, m, length)
    if memo is not None:
        return memo
    vis = _visible(attention_mask, m, length, device)
    count = vis.sum(dim=1)  # p + 1 - lo per row
    is_short = count <= SHORT
    lo, far, holes = _far_region(vis, count)
    far_max, near_start, bad, n_short, blind = (int(x) for x in torch.stack(  # the forward's one host sync
        [far.max(), far.min(), (holes & ~is_short).sum(), is_short.sum(), (count == 0).sum()]).tolist())
    if blind:
        raise ValueError("a query row sees no key")
    if n_short:
        short = is_short.nonzero().view(-1) if n_short < m else None
        long = (~is_short).nonzero().view(-1) if n_short < m else None
        # near_visible: the whole visibility here (rows split between the two attentions use it)
        plan = _Plan(length, short if n_short < m else torch.arange(m, device=device), long, 0, 0, None, vis)
        _memo_put(attention_mask, m, length, plan)
        return plan
    if bad:
        raise ValueError(f"a query row's keys below its last {BLOCK} are not a visible prefix "
                         "(a tree deeper than the attention block?)")
    far_blocks = far_max // BLOCK
    slots = torch.arange(far_blocks * BLOCK, device=device)
    far_bias = None
    if far_blocks:
        outside = slots[None] >= far[:, None]
        if lo is not None:
            outside |= slots[None] < lo[:, None]  # a window's older keys
        far_bias = torch.zeros(m, far_blocks * BLOCK, device=device).masked_fill_(outside, _NEG)
        far_bias = far_bias.view(m, far_blocks, BLOCK).transpose(0, 1).contiguous()
    padded = -(-length // BLOCK) * BLOCK
    near_slots = torch.arange(near_start, padded, device=device)
    near = torch.zeros(m, padded - near_start, dtype=torch.bool, device=device)
    near[:, :length - near_start] = vis[:, near_start:]
    near &= near_slots[None] >= far[:, None]
    plan = _Plan(length, None, None, far_blocks, near_start, far_bias, near)
    _memo_put(attention_mask, m, length, plan)
    return plan


def _bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.bmm whose items each run on one thread: torch runs a batch of two or more items in
    parallel, one item per thread, but hands a lone item to MKL's threads, which split it by
    shape (measured: a lone [6, 128] x [128, 128] item rounds differently on 2 threads from the
    same rows inside [96, 128] x [128, 128]). A lone item therefore gets a copy beside it."""
    if a.shape[0] > 1:
        return torch.bmm(a, b, out=out)
    res = torch.bmm(a.expand(2, *a.shape[1:]), b.expand(2, *b.shape[1:]))[:1]
    return res if out is None else out.copy_(res)


def _scores(q: torch.Tensor, k: torch.Tensor, length: int) -> torch.Tensor:
    """q [r, D] (r >= MIN_ROWS), k [>=L, D] -> scores [J, r, BLOCK] against every slot, the keys
    cut into J blocks (the last one zero-padded): one batched matmul whose items all have one shape."""
    r, d = q.shape
    whole = length // BLOCK
    blocks = -(-length // BLOCK)
    s = q.new_empty(blocks, r, BLOCK)
    if whole:
        _bmm(q.expand(whole, r, d), k[:whole * BLOCK].view(whole, BLOCK, d).transpose(1, 2), out=s[:whole])
    if whole < blocks:
        last = k.new_zeros(1, BLOCK, d)
        last[0, :length - whole * BLOCK] = k[whole * BLOCK:length]
        _bmm(q[None], last.transpose(1, 2), out=s[whole:])
    return s


def _one(query, key, value, mask, scaling, softcap=None, sinks=None) -> torch.Tensor:
    """Batch element: query [Hq, m, D], key/value [Hkv, L, D] -> [m, Hq, D]; ``softcap``: scores
    capped as ``grouped_attention`` caps them (the tanh in float64, whose rounding to float32
    hides the kernels' per-element differences, as for ``exp`` on more than 2 threads); ``sinks``
    [Hq]: a logit a head in each row's softmax denominator (a constant: the same in any forward)."""
    hq, m, d = query.shape
    hkv, length = key.shape[0], key.shape[1]
    groups = hq // hkv
    plan = _plan(mask, m, length, query.device)
    if plan.short is not None:  # every row's result depends on that row alone, so rows may split
        if plan.long is None:
            return grouped_attention(query[None], key[None], value[None], mask, scaling, torch.float64,
                                     softcap=softcap, sinks=sinks)[0]
        out = query.new_empty(m, hq, d)
        for idx in (plan.short, plan.long):  # each part with its rows of the visibility (a bool mask)
            out[idx] = _one(query[:, idx], key, value, plan.near_visible[idx][None, None], scaling, softcap, sinks)
        return out
    rows = m * groups
    q = (query * (d ** -0.5 if scaling is None else scaling)).view(hkv, groups, m, d).transpose(1, 2)
    q = q.reshape(hkv, rows, d)
    if rows < MIN_ROWS:
        q = torch.cat([q, q.new_zeros(hkv, MIN_ROWS - rows, d)], dim=1)
    r = q.shape[1]
    jf, ns = plan.far_blocks, plan.near_start
    fp64_exp = torch.get_num_threads() > 2  # float32 exp stays elementwise-identical on <= 2 threads
    outs = []
    for h in range(hkv):
        s = _scores(q[h], key[h], length)  # [J, r, B]
        if softcap:
            s = s.double().div_(softcap).tanh_().mul_(softcap).float()
        near = s[ns // BLOCK:, :rows].transpose(0, 1).reshape(m, groups, -1)  # slots ns.. (whole blocks)
        near = near.masked_fill_(~plan.near_visible[:, None], _NEG)
        top = near.amax(dim=-1)  # [m, G]
        sink = None if sinks is None else sinks.view(hkv, groups)[h].float()  # [G]
        if sink is not None:
            top = torch.maximum(top, sink[None])
        acc = lsum = None
        if jf:
            far = s[:jf, :rows].reshape(jf, m, groups, BLOCK) + plan.far_bias[:, :, None]
            top = torch.maximum(top, far.amax(dim=(0, 3)))
            far -= top[None, :, :, None]
            e = (far.double().exp_().float() if fp64_exp else far.exp_()).view(jf, rows, BLOCK)
            if rows < r:
                e = torch.cat([e, e.new_zeros(jf, r - rows, BLOCK)], dim=1)
            part = _bmm(e, value[h, :jf * BLOCK].view(jf, BLOCK, d))  # [JF, r, D]: one item shape
            lpart = e.sum(dim=-1)  # [JF, r]
            acc, lsum = part[0].clone(), lpart[0].clone()
            for j in range(1, jf):  # block order, one at a time: the sums a decoding step makes
                acc += part[j]
                lsum += lpart[j]
        e64 = (near.double() - top.double()[..., None]).exp_().view(rows, -1)[:, :length - ns]  # masked -> 0
        o = torch.matmul(e64, value[h, ns:length].double())  # [rows, D] float64
        l = e64.sum(dim=-1)
        if acc is not None:
            o += acc[:rows].double()
            l += lsum[:rows].double()
        if sink is not None:
            l += (sink.double()[None] - top.double()).exp_().view(rows)
        outs.append((o / l[:, None]).to(query.dtype).view(m, groups, d))
    return torch.stack(outs, dim=1).reshape(m, hq, d)


def blocked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query [B, Hq, M, D], key/value [B, Hkv, L, D],
    an additive (0 / dtype min) or bool mask [B|1, 1, M, >=L] or None for causal; returns
    ([B, M, Hq, D], None)."""
    b, caps = query.shape[0], (kwargs.get("softcap"), kwargs.get("s_aux"))  # Gemma 2's softcap, gpt-oss's sinks
    if b == 1:  # the mask object itself: its plan is computed once for every layer
        return _one(query[0], key[0], value[0], attention_mask, scaling, *caps)[None], None
    outs = []
    for i in range(b):
        mask = None if attention_mask is None else attention_mask[i if attention_mask.shape[0] > 1 else 0][None]
        outs.append(_one(query[i], key[i], value[i], mask, scaling, *caps))
    return torch.stack(outs), None


def _tree_rows(q, k, v, n_committed: int, parents: list[int]) -> torch.Tensor:
    """Outputs of a tree forward: committed keys [Hkv, P, D] + the nodes' (q, k, v)."""
    n = len(parents)
    vis = torch.ones(n, n_committed + n, dtype=torch.bool)
    vis[:, n_committed:] = tree_visibility(parents, torch.device("cpu"))
    return blocked_attention(None, q[None], k[None], v[None], additive_mask(vis, torch.float32))[0][0]


@functools.lru_cache(maxsize=64)
def invariance_holds(heads: int, kv_heads: int, head_dim: int, threads=(1, 2)) -> bool:
    """Whether, on this machine and on each thread count, every node of a branching tree (and of
    a chain) gets bit-for-bit the output a decoding step at its position gets: trees placed to
    straddle a block boundary and to sit far above one. Random data; a few ms."""
    saved = torch.get_num_threads()
    g = torch.Generator().manual_seed(7)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 6, 9, 11, 12, 13, 14]
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    chain = list(range(-1, 19))
    try:
        for t in threads:
            torch.set_num_threads(t)
            for committed in (3, SHORT - 8, SHORT + 2 * BLOCK - 5, SHORT + 3 * BLOCK + 40, SHORT + 4 * BLOCK):
                for tree in (parents, chain):
                    n = len(tree)
                    total = committed + n
                    k = torch.randn(kv_heads, total, head_dim, generator=g)
                    v = torch.randn(kv_heads, total, head_dim, generator=g)
                    q = torch.randn(heads, n, head_dim, generator=g)
                    rows = _tree_rows(q, k, v, committed, tree)
                    for i in range(n):
                        path = [i]
                        while tree[path[-1]] >= 0:
                            path.append(tree[path[-1]])
                        slots = list(range(committed)) + [committed + j for j in reversed(path)]
                        idx = torch.tensor(slots, dtype=torch.long)
                        one = blocked_attention(None, q[None, :, i:i + 1], k[None][:, :, idx], v[None][:, :, idx],
                                                None)[0][0, 0]
                        if not torch.equal(one, rows[i]):
                            return False
    finally:
        torch.set_num_threads(saved)
    return True


def use_invariant_attention(model) -> str:
    """Switch ``model`` (a batch-invariant target) to ``blocked_attention`` where this machine
    passes ``invariance_holds`` for its head shapes on 1, 2 and every core's threads, else to
    ``specsplit.models.fp64.fp64_attention``; returns the registered name it now runs."""
    # transformers (seconds to import) only to register: kernel-only users never load it
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    threads = tuple(sorted({1, 2, os.cpu_count() or 1}))
    if not invariance_holds(heads, kv_heads, head_dim, threads):
        structlog.get_logger().warning("blocked_attention_not_invariant", heads=heads, kv_heads=kv_heads,
                                       head_dim=head_dim, threads=threads, fallback=FP64_ATTENTION)
        use_fp64_attention(model)
        return FP64_ATTENTION
    AttentionInterface.register(BLOCKED_ATTENTION, blocked_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(BLOCKED_ATTENTION, eager_mask)
    model.set_attn_implementation(BLOCKED_ATTENTION)
    return BLOCKED_ATTENTION
