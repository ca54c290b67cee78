"""Per-session round state, as plain functions and small objects (no sockets, no torch).

Shared by the in-process reference loop (``specsplit.local``) and the orchestrator actors, so
both follow the same round invariant: after a request's CacheSync is applied, the worker's
cache holds exactly ``committed[:-1]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

from schemas import CacheSync, FlatTree, SamplingSpec, TreeSpec, VerifyReply
from specsplit.orchestrator.costmodel import Choice, CostModel, select_nodes
from specsplit.orchestrator.ngrams import NgramCache
from specsplit.proposers.base import Budget, Proposal, Proposer, Shared
from specsplit.proposers.ngram_cache import NgramCacheProposer
from specsplit.proposers.prompt_lookup import PromptLookup
from specsplit.tree import depths_of, merge_chain


@dataclass
class SessionCursor:
    """What the orchestrator side knows: committed tokens and how many each worker holds."""

    committed: list[int]
    draft_len: int = 0  # tokens of committed the draft worker is known to hold
    target_len: int = 0
    # tokens of committed that full verification confirmed (exact SpecPV: the rest are
    # provisional, never streamed, and may be rolled back); -1: all of the initial ones
    confirmed: int = -1
    rolled_back: int = 0  # provisional tokens the last reply dropped
    prompt_len: int = -1  # the prompt's tokens (committed's first ones); -1: all of the initial ones

    def __post_init__(self) -> None:
        if self.confirmed < 0:
            self.confirmed = len(self.committed)
        if self.prompt_len < 0:
            self.prompt_len = len(self.committed)

    @property
    def provisional(self) -> int:
        """Committed tokens accepted under a partial view and not yet confirmed."""
        return len(self.committed) - self.confirmed

    def draft_sync(self, name_prompt: bool = False) -> CacheSync:
        """The draft's sync; it names the prompt where the draft needs to know where the output
        begins (``name_prompt``: a penalized session's, whose draft counts the output too)."""
        base = min(self.draft_len, len(self.committed) - 1)
        return CacheSync(base_len=base, append_token_ids=self.committed[base:-1],
                         prompt_len=self.prompt_len if name_prompt else 0)

    def target_sync(self, name_prompt: bool = False) -> CacheSync:
        """The target's sync; it names the prompt (``CacheSync.prompt_len``) while it is part of
        it, or always (``name_prompt``: a grammar's session, whose output starts there)."""
        base = min(self.target_len, len(self.committed) - 1)
        prompt = self.prompt_len if name_prompt or base < self.prompt_len - 1 else 0
        return CacheSync(base_len=base, append_token_ids=self.committed[base:-1], prompt_len=prompt)

    def after_draft(self) -> None:
        """The draft forwarded the root: it now holds all of committed."""
        self.draft_len = len(self.committed)

    def apply_verify(self, reply: VerifyReply) -> list[int]:
        """Commit a verify reply; returns the new tokens (accepted + bonus). A rollback (exact
        SpecPV) first drops the provisional tokens from ``rollback_len`` on (never confirmed ones)."""
        self.rolled_back = 0
        if reply.rollback_len is not None:
            cut = max(self.confirmed, min(reply.rollback_len, len(self.committed)))
            self.rolled_back = len(self.committed) - cut
            del self.committed[cut:]
            self.draft_len = min(self.draft_len, cut)
        new = [*reply.accepted_token_ids, reply.bonus_token_id]
        self.committed.extend(new)
        self.target_len = reply.cache_len
        n = len(self.committed)
        self.confirmed = n if reply.confirmed_len is None else max(self.confirmed, min(reply.confirmed_len, n))
        return new

    def take_confirmed(self, out: list[int], prompt_len: int, max_new_tokens: int, stop: set[int]) -> bool:
        """Append the newly confirmed tokens to ``out`` (the stream; always a prefix of what
        follows the prompt) up to the budget or a stop id; True when finished."""
        return accept_new(out, self.committed[prompt_len + len(out):self.confirmed], max_new_tokens, stop)

    def must_confirm(self, out: list[int], prompt_len: int, max_new_tokens: int, stop: set[int]) -> bool:
        """Exact SpecPV: the provisional tokens alone would finish the generation, so the next
        round only confirms them (a root-only tree, verified against the full cache)."""
        if not self.provisional:
            return False
        tail = self.committed[prompt_len + len(out):]
        return len(out) + len(tail) >= max_new_tokens or any(t in stop for t in tail)

    def produced(self, prompt_len: int) -> int:
        """Tokens committed after the prompt, provisional ones included (what drafting budgets on)."""
        return len(self.committed) - prompt_len


@dataclass(frozen=True)
class RoundCount:
    """What one verified round counts: the one rule behind RoundStats (so GenerateDone and
    ``specsplit produce --json``) and the Prometheus spec-decode counters (specsplit.metrics).

    drafted: tree nodes proposed to the target, the root excluded (draft and prompt-lookup nodes
    alike; 0 for a root-only round). accepted: accepted tokens, the bonus excluded (the round
    commits accepted + 1). The accepted path holds one node per depth, so accepted position i
    (0-based, vLLM's ``position`` label) is the accepted node at depth i + 1."""

    drafted: int
    accepted: int

    @classmethod
    def of(cls, tree: FlatTree, reply: VerifyReply) -> RoundCount:
        return cls(drafted=tree.num_nodes - 1, accepted=len(reply.accepted_token_ids))

    @property
    def positions(self) -> range:
        return range(self.accepted)

    @property
    def committed(self) -> int:
        """Tokens the round commits: accepted + the bonus."""
        return self.accepted + 1


@dataclass
class RoundStats:
    rounds: int = 0
    partial_rounds: int = 0  # SpecPV: rounds verified against the partial view
    rolled_back: int = 0  # exact SpecPV: provisional tokens a full verification dropped
    drafted: int = 0
    accepted: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    reused_rounds: int = 0  # rounds whose draft tree started from the grown previous tree
    # drafted nodes and accepted nodes by depth (index 0: depth 1): acceptance by depth, what a
    # tree budget is weighed against
    drafted_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)

    def add(self, tree: FlatTree, reply: VerifyReply, rolled_back: int = 0) -> RoundCount:
        count = RoundCount.of(tree, reply)
        self.rounds += 1
        self.partial_rounds += reply.partial
        self.rolled_back += rolled_back
        self.drafted += count.drafted
        self.accepted += count.accepted
        self.accepted_per_round.append(count.accepted)
        for d in depths_of(tree.parents)[1:]:
            _bump(self.drafted_per_depth, d - 1)
        for pos in count.positions:
            _bump(self.accepted_per_depth, pos)
        return count

    def acceptance_by_depth(self) -> list[float]:
        """Share of drafted nodes at each depth that were accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_depth + [0] * len(self.drafted_per_depth),
                                                     self.drafted_per_depth)]

    @property
    def mean_accepted(self) -> float:
        """Mean tokens committed per target pass (accepted + bonus)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def _bump(counts: list[int], i: int) -> None:
    if i >= len(counts):
        counts.extend([0] * (i + 1 - len(counts)))
    counts[i] += 1


