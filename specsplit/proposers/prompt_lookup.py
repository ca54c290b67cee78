"""Prompt lookup: the tokens that followed the most recent earlier occurrence of the context's
last n-gram (``specsplit.tree.lookup_continuation``). Candidates at no model cost: code and
quoted text repeat their own identifiers and lines."""

from __future__ import annotations

from collections.abc import Sequence

from specsplit.proposers.base import Budget, Proposal, Proposer, register
from specsplit.tree import lookup_continuation


@register
class PromptLookup(Proposer):
    name = "lookup"

    def suggest(self, committed: Sequence[int], budget: Budget) -> Proposal | None:
        min_ngram = getattr(self.shared.policy, "lookup_min_ngram", 3)
        chain = lookup_continuation(committed, max_tokens=budget.chain_tokens, min_ngram=min_ngram)
        return Proposal(chain=chain, keys=[0] * len(chain)) if chain else None
