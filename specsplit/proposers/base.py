"""The one interface for everything that proposes tokens to a session's rounds (torch-free).

A proposer offers what it would draft for a session within the round's budget and learns from the
verdict; the orchestrator asks the round's proposers in order, merges their proposals into one
tree and lets the cost model keep the nodes that pay (``specsplit.orchestrator.rounds``). The
shapes learned from: transformers' ``CandidateGenerator`` (``get_candidates`` /
``update_candidate_strategy``) and llama.cpp's ``common_speculative`` (begin / draft / accept).

Two kinds:
- a *tree* proposer (the draft model) returns a tree rooted at the round's root, with the draft's
  log-probabilities (the cost model calibrates its nodes by path probability); at most one per
  fleet, and the only kind a sampled session uses (its tree is drawn from the draft's
  distribution: nodes added by value would bias the output);
- a *chain* proposer returns tokens continuing the context, hung under the root (existing nodes
  are followed where they spell the chain), each with a calibration key (its acceptance is
  calibrated per proposer, key and position in the chain). Greedy rounds only.

A new proposer is one module with a class registered by ``@register`` and imported by
``specsplit/proposers/__init__.py``; ``SPECSPLIT_PROPOSERS`` names the fleet's proposers in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from schemas import FlatTree, SamplingSpec, TreeSpec


@dataclass(frozen=True, slots=True)
class Budget:
    """What one round may propose: the tree spec (depth, nodes, branching, the cost model's
    ``min_path_prob``) and, for chain proposers, at most ``chain_tokens`` tokens each."""

    spec: TreeSpec
    chain_tokens: int


@dataclass(frozen=True, slots=True)
class Proposal:
    """A tree (tree proposers) or a chain of tokens with a calibration key per token (chain
    proposers: e.g. the length of the n-gram that predicted it; 0 when one calibration fits all).
    ``draft_ms``/``reused``: what a model call cost and how much of a grown tree it reused."""

    tree: FlatTree | None = None
    chain: Sequence[int] = ()
    keys: Sequence[int] = ()
    draft_ms: float = 0.0
    reused: int = 0
    grow_ms: float = 0.0  # the growth budget asked of the draft worker while the target verifies
    rerooted_here: bool = False  # the grown tree re-rooted by the orchestrator: no draft call on the round's path


@dataclass(frozen=True, slots=True)
class Verdict:
    """A verified round as a proposer learns from it: the tree verified, which proposer each node
    came from (``sources``: node -> (proposer name, key); absent nodes: the root or the tree
    proposer's), the accepted nodes, the committed tokens and the verify forward's ms."""

    tree: FlatTree
    sources: dict[int, tuple[str, int]]
    accepted_nodes: Sequence[int]
    new_tokens: Sequence[int]
    verify_ms: float
    forced: Sequence[int] = ()  # a grammar's session: the tokens it forces after new_tokens (the target's)


@dataclass
class Shared:
    """What an orchestrator's proposers share: its settings-derived policy and resources built
    once per process (``Proposer.shared``), by proposer name."""

    policy: Any = None
    settings: Any = None
    resources: dict[str, Any] = field(default_factory=dict)


class Proposer:
    """One proposer for one session (an instance per session; shared state in ``shared``).

    ``session`` is the session's actor (``specsplit.orchestrator.actor.SessionActor``): chain
    proposers need nothing of it; the draft model calls its worker through it."""

    name: ClassVar[str]
    kind: ClassVar[str] = "chain"  # "tree" or "chain"
    model_cost: ClassVar[bool] = False  # proposing costs a model call: skipped in plain rounds
    fallback: ClassVar[bool] = False  # a chain proposer asked only where the ones before it found nothing

    def __init__(self, session: Any, shared: Shared) -> None:
        self.session = session
        self.shared = shared

    @classmethod
    def create_shared(cls, shared: Shared) -> Any:
        """A resource the orchestrator's sessions share (built once per process; None: none)."""
        return None

    def resource(self) -> Any:
        return self.shared.resources.get(self.name)

    async def propose(self, committed: Sequence[int], budget: Budget, sampling: SamplingSpec, rnd: int) -> Proposal | None:
        """What this proposer would draft after ``committed`` (which ends with the round's root).
        Chain proposers compute it in place (``suggest``); a tree proposer calls its model."""
        return self.suggest(committed, budget)

    def ahead(self, committed: Sequence[int], budget: Budget, sampling: SamplingSpec, rnd: int) -> None:
        """Round ``rnd`` verifies without this (model) proposer while the target forwards the
        prompt: start on ``committed`` now, so the next ``propose`` finds the work done (default:
        nothing)."""

    def suggest(self, committed: Sequence[int], budget: Budget) -> Proposal | None:
        """A chain proposer's chain, computed without I/O (None: nothing to propose)."""
        raise NotImplementedError

    def verifying(self, cands: Any, rnd: int, sampling: SamplingSpec, cost: Any) -> float:
        """Round ``rnd``'s tree is chosen and goes to the target (``cands``: the orchestrator's
        ``Candidates``; ``cost``: its cost model or None). Returns the milliseconds of work this
        proposer's worker was asked for meanwhile (the draft's growth; default: none)."""
        return 0.0

    def learn(self, verdict: Verdict) -> None:
        """A verified round (default: nothing to learn)."""

    def finish(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """The session ended with ``output`` after ``prompt`` (default: nothing)."""

    def close(self) -> None:
        """The session is over: cancel what runs in the background (default: nothing)."""


REGISTRY: dict[str, type[Proposer]] = {}


def register(cls: type[Proposer]) -> type[Proposer]:
    """Class decorator: make ``cls`` available to ``SPECSPLIT_PROPOSERS`` under ``cls.name``."""
    if cls.kind not in ("tree", "chain"):
        raise ValueError(f"proposer {cls.__name__}: kind must be 'tree' or 'chain', not {cls.kind!r}")
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"proposer name {cls.name!r} is registered twice")
    REGISTRY[cls.name] = cls
    return cls


def resolve(names: Sequence[str]) -> list[type[Proposer]]:
    """The proposer classes for ``names`` in order; ValueError naming an unknown one, a repeated
    one, or more than one tree proposer."""
    classes = []
    for name in names:
        if name not in REGISTRY:
            raise ValueError(f"unknown proposer {name!r}; registered: {', '.join(sorted(REGISTRY))}")
        if REGISTRY[name] in classes:
            raise ValueError(f"proposer {name!r} named twice")
        classes.append(REGISTRY[name])
    if sum(c.kind == "tree" for c in classes) > 1:
        raise ValueError("at most one tree proposer (the draft model) per fleet")
    return classes


def build_shared(classes: Sequence[type[Proposer]], policy: Any = None, settings: Any = None) -> Shared:
    shared = Shared(policy=policy, settings=settings)
    for cls in classes:
        resource = cls.create_shared(shared)
        if resource is not None:
            shared.resources[cls.name] = resource
    return shared


def instantiate(classes: Sequence[type[Proposer]], session: Any, shared: Shared) -> list[Proposer]:
    return [cls(session, shared) for cls in classes]


ProposerFactory = Callable[[Any], list[Proposer]]
