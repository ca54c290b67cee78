"""The one tree module, torch-free: validation, depths, paths to the root, subtrees, and the
in-memory tree a draft grows and re-roots.

Two representations only: the wire's ``FlatTree`` (``parents[i]`` is node i's parent,
``parents[0] == -1`` and ``0 <= parents[i] < i``: topological order; node 0 is the root, the
newest committed token) and ``DraftTree``, the draft's growable tree that becomes a FlatTree.
The orchestrator, the draft and verification all take their tree math from here; masks and
positions (tensors) are built from these index lists in ``specsplit.engine.masks``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from schemas import MAX_GROWN_DEPTH, MAX_GROWN_NODES, ErrorCode, FlatTree, GrownTree, TreeSpec
from specsplit.errors import SpecError, TreeError

MIN_HINT_PROB = 1e-6  # a hinted node's probability is at least this (its score is a log)

__all__ = [
    "DraftTree", "SpecError", "TreeError", "TreeLayout", "ancestor_pairs", "check_child_dists", "check_parents",
    "check_token_ids", "depths_of", "path_to", "reroot_grown", "root_to_leaf_paths", "subtree", "subtree_nodes",
    "validate_tree",
]


@dataclass(frozen=True, slots=True)
class TreeLayout:
    """Validated structure of a flat tree."""

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)


def check_parents(parents, *, max_nodes: int, max_depth: int) -> TreeLayout:
    """Validate parent order and caps; return depths and children. Raises TreeError."""
    n = len(parents)
    if n == 0:
        raise TreeError("tree has no nodes")
    if n > max_nodes:
        raise TreeError(f"tree has {n} nodes, limit is {max_nodes}")
    if parents[0] != -1:
        raise TreeError(f"parents[0] must be -1, got {parents[0]}")
    depths = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        p = parents[i]
        if not isinstance(p, int) or not 0 <= p < i:
            raise TreeError(f"parents[{i}] = {p} must satisfy 0 <= parent < {i} (topological order)")
        depths[i] = depths[p] + 1
        if depths[i] > max_depth:
            raise TreeError(f"node {i} has depth {depths[i]}, limit is {max_depth}")
        children[p].append(i)
    return TreeLayout(tuple(parents), tuple(depths), tuple(tuple(c) for c in children))


def check_token_ids(token_ids, vocab_size: int, what: str = "token") -> None:
    """All ids in [0, vocab_size) or TreeError."""
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            raise TreeError(f"{what} id {t} at index {i} is outside the vocabulary [0, {vocab_size})")


def check_child_dists(tree: FlatTree, layout: TreeLayout, vocab_size: int, tol: float = 1e-3) -> None:
    """A sampled tree carries, for every node with children, the distribution its children were
    drawn from; each child token must have positive probability there."""
    if not tree.sampled:
        return
    for v in range(layout.num_nodes):
        ids, probs = tree.child_dist_ids[v], tree.child_dist_probs[v]
        if not layout.children[v]:
            continue
        if not ids:
            raise TreeError(f"node {v} has children but no draft distribution")
        check_token_ids(ids, vocab_size, what=f"distribution of node {v}:")
        if len(set(ids)) != len(ids):
            raise TreeError(f"distribution of node {v} repeats a token id")
        if any(not math.isfinite(p) or p < 0.0 for p in probs):
            raise TreeError(f"distribution of node {v} has a negative or non-finite probability")
        if abs(sum(probs) - 1.0) > tol:
            raise TreeError(f"distribution of node {v} sums to {sum(probs):.6f}, not 1")
        support = dict(zip(ids, probs))
        for c in layout.children[v]:
            if support.get(tree.token_ids[c], 0.0) <= 0.0:
                raise TreeError(f"child {c} (token {tree.token_ids[c]}) has zero draft probability at node {v}")


def validate_tree(tree: FlatTree, *, vocab_size: int, max_nodes: int, max_depth: int) -> TreeLayout:
    """The one validation of an incoming tree: structure, caps, token range, distributions."""
    layout = check_parents(tree.parents, max_nodes=max_nodes, max_depth=max_depth)
    check_token_ids(tree.token_ids, vocab_size)
    check_child_dists(tree, layout, vocab_size)
    return layout


def depths_of(parents) -> list[int]:
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def path_to(node: int, parents) -> list[int]:
    """Node indices from the root to ``node`` inclusive: the one walk to the root."""
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def ancestor_pairs(parents) -> tuple[list[int], list[int]]:
    """(rows, cols): node ``rows[k]`` sees node ``cols[k]`` (itself or an ancestor). The index
    lists an ancestor mask is scattered from, on any device, in one operation."""
    rows, cols = [], []
    for i in range(len(parents)):
        for a in path_to(i, parents):
            rows.append(i)
            cols.append(a)
    return rows, cols


def root_to_leaf_paths(parents) -> list[list[int]]:
    """Every root->leaf path, leaves in index order."""
    has_child = [False] * len(parents)
    for p in parents[1:]:
        has_child[p] = True
    return [path_to(i, parents) for i in range(len(parents)) if not has_child[i]]


def subtree_nodes(parents, node: int) -> list[int]:
    """``node`` and its descendants, in index (topological) order."""
    inside, out = {node}, [node]
    for i in range(node + 1, len(parents)):
        if parents[i] in inside:
            inside.add(i)
            out.append(i)
    return out


def subtree(tree: FlatTree, node: int) -> FlatTree:
    """The subtree of a FlatTree rooted at ``node``, re-indexed, with its draft distributions."""
    keep = subtree_nodes(tree.parents, node)
    index = {old: new for new, old in enumerate(keep)}
    return FlatTree(
        token_ids=[tree.token_ids[i] for i in keep],
        parents=[-1] + [index[tree.parents[i]] for i in keep[1:]],
        draft_logprobs=[0.0] + [tree.draft_logprobs[i] for i in keep[1:]] if tree.draft_logprobs else [],
        child_dist_ids=[tree.child_dist_ids[i] for i in keep] if tree.sampled else [],
        child_dist_probs=[tree.child_dist_probs[i] for i in keep] if tree.sampled else [],
    )


class DraftTree:
    """A draft's tree in memory. Node 0 is the newest committed token, at cache index
    ``prefix_len - 1``. A forwarded node has a cache ``slot`` (-1 until it is forwarded); scores
    are cumulative draft log-probs. Sampled trees also carry, per expanded node, the distribution
    its children were drawn from (``dists``). Greedy trees are kept between requests: grown while
    the target verifies, then re-rooted at the bonus token."""

    def __init__(self, root: int, prefix_len: int, branch: int):
        self.branch, self.prefix_len = branch, prefix_len
        self.tokens, self.parents, self.logps, self.scores, self.depths = [root], [-1], [0.0], [0.0], [0]
        self.kids: list[list[int]] = [[]]
        self.slot = [prefix_len - 1]
        self.dists: dict[int, tuple[list[int], list[float]]] = {}
        # greedy: an expanded node's next most probable tokens beyond its ``branch`` children, most
        # probable first, as (token, log-prob): growth may add them (``spare_candidates``)
        self.spares: dict[int, list[tuple[int, float]]] = {}
        # greedy growth: nodes another proposer added (``add_hints``); their log-probs are
        # estimates, not the draft's, so re-rooting drops them (``kept_subtree``). A node with
        # hinted children scores its other children lower by ``discount[node]``: log(1 - the
        # hinted ones' probability), the chance that the target takes none of them
        self.hinted: set[int] = set()
        self.discount: dict[int, float] = {}
        self.round, self.max_depth, self.forward_ms = -1, 0, 0.0
        self.process = None  # the request's logits processing (engine.penalties.DraftProcessing)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, logp: float) -> int:
        i = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.logps.append(logp)
        self.scores.append(self.scores[parent] + logp + self.discount.get(parent, 0.0))
        self.depths.append(self.depths[parent] + 1)
        self.kids.append([])
        self.slot.append(-1)
        self.kids[parent].append(i)
        return i

    def add_children(self, node: int, tokens: list[int], logps: list[float]) -> list[int]:
        return [self.add(node, t, lp) for t, lp in zip(tokens, logps)]

    def candidates(self, max_depth: int, min_logp: float) -> list[int]:
        """Unforwarded nodes whose children would still be within ``max_depth``."""
        return [i for i in range(1, len(self.tokens))
                if self.slot[i] < 0 and self.depths[i] < max_depth and self.scores[i] >= min_logp]

    def spare_candidates(self, max_depth: int) -> list[tuple[float, int]]:
        """(score, parent) of each expanded node's next spare token within ``max_depth``: the
        sibling growth may add. Siblings of the verified children are where a bonus token lands
        when the target rejects them all."""
        return [(self.scores[node] + spare[0][1] + self.discount.get(node, 0.0), node)
                for node, spare in self.spares.items() if spare and self.depths[node] < max_depth]

    def add_spare(self, node: int) -> int:
        """``node``'s next spare token as its child; the new node."""
        token, logp = self.spares[node].pop(0)
        return self.add(node, token, logp)

    def add_hints(self, tree: FlatTree, probs: list[float], *, max_depth: int, max_nodes: int) -> int:
        """The nodes of ``tree`` (validated, rooted at this tree's root: the round's verified
        tree) that this tree lacks, added where a path leaves it; within ``max_depth`` and
        ``max_nodes``. ``probs[i]``: the orchestrator's estimate that node i ends on the
        accepted path; a hinted node scores its parent's score plus log(probs[i] / probs of its
        parent), the chance the target takes it there, and its parent's other children lose
        that chance (``discount``). Growth then ranks them with the draft's own nodes: a
        prompt-lookup chain the target accepts leaves a forwarded path to re-root at. Returns
        the nodes added."""
        where, added = [0] * tree.num_nodes, 0
        for i in range(1, tree.num_nodes):
            p = where[tree.parents[i]]
            if p < 0 or self.depths[p] >= max_depth:
                where[i] = -1
                continue
            tok = tree.token_ids[i]
            node = next((c for c in self.kids[p] if self.tokens[c] == tok), -1)
            if node < 0:
                if len(self.tokens) >= max_nodes:
                    where[i] = -1
                    continue
                taken = min(1.0, probs[i] / max(probs[tree.parents[i]], MIN_HINT_PROB))
                node = self._add_hinted(p, tok, taken)
                if p in self.spares:  # not a spare any more
                    self.spares[p] = [s for s in self.spares[p] if s[0] != tok]
                added += 1
            where[i] = node
        return added

    def _add_hinted(self, parent: int, token: int, taken: float) -> int:
        """A hinted child the target takes at ``parent`` with probability ``taken``; the
        parent's other children and their subtrees lose that much."""
        before = self.discount.get(parent, 0.0)
        left = math.exp(before) - taken
        self.discount[parent] = after = math.log(max(left, MIN_HINT_PROB))
        shift = [c for c in self.kids[parent] if c not in self.hinted]
        while shift:
            c = shift.pop()
            self.scores[c] += after - before
            shift.extend(self.kids[c])
        node = self.add(parent, token, 0.0)
        self.scores[node] = self.scores[parent] + math.log(max(taken, MIN_HINT_PROB))
        self.hinted.add(node)
        return node

    def kept_subtree(self, node: int) -> list[int]:
        """``node`` and its descendants but hinted ones and theirs, in index order: what
        re-rooting at ``node`` keeps (the next round's tree carries the draft's log-probs only)."""
        inside, out = {node}, [node]
        for i in range(node + 1, len(self.parents)):
            if self.parents[i] in inside and i not in self.hinted:
                inside.add(i)
                out.append(i)
        return out

    def settled(self, keep: int, max_depth: int, cands: list[int]) -> bool:
        """True when no descendant of a candidate can enter the best ``keep`` nodes (a child's
        score never exceeds its parent's), so further steps cannot change the result."""
        scores = [self.scores[i] for i in range(1, len(self.tokens)) if self.depths[i] <= max_depth]
        if len(scores) < keep:
            return False
        return heapq.nlargest(keep, scores)[-1] >= max(self.scores[c] for c in cands)

    def best(self, width: int, cands: list[int]) -> list[int]:
        """The ``width`` most probable candidates (lowest index on ties)."""
        return heapq.nlargest(width, cands, key=lambda i: (self.scores[i], -i))

    def first_of_token(self, nodes: list[int]) -> list[int]:
        """Nodes whose token no earlier sibling carries (siblings drawn i.i.d. may repeat)."""
        seen, out = set(), []
        for i in nodes:
            key = (self.parents[i], self.tokens[i])
            if key not in seen:
                seen.add(key)
                out.append(i)
        return out

    def child_path(self, tokens: list[int]) -> list[int]:
        """Nodes spelling ``tokens`` from the root (one per token), or [] if it leaves the tree."""
        path, node = [], 0
        for tok in tokens:
            node = next((c for c in self.kids[node] if self.tokens[c] == tok), -1)
            if node < 0:
                return []
            path.append(node)
        return path

    def reroot_path(self, tokens: list[int]) -> list[int]:
        """The nodes ``tokens`` spell from the root when the last of them was forwarded (its
        children are the draft's): the path re-rooting along ``tokens`` takes; [] when it cannot."""
        path = self.child_path(tokens)
        return path if path and self.slot[path[-1]] >= 0 else []

    def rerooted(self, node: int, prefix_len: int, where: dict[int, int]) -> DraftTree:
        """The subtree under ``node`` as a new tree, its cache slots moved per ``where``
        (old slot -> new slot)."""
        sub = self.kept_subtree(node)
        g = DraftTree(self.tokens[node], prefix_len, self.branch)
        index = {old: new for new, old in enumerate(sub)}
        for old in sub[1:]:
            i = g.add(index[self.parents[old]], self.tokens[old], self.logps[old])
            g.slot[i] = where[self.slot[old]] if self.slot[old] >= 0 else -1
        g.spares = {index[old]: list(spare) for old, spare in self.spares.items() if old in index and spare}
        g.max_depth, g.forward_ms = self.max_depth, self.forward_ms
        return g

    def best_flat(self, keep: int, max_depth: int) -> FlatTree:
        """The root and the ``keep`` most probable nodes within ``max_depth`` (a parent always
        outranks its children, so the selection is a tree)."""
        eligible = [i for i in range(1, len(self.tokens)) if self.depths[i] <= max_depth]
        chosen = [0, *sorted(sorted(eligible, key=lambda i: (-self.scores[i], i))[: max(keep, 0)])]
        return self.to_flat(chosen)

    def to_grown(self, max_nodes: int, max_depth: int) -> GrownTree | None:
        """This (greedy) tree, all of it, as a GrowReply carries it (None: over the wire's caps)."""
        if len(self.tokens) > MAX_GROWN_NODES or max(self.depths) > MAX_GROWN_DEPTH:
            return None
        return GrownTree(prefix_len=self.prefix_len, token_ids=list(self.tokens), parents=list(self.parents),
                         draft_logprobs=[float(lp) for lp in self.logps], expanded=[s >= 0 for s in self.slot],
                         hinted=[i in self.hinted for i in range(len(self.tokens))], max_nodes=max_nodes,
                         max_depth=max_depth)

    @classmethod
    def from_grown(cls, grown: GrownTree) -> DraftTree:
        """A GrowReply's tree in memory (its structure checked: TreeError), an expanded node's
        slot standing for its cache entry. Scores are its draft's but at hinted nodes and their
        subtrees (the orchestrator's estimates, which re-rooting drops)."""
        check_parents(grown.parents, max_nodes=MAX_GROWN_NODES, max_depth=MAX_GROWN_DEPTH)
        g = cls(grown.token_ids[0], grown.prefix_len, branch=1)
        for i in range(1, grown.num_nodes):
            g.add(grown.parents[i], grown.token_ids[i], grown.draft_logprobs[i])
            g.slot[i] = grown.prefix_len + i if grown.expanded[i] else -1
        g.hinted = {i for i in range(1, grown.num_nodes) if grown.hinted[i]}
        return g

    def to_flat(self, chosen: list[int] | None = None) -> FlatTree:
        """The FlatTree of ``chosen`` nodes (default: all), with sampled distributions if any."""
        chosen = list(range(len(self.tokens))) if chosen is None else chosen
        index = {old: new for new, old in enumerate(chosen)}
        if any(self.parents[i] not in index for i in chosen[1:]):
            raise SpecError(ErrorCode.INTERNAL, "tree selection lost a parent")
        has_child = {self.parents[i] for i in chosen[1:]}
        sampled = bool(self.dists)
        return FlatTree(
            token_ids=[self.tokens[i] for i in chosen],
            parents=[-1] + [index[self.parents[i]] for i in chosen[1:]],
            draft_logprobs=[self.logps[i] for i in chosen],
            child_dist_ids=[list(self.dists[i][0]) if i in has_child else [] for i in chosen] if sampled else [],
            child_dist_probs=[list(self.dists[i][1]) if i in has_child else [] for i in chosen] if sampled else [],
        )