def remaining_tree(tree: TreeSpec, remaining: int) -> TreeSpec:
    """Never draft deeper than the tokens still wanted (a round yields at most depth + 1)."""
    depth = max(0, min(tree.max_depth, remaining - 1))
    return tree.model_copy(update={"max_depth": depth})


def root_only(root: int) -> FlatTree:
    """The tree of a round that drafts nothing (a confirmation round)."""
    return FlatTree(token_ids=[root], parents=[-1], draft_logprobs=[0.0])


def accept_new(out: list[int], new: list[int], max_new_tokens: int, stop: set[int]) -> bool:
    """Append new tokens to out up to the budget or a stop id (included); True when finished."""
    for t in new:
        out.append(t)
        if t in stop or len(out) >= max_new_tokens:
            return True
    return False


MAX_MERGED_NODES = 256  # a merged tree never exceeds the protocol's tree size (schemas.MAX_TREE_NODES)
CACHE_SOURCE = "ngrams"  # the proposer whose nodes the n-gram cache metrics count


@dataclass(frozen=True)
class Candidates:
    """What a round verifies: the tree, where each of its nodes came from (``sources``: chain
    nodes -> (proposer, key); the rest: the root or the tree proposer's), what the cost model
    expects of it (None without one), and the merged tree it was chosen from (round traces)."""

    tree: FlatTree
    sources: dict[int, tuple[str, int]] = field(default_factory=dict)
    choice: Choice | None = None
    drafted: Proposal | None = None  # the tree proposer's proposal, if one was asked
    merged: FlatTree | None = None
    merged_sources: dict[int, tuple[str, int]] = field(default_factory=dict)

    @property
    def cached(self) -> dict[int, int]:
        """The nodes the n-gram cache proposed, with the length of the n-gram behind each."""
        return {i: key for i, (name, key) in self.sources.items() if name == CACHE_SOURCE}

    @property
    def lookup(self) -> frozenset[int]:
        """The nodes chain proposers added (prompt lookup, the n-gram cache, ...)."""
        return frozenset(self.sources)


