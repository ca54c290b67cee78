"""What the draft is told of a round's other proposers while it grows (torch-free).

The draft's growth ranks unforwarded nodes by the probability that each becomes the next round's
root. Prompt lookup's chains hang under the round's root beside the draft's nodes; when the
target accepts one, the next root is a child of a chain node the draft never saw, and it drafts
from scratch (about a fifth of a HumanEval fleet's rounds: docs/results.md). A GrowRequest may
therefore carry the merged tree with the cost model's calibrated acceptance of each node, so the
draft adds the chain nodes it lacks and grows them with its own, most probable first.
"""

from __future__ import annotations

from typing import Any

from schemas import FlatTree
from specsplit.orchestrator.costmodel import CostModel


def growth_hint(cands: Any, cost: CostModel | None) -> tuple[FlatTree | None, list[float]]:
    """(tree, node probabilities) for a GrowRequest from a round's ``Candidates``: the merged
    tree when other proposers added nodes to the draft's, with each node's estimated probability
    of ending on the accepted path (the cost model's calibration; its priors without one).
    (None, []) when the tree is the draft's own."""
    if not cands.merged_sources or cands.merged is None:
        return None, []
    probs = (cost or CostModel()).node_probs(cands.merged, sources=cands.merged_sources)
    return cands.merged, [min(1.0, max(0.0, p)) for p in probs]