def reroot_grown(grown: GrownTree, tokens: list[int], spec: TreeSpec) -> tuple[FlatTree, int] | None:
    """What the draft answers a DraftRequest with after growing ``grown``, when the committed
    tokens past its prefix are ``tokens`` (the verdict's accepted ones and bonus) and the round's
    budget is ``spec``: the tree re-rooted along ``tokens`` and its ``max_nodes - 1`` most
    probable nodes within ``max_depth`` (clamped to the draft's limits), with the nodes it
    re-used; None where the draft would draft from scratch (the path leaves the tree, ends at
    an unforwarded node, or keeps nothing). The draft's rule (``DraftTree.reroot_path``,
    ``rerooted``, ``best_flat``) on the wire's lists, without building the tree: the orchestrator
    runs it on a round's critical path (~0.1 ms for 256 nodes). tests/test_reroot_local.py holds
    the two to the same trees. TreeError: a malformed ``grown``."""
    layout = check_parents(grown.parents, max_nodes=MAX_GROWN_NODES, max_depth=MAX_GROWN_DEPTH)
    ids, parents, logps, hinted = grown.token_ids, grown.parents, grown.draft_logprobs, grown.hinted
    node = 0
    for tok in tokens:  # the first child spelling each token, as ``child_path``
        node = next((c for c in layout.children[node] if ids[c] == tok), -1)
        if node < 0:
            return None
    if not tokens or not grown.expanded[node]:
        return None
    # the kept subtree (``kept_subtree``: hinted nodes and theirs dropped), re-indexed in order
    index, kept = {node: 0}, [node]
    scores, depths = [0.0], [0]
    for i in range(node + 1, len(parents)):
        p = index.get(parents[i])
        if p is not None and not hinted[i]:
            index[i] = len(kept)
            kept.append(i)
            scores.append(scores[p] + logps[i])
            depths.append(depths[p] + 1)
    if len(kept) == 1:
        return None
    keep, max_depth = min(spec.max_nodes, grown.max_nodes) - 1, min(spec.max_depth, grown.max_depth)
    eligible = [j for j in range(1, len(kept)) if depths[j] <= max_depth]
    chosen = [0, *sorted(sorted(eligible, key=lambda j: (-scores[j], j))[: max(keep, 0)])]
    at = {j: k for k, j in enumerate(chosen)}
    new_parents = [-1] + [at.get(index[parents[kept[j]]], -1) for j in chosen[1:]]
    if -1 in new_parents[1:]:  # a child outranked its parent: a log-probability above 0 (or NaN)
        raise TreeError("the grown tree's best nodes leave out a parent of one of them")
    tree = FlatTree(token_ids=[ids[kept[j]] for j in chosen], parents=new_parents,
                    draft_logprobs=[0.0] + [logps[kept[j]] for j in chosen[1:]])
    return tree, len(kept) - 1