def asks(p: Proposer, chains: list) -> bool:
    """Whether chain proposer ``p`` is asked, given the chains proposed before it (a fallback
    only where none was)."""
    return p.kind == "chain" and not (p.fallback and chains)


def merge(tree: FlatTree, chains: Sequence[tuple[str, Proposal]], spec: TreeSpec,
          chain_tokens: int) -> tuple[FlatTree, dict[int, tuple[str, int]]]:
    """``tree`` with each chain hung under its root in order (followed where existing nodes
    spell it), at most ``chain_tokens`` nodes added in all and within ``spec.max_depth``; and
    the source of each added node: (proposer, the key of its token, the chain's token at depth
    d being chain[d - 1] however much of it merged)."""
    n_draft = tree.num_nodes
    sources: dict[int, tuple[str, int]] = {}
    for name, prop in chains:
        before = tree.num_nodes
        tree = merge_chain(tree, list(prop.chain), max_depth=spec.max_depth,
                           max_nodes=min(MAX_MERGED_NODES, n_draft + chain_tokens))
        if tree.num_nodes > before:
            depths = depths_of(tree.parents)
            keys = list(prop.keys) or [0] * len(prop.chain)
            sources.update({i: (name, keys[depths[i] - 1]) for i in range(before, tree.num_nodes)})
    return tree, sources


def select(tree: FlatTree, sources: dict[int, tuple[str, int]], cost: CostModel | None, *, sync_tokens: int,
           plain: bool, drafted: Proposal | None = None) -> Candidates:
    """The nodes of ``tree`` the cost model finds worth their verify time (all without one)."""
    if cost is None:
        return Candidates(tree, sources, None, drafted, tree, sources)
    choice = cost.choose(tree, sync_tokens, sources=sources, plain=plain,
                         measure=drafted is not None and cost.measuring())
    index = {old: new for new, old in enumerate(choice.nodes)}
    kept = {index[i]: src for i, src in sources.items() if i in index}
    return Candidates(select_nodes(tree, choice.nodes), kept, choice, drafted, tree, sources)



def plan_round(tree: FlatTree, committed: list[int], spec: TreeSpec, sampling: SamplingSpec, *,
               lookup_max_tokens: int = 0, lookup_min_ngram: int = 3, cost: CostModel | None = None,
               sync_tokens: int = 0, plain: bool = False, ngrams: NgramCache | None = None,
               forced: Sequence[int] = ()) -> Candidates:
    """Greedy rounds: the draft's tree plus the prompt-lookup continuation of ``committed`` (which
    ends with the tree's root) or, where the context has none, the cross-session n-gram cache's
    (``ngrams``), within the round's depth and ``lookup_max_tokens`` extra nodes; then, with a
    cost model, only the nodes that pay for their verify time. Sampled rounds keep the draft's
    tree as drawn. ``plain``: a round that called no draft (``tree`` is its root alone), priced as
    such. The in-process reference loop's (``specsplit.local``) form of ``rounds.propose``, with
    the same chain proposers (``forced``: the tokens the session's grammar forces after the root,
    as the target reported them: the ``grammar`` proposer's chain, first)."""
    if not sampling.greedy:
        return Candidates(tree, merged=tree)
    shared = Shared(policy=SimpleNamespace(lookup_min_ngram=lookup_min_ngram),
                    resources={"ngrams": ngrams} if ngrams is not None else {})
    chains: list[tuple[str, Proposal]] = []
    if lookup_max_tokens > 0 and spec.max_depth >= 1:
        budget = Budget(spec, min(lookup_max_tokens, spec.max_depth))
        if forced:
            chains.append(("grammar", Proposal(chain=list(forced[:budget.chain_tokens]),
                                               keys=[0] * min(len(forced), budget.chain_tokens))))
        for p in (PromptLookup(None, shared), NgramCacheProposer(None, shared)):
            if asks(p, chains) and (prop := p.suggest(committed, budget)) is not None and prop.chain:
                chains.append((p.name, prop))
    merged, sources = merge(tree, chains, spec, lookup_max_tokens)
    return select(merged, sources, cost, sync_tokens=sync_tokens, plain=plain)
