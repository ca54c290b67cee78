"""The orchestrator's cross-session n-gram cache (``specsplit.orchestrator.ngrams``) as a
proposer: asked only where the proposers before it (prompt lookup) found nothing; each token's
calibration key is the length of the n-gram that predicted it (a longer key predicts better).
It learns every finished session's output. ``SPECSPLIT_LOOKUP_CACHE_KEYS=0`` turns it off."""

from __future__ import annotations

from collections.abc import Sequence

from specsplit.orchestrator.ngrams import NgramCache
from specsplit.proposers.base import Budget, Proposal, Proposer, Shared, register


@register
class NgramCacheProposer(Proposer):
    name = "ngrams"
    fallback = True

    @classmethod
    def create_shared(cls, shared: Shared) -> NgramCache | None:
        keys = getattr(shared.settings, "lookup_cache_keys", 0)
        lookup = getattr(shared.settings, "lookup_max_tokens", 0)  # no chain tokens: nothing to propose
        return NgramCache(keys) if keys > 0 and lookup > 0 else None

    def suggest(self, committed: Sequence[int], budget: Budget) -> Proposal | None:
        cache = self.resource()
        if cache is None:
            return None
        chain, lengths = cache.continuation(committed, max_tokens=budget.chain_tokens)
        return Proposal(chain=chain, keys=lengths) if chain else None

    def finish(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        cache = self.resource()
        if cache is not None and output:  # what later sessions may be proposed
            cache.add(list(prompt[-cache.max_ngram:]) + list(output))