def lookup_continuation(context: list[int], *, max_tokens: int, min_ngram: int = 3, max_ngram: int = 8,
                        window: int = 4096) -> list[int]:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the
    context's longest suffix n-gram (``max_ngram`` down to ``min_ngram``) within the last
    ``window`` tokens; [] when none recurs. Candidates at no model cost: code and quoted text
    repeat their own identifiers and lines."""
    if max_tokens <= 0 or len(context) <= min_ngram:
        return []
    ctx = context[-window:]
    n_ctx, last = len(ctx), ctx[-1]
    best_k, best_p = 0, -1
    # where the last token recurs (p - 1: ctx[p - 1] == last), found by list.index in C: a
    # Python-level pass over a 4096-token window cost ~0.1 ms a round on the orchestrator's loop
    starts, j = [], max(min_ngram - 1, 0)
    while True:
        try:
            j = ctx.index(last, j, n_ctx - 1)
        except ValueError:
            break
        j += 1
        starts.append(j)
    for p in reversed(starts):  # most recent first
        k = 1
        while k < max_ngram and k < p and ctx[p - 1 - k] == ctx[n_ctx - 1 - k]:
            k += 1
        if k > best_k:  # the longest match; among equals, the most recent (found first)
            best_k, best_p = k, p
            if k == max_ngram:
                break
    return ctx[best_p:best_p + max_tokens] if best_k >= min_ngram else []


def merge_chain(tree: FlatTree, chain: list[int], *, max_depth: int, max_nodes: int) -> FlatTree:
    """``tree`` with the token chain ``chain`` hung under its root: existing nodes are followed
    where they spell the chain, the rest is appended as new nodes (draft log-prob 0: not drafted),
    within ``max_depth`` and ``max_nodes``. Greedy trees only (sampled trees carry draw
    distributions that added nodes would not follow)."""
    if tree.sampled or not chain:
        return tree
    tokens, parents = list(tree.token_ids), list(tree.parents)
    logps = list(tree.draft_logprobs) if tree.draft_logprobs else [0.0] * len(tokens)
    depths = depths_of(parents)
    node = 0
    for tok in chain:
        if depths[node] >= max_depth:
            break
        child = next((i for i in range(node + 1, len(tokens)) if parents[i] == node and tokens[i] == tok), -1)
        if child < 0:
            if len(tokens) >= max_nodes:
                break
            tokens.append(tok)
            parents.append(node)
            logps.append(0.0)
            depths.append(depths[node] + 1)
            child = len(tokens) - 1
        node = child
    if len(tokens) == tree.num_nodes:
        return tree
    return FlatTree(token_ids=tokens, parents=parents, draft_logprobs=logps)
