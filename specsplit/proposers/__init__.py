"""Proposers: everything that offers tokens for a round's tree (``specsplit.proposers.base``).

Importing a module registers its proposer; a new proposer is one module plus one line here."""

from specsplit.proposers import (  # noqa: F401  (registration)
    draft_model, grammar_forced, ngram_cache, prediction, prompt_lookup, repeat_line,
)
from specsplit.proposers.base import REGISTRY, Budget, Proposal, Proposer, Shared, Verdict, register, resolve

__all__ = ["REGISTRY", "Budget", "Proposal", "Proposer", "Shared", "Verdict", "register", "resolve"]
