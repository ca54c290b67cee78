"""Draft engine: keeps its own KV cache per session and builds a token tree within a budget.

Expansion is level by level, one forward per level over the frontier with the tree mask
(EAGLE-2 style): every frontier node proposes ``branch`` children; the ``branch`` best new nodes
by cumulative draft log-prob become the next frontier.
- temperature 0: children are the top-``branch`` tokens; at the end the ``max_nodes - 1`` best
  nodes by cumulative log-prob are kept (a parent always outranks its children). Deterministic.
- temperature > 0: children are drawn i.i.d. from the draft's processed distribution q, which the
  tree carries; no child is ever dropped because of its value (only whole groups, or a group's
  tail in draw order when the node budget runs out), so the verifier's rule stays lossless.
After drafting, the cache is cropped back to the committed tokens (prefix + root).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import torch

from schemas import DraftReply, DraftRequest, ErrorCode, FlatTree, Message, SamplingSpec, TreeSpec
from specsplit.spec import sampling as S
from specsplit.spec.engine import Engine, EngineLimits, elapsed_ms
from specsplit.spec.kvcache import SessionKV
from specsplit.spec.tree import SpecError, check_token_ids, path_to


@dataclass
class _Pool:
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    logps: list[float] = field(default_factory=lambda: [0.0])
    scores: list[float] = field(default_factory=lambda: [0.0])
    dists: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)

    def add(self, parent: int, token: int, logp: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.logps.append(logp)
        self.scores.append(self.scores[parent] + logp)
        return len(self.tokens) - 1


def _first_of_token(pool: _Pool, nodes: list[int]) -> list[int]:
    """Nodes whose token no earlier sibling carries (siblings are drawn i.i.d. and may repeat)."""
    seen, out = set(), []
    for i in nodes:
        key = (pool.parents[i], pool.tokens[i])
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out


class DraftEngine(Engine):
    role = "draft"

    def __init__(self, model, limits: EngineLimits = EngineLimits(), *, vocab_size=None, max_support: int = 64):
        super().__init__(model, limits, vocab_size=vocab_size)
        self.max_support = max_support

    def _dispatch(self, msg: Message) -> Message:
        if isinstance(msg, DraftRequest):
            return self.draft(msg)
        return super()._dispatch(msg)

    def draft(self, req: DraftRequest) -> DraftReply:
        t0 = time.perf_counter()
        check_token_ids([req.root], self.vocab_size, what="root token")
        spec = TreeSpec(
            max_nodes=min(req.tree.max_nodes, self.limits.max_tree_nodes),
            max_depth=min(req.tree.max_depth, self.limits.max_tree_depth),
            branch=req.tree.branch,
        )
        sync = req.sync
        session = self.open_session(req.session_id, req.round, sync, 1 + spec.branch * spec.max_depth)
        with session.lock:
            self.check_locked(session, req.round, sync)

            def run() -> FlatTree:
                kv = session.kv
                kv.crop_to(sync.base_len)
                tokens = [*sync.append_token_ids, req.root]
                t = len(tokens)
                visible = torch.ones(t, sync.base_len + t, dtype=torch.bool)
                visible[:, sync.base_len :] = torch.ones(t, t, dtype=torch.bool).tril()
                pos = torch.arange(sync.base_len, sync.base_len + t, dtype=torch.long)
                root_logits = self.forward(kv, tokens, pos, visible, keep=1)[0]  # [V]
                committed = kv.length
                try:
                    return self._build(kv, req.root, root_logits, spec, req.sampling, req.round)
                finally:
                    kv.crop_to(committed)
                    session.last_round = req.round

            tree = self.guarded(session, run)
        return DraftReply(session_id=req.session_id, round=req.round, tree=tree, draft_ms=elapsed_ms(t0))

    # ---- tree building ---------------------------------------------------------------
    def _build(
        self, kv: SessionKV, root: int, root_logits: torch.Tensor, spec: TreeSpec, sampling: SamplingSpec, round: int
    ) -> FlatTree:
        pool = _Pool(tokens=[root])
        pool.slots[0] = kv.length - 1
        prefix_len = kv.length
        greedy = sampling.greedy
        g = None if greedy else S.make_generator(sampling.seed, round, "draft")
        frontier, rows = [0], root_logits[None]  # [F], [F, V]
        keep = spec.max_nodes - 1
        for depth in range(1, spec.max_depth + 1):
            if keep <= 0 or not frontier:
                break
            if greedy:
                new = self._expand_greedy(pool, frontier, rows, spec.branch)
            else:
                new = self._expand_sampled(pool, frontier, rows, spec, sampling, g)
            if depth == spec.max_depth or not new:
                break
            if not greedy:  # a repeat of an earlier sibling's token is reached only if that one was
                new = _first_of_token(pool, new)  # rejected, and then it is rejected too: don't grow it
            frontier = heapq.nlargest(spec.branch, new, key=lambda i: (pool.scores[i], -i))
            if greedy and self._settled(pool, frontier, keep):
                break
            if not greedy and len(pool.tokens) >= spec.max_nodes:
                break
            rows = self._forward_frontier(kv, pool, frontier, prefix_len, depth)
        return self._flat(pool, keep if greedy else None)

    def _expand_greedy(self, pool: _Pool, frontier: list[int], rows: torch.Tensor, branch: int) -> list[int]:
        logp = torch.log_softmax(rows.float(), dim=-1)  # [F, V]
        top = torch.topk(logp, min(branch, logp.shape[-1]), dim=-1)
        new = []
        for f, toks, lps in zip(frontier, top.indices.tolist(), top.values.tolist()):
            new.extend(pool.add(f, tok, lp) for tok, lp in zip(toks, lps))
        return new

    def _expand_sampled(self, pool, frontier, rows, spec: TreeSpec, sampling: SamplingSpec, g) -> list[int]:
        q = S.probs_from_logits(rows, sampling, self.max_support)  # [F, V] float64
        new = []
        for j, f in enumerate(frontier):
            room = spec.max_nodes - len(pool.tokens)
            if room <= 0:
                break
            draws = S.sample_from(q[j], g, spec.branch)[:room]  # a prefix in draw order
            pool.dists[f] = S.sparse(q[j])
            qj = q[j]
            new.extend(pool.add(f, tok, float(torch.log(qj[tok]))) for tok in draws)
        return new

    @staticmethod
    def _settled(pool: _Pool, frontier: list[int], keep: int) -> bool:
        """True when no descendant of the frontier can enter the best ``keep`` nodes (a child's
        score never exceeds its parent's), so further levels cannot change the result."""
        if len(pool.tokens) - 1 < keep:
            return False
        kth = heapq.nlargest(keep, pool.scores[1:])[-1]
        return kth >= max(pool.scores[f] for f in frontier)

    def _forward_frontier(self, kv: SessionKV, pool: _Pool, frontier: list[int], prefix_len: int, depth: int):
        f = len(frontier)
        base = kv.length
        visible = torch.zeros(f, base + f, dtype=torch.bool)
        visible[:, :prefix_len] = True
        for j, node in enumerate(frontier):
            for a in path_to(node, pool.parents)[1:-1]:
                visible[j, pool.slots[a]] = True
            visible[j, base + j] = True
        pos = torch.full((f,), prefix_len - 1 + depth, dtype=torch.long)
        rows = self.forward(kv, [pool.tokens[n] for n in frontier], pos, visible, keep=f)  # [F, V]
        for j, node in enumerate(frontier):
            pool.slots[node] = base + j
        return rows

    @staticmethod
    def _flat(pool: _Pool, keep: int | None) -> FlatTree:
        n = len(pool.tokens)
        if keep is None or n - 1 <= keep:
            chosen = list(range(n))
        else:
            best = sorted(range(1, n), key=lambda i: (-pool.scores[i], i))[:keep]
            chosen = sorted({0, *best})
            chosen_set = set(chosen)
            if any(pool.parents[i] not in chosen_set for i in chosen[1:]):
                raise SpecError(ErrorCode.INTERNAL, "tree selection lost a parent")
        index = {old: new for new, old in enumerate(chosen)}
        sampled = bool(pool.dists)
        has_child = {pool.parents[i] for i in chosen[1:]}
        return FlatTree(
            token_ids=[pool.tokens[i] for i in chosen],
            parents=[-1] + [index[pool.parents[i]] for i in chosen[1:]],
            draft_logprobs=[pool.logps[i] for i in chosen],
            child_dist_ids=[list(pool.dists[i][0]) if i in has_child else [] for i in chosen] if sampled else [],
            child_dist_probs=[list(pool.dists[i][1]) if i in has_child else [] for i in chosen] if sampled else [],
        )
