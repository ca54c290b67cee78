"""The in-process reference loop: draft -> verify rounds through the same engines the workers use.

``generate`` is the project's public Python entry point (outside checks call it directly) and
the baseline for what the transport costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import CacheSync, DraftRequest, ErrorReply, SamplingSpec, TreeSpec, VerifyRequest
from specsplit.spec.draft import DraftEngine
from specsplit.spec.engine import EngineLimits
from specsplit.spec.target import TargetEngine


@dataclass
class RoundStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_round: list[int] = field(default_factory=list)


@dataclass
class SessionCursor:
    """What the orchestrator side knows: committed tokens and how much each worker holds.

    Invariant: after a request's CacheSync is applied, the worker holds committed[:-1]."""

    committed: list[int]
    draft_len: int = 0
    target_len: int = 0

    def draft_sync(self) -> CacheSync:
        base = min(self.draft_len, len(self.committed) - 1)
        return CacheSync(base_len=base, append_token_ids=self.committed[base:-1])

    def target_sync(self) -> CacheSync:
        base = min(self.target_len, len(self.committed) - 1)
        return CacheSync(base_len=base, append_token_ids=self.committed[base:-1])


def remaining_tree(tree: TreeSpec, remaining: int) -> TreeSpec:
    """Never draft deeper than the tokens still wanted (a round yields at most depth + 1)."""
    depth = max(0, min(tree.max_depth, remaining - 1))
    return TreeSpec(max_nodes=tree.max_nodes, max_depth=depth, branch=tree.branch)


def accept_new(out: list[int], new: list[int], max_new_tokens: int, stop: set[int]) -> bool:
    """Append new tokens to out up to the budget or a stop id (included); True when finished."""
    for t in new:
        out.append(t)
        if t in stop or len(out) >= max_new_tokens:
            return True
    return False


def generate(
    draft,
    target,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    tree: TreeSpec,
    sampling: SamplingSpec,
    stop_token_ids=(),
    stats: RoundStats | None = None,
    session_id: str = "local",
) -> list[int]:
    """Speculative generation in one process. Returns exactly the new token ids (at most
    max_new_tokens; stops early only at a stop id, which is included). At temperature 0 the
    result equals plain greedy decoding of ``target``."""
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    if max_new_tokens <= 0:
        return []
    need = len(prompt_ids) + max_new_tokens + tree.max_nodes + tree.branch * tree.max_depth + 8
    limits = EngineLimits(
        max_sessions=1,
        max_session_tokens=need,
        max_tree_nodes=max(tree.max_nodes, 1),
        max_tree_depth=max(tree.max_depth, 1),
    )
    d_eng, t_eng = DraftEngine(draft, limits), TargetEngine(target, limits)
    cur = SessionCursor(list(prompt_ids))
    stop, out, stats = set(int(s) for s in stop_token_ids), [], stats or RoundStats()
    rnd = 0
    while True:
        spec = remaining_tree(tree, max_new_tokens - len(out))
        d_reply = d_eng.handle(DraftRequest(session_id=session_id, round=rnd, sync=cur.draft_sync(),
                                            root=cur.committed[-1], tree=spec, sampling=sampling))
        _raise_if_error(d_reply)
        cur.draft_len = len(cur.committed)
        v_reply = t_eng.handle(VerifyRequest(session_id=session_id, round=rnd, sync=cur.target_sync(),
                                             tree=d_reply.tree, sampling=sampling))
        _raise_if_error(v_reply)
        cur.target_len = v_reply.cache_len
        new = [*v_reply.accepted_token_ids, v_reply.bonus_token_id]
        cur.committed.extend(new)
        stats.rounds += 1
        stats.drafted += d_reply.tree.num_nodes - 1
        stats.accepted += len(v_reply.accepted_token_ids)
        stats.accepted_per_round.append(len(v_reply.accepted_token_ids))
        rnd += 1
        if accept_new(out, new, max_new_tokens, stop):
            return out


def _raise_if_error(reply) -> None:
    if isinstance(reply, ErrorReply):
        raise RuntimeError(f"{reply.code.value}: {reply.message}")
