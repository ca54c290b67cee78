"""The tree budget per round, from measurements instead of fixed constants (torch-free).

A round costs ``overhead + verify(tokens)`` milliseconds and yields ``1 + accepted`` tokens. The
model learns, online and shared by every session of an orchestrator (same models, same machine):
- verify ms as a linear function of the tokens a verify forward carries (sync tokens + tree
  nodes), by exponentially weighted least squares: on a CPU whose GEMMs are compute-bound the
  slope is large (a 16-node tree costs several 1-node forwards), on a GPU it is near zero; and,
  for forwards of up to ``TABLE_TOKENS`` tokens, each size's own measured cost, because kernels
  are not linear in the rows they multiply: llama.cpp's CPU matmul runs rows 4 at a time through
  a repacked GEMM and the rest one at a time, so a 4-token verify costs about what a 3-token one
  does, and a line fitted to the small sizes a lone session mostly sends prices it too high
  (figures: docs/results.md, commit af831b5). For a session alone, a size never measured is
  priced at the measured cost of the nearest smaller size, the least it can cost: a size that
  would pay at that price is tried, and measured, once (priced by the line between the sizes
  around it, a lone lookup session never tried 3 or 4 tokens); in a shared forward, by the line
  kept between the measured costs of the sizes around it;
- the round's other time on the critical path (draft, transport), an exponential average;
- the probability that a drafted node is accepted, calibrated against the draft's own path
  probability (``BINS`` bins, smoothed toward the draft's estimate), and for a chain proposer's
  nodes (no draft probability) by (proposer name, key) and their position in the chain
  (``chain_prob``): prompt lookup's by position alone, the cross-session n-gram cache's
  (``specsplit.orchestrator.ngrams``) also by the length of the n-gram that proposed them (a
  longer key predicts better: docs/results.md, 46c49fc).
Each round, ``choose`` keeps the prefix-closed set of nodes (most likely first) that maximizes
expected tokens per millisecond; ``predicted_tok_s`` is what that choice expects.

Under load the target verifies several sessions in one forward (VerifyReply ``batch_tokens``,
``batch_size``), so the line is fitted against the forward's tokens, every session's, and the
model tracks what the rest of the forward brings: its tokens and the tokens its sessions deliver
per round. ``choose`` then maximizes the tokens per millisecond of the whole forward: a node
pays only while its acceptance probability beats (ms per token) x (tokens per ms the whole batch
delivers). A lone session on a steep (CPU) line keeps a few likely nodes; sixteen sharing the
forward each go to a root-only tree (plain decoding) unless their nodes are near-certain; on a
flat (GPU) line every node still pays. ``min_nodes`` only holds for a session expected alone,
and in a plain round (no draft call: prompt-lookup candidates under a root) only once in every
``EXPLORE_EVERY`` rounds that have candidates: a forced lookup node that does not pay costs a
wider forward for nothing (docs/results.md, commit 4b7b872), but lookup's calibration still
needs a verified node now and then to notice when candidates start to pay.
Every session re-chooses from the measured state each round, so the batch moves toward the
best rate together: pricing nodes at the rate the batch now delivers and re-measuring is
Dinkelbach's iteration for a ratio, which climbs to its maximum (a session over-speculating lowers
the rate, which makes nodes look cheaper, but the next choices then raise it again).

How deep the draft goes is priced the same way (``draft_spec``): expanding a node costs the
draft's measured milliseconds per expanded node plus the verify slope for what it adds, and
pays only while the calibrated acceptance of the node's path is worth more than that time at
the rate the rounds currently deliver (tokens per ms). That threshold is sent as the round's
``min_path_prob``; on a CPU where a draft step costs a large share of a target step it is high
(only near-certain paths are worth drafting), on a GPU with a cheap draft it falls toward 0.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from schemas import FlatTree, TreeSpec
from specsplit.orchestrator.estimators import (  # noqa: F401  (re-exported: the model's parts)
    CELL_PRIOR, CELL_SEEN_MAX, CELL_WEIGHT, EWMA_WEIGHT, MIN_VARIANCE, Hits, LineFit, SizeCost, ewma,
)

BINS = 10  # acceptance bins by draft path probability: each fills in a few rounds, yet they separate paths
SMALL_SYNC = 64  # a verify carrying more sync tokens than this is a prefill or a resend: not a cost sample
LOOKUP_POSITIONS = 16  # chain positions calibrated apart; chains rarely run deeper, those share the last
EXPLORE_EVERY = 8  # a lone plain round verifies a lookup node that does not pay once in this many
CACHE_NGRAMS = 8  # n-gram cache candidates: calibrated per key length up to this many tokens
TABLE_TOKENS = 64  # forwards of up to this many tokens keep their own measured cost (``verify_ms``)
DECAY = 0.97  # line fits' history weight per step: 1 / (1 - DECAY) steps' memory, one slow forward barely tilts
MIN_NODES = 1  # a lone session keeps at least this many nodes besides the root (1: always speculate)
MIN_OBSERVATIONS = 5  # rounds and fresh drafts before the model sets the draft's depth: fewer are noise
DRAFT_PRIOR_WEIGHT = 2.0  # the draft's path probability, as observations of its bin: a few verdicts outweigh it
CHAIN_PRIOR_MEAN = 0.5  # a chain cell with no observations: Beta(1, 1), as likely accepted as not ...
CHAIN_PRIOR_WEIGHT = 2.0  # ... worth two observations, so a few verdicts move it
THRESHOLD_STEPS = BINS * 10  # ``draft_spec`` tries min_path_prob in steps this fine: ten per calibration bin
SHARED_SESSIONS = 0.5  # ``others_sessions`` (an average) from which a forward is more often shared than not
MIN_MS = 1e-9  # a duration divided by is at least this: a zero-ms estimate does not divide by zero
MAX_CHAINS = 64  # (proposer, key) pairs kept, least recently observed out first: above any fleet's proposers
LOOKUP = "lookup"  # prompt lookup's chain nodes (``lookup`` parameters): calibrated per position
NGRAMS = "ngrams"  # the n-gram cache's chain nodes (``cached`` parameters): per key length too


@dataclass(frozen=True, slots=True)
class Choice:
    nodes: list[int]  # kept node indices, ascending (root first)
    expected_tokens: float  # 1 (bonus) + expected accepted nodes
    expected_ms: float  # overhead + verify(tokens)


Source = tuple[str, int]  # a chain node's (proposer name, calibration key)


@dataclass
class CostModel:
    decay: float = DECAY  # weight of the line fits' history per observation
    min_nodes: int = MIN_NODES  # never fewer than this many nodes besides the root, alone
    _verify: LineFit = field(default_factory=LineFit)  # verify ms vs the forward's tokens
    # per forward size (tokens 1..TABLE_TOKENS; index 0 unused)
    _sizes: list[SizeCost] = field(default_factory=lambda: [SizeCost() for _ in range(TABLE_TOKENS + 1)])
    overhead_ms: float | None = None
    _acc: list[Hits] = field(default_factory=lambda: [Hits() for _ in range(BINS)])  # per path probability bin
    # chain nodes (prompt lookup, n-gram cache, ...): (proposer name, key) -> per position
    # (``chain_prob``), at most MAX_CHAINS pairs, the least recently observed first out
    chains: dict[Source, list[Hits]] = field(default_factory=dict)
    _draft: LineFit = field(default_factory=LineFit)  # draft ms vs expanded nodes
    rate: float | None = None  # tokens per ms the rounds deliver (exponential average)
    rate_sessions: float | None = None  # sessions under way while ``rate`` was measured (average)
    min_observations: int = MIN_OBSERVATIONS  # rounds / fresh drafts before the model sets the draft's depth
    _rounds_seen: int = 0
    _plain_chances: int = 0  # lone plain rounds that had lookup candidates (``EXPLORE_EVERY``)
    # the rest of the verify forward (exponential averages; None: nothing measured, alone)
    others_sessions: float | None = None  # sessions besides this one
    others_tokens: float | None = None  # their new tokens
    round_tokens: float | None = None  # tokens a session's round delivers (1 + accepted)
    # plain decoding under load (``plain_pays``): what a speculative round delivers and how long
    # it holds the draft worker (its draft plus the growth it asks for while the target verifies)
    active_sessions: int = 0  # this orchestrator's sessions under way (each actor counts itself)
    speculating: int = 0  # of those, the ones in a drafted round now (from its draft call to its verdict)
    spec_tokens: float | None = None
    draft_busy_ms: float | None = None
    draft_call_ms: float | None = None  # a drafted round's draft call (the draft worker's own ms)
    spec_nodes: float | None = None  # tokens a drafted round's tree sends to the verify forward
    # plain rounds (no draft call; prompt-lookup nodes only): their time besides the verify
    # forward, kept apart from ``overhead_ms``, which holds a speculative round's draft time
    plain_overhead_ms: float | None = None

    # ---- verify cost ------------------------------------------------------------------
    def observe_verify(self, tokens: int, ms: float) -> None:
        self._verify.observe(float(tokens), float(ms), self.decay)
        if 1 <= tokens <= TABLE_TOKENS:
            self._sizes[tokens].observe(ms)

    def observe_forward(self, own_tokens: int, ms: float, batch_tokens: int = 0, batch_size: int = 1) -> None:
        """One clean verify of ``own_tokens`` (sync + nodes) served by a forward of
        ``batch_tokens`` tokens over ``batch_size`` sessions that took ``ms`` (batch_tokens 0:
        not reported, the forward was this session's alone)."""
        total = max(batch_tokens, own_tokens)
        self.observe_verify(total, ms)
        self.others_sessions = ewma(self.others_sessions, float(max(0, batch_size - 1)))
        self.others_tokens = ewma(self.others_tokens, float(total - own_tokens))

    def load(self) -> tuple[float, float]:
        """(new tokens, delivered tokens) the rest of a verify forward is expected to bring."""
        others = self.others_sessions or 0.0
        return self.others_tokens or 0.0, others * (self.round_tokens or 1.0)

    def shared(self) -> bool:
        """Whether a verify forward is expected to serve other sessions too."""
        return (self.others_sessions or 0.0) >= SHARED_SESSIONS

    def verify_line(self) -> tuple[float, float]:
        """(intercept ms, ms per token); slope 0 until sizes vary, never negative."""
        return self._verify.line()

    # ---- draft cost and depth -------------------------------------------------------------
    def observe_draft(self, expanded: int, ms: float) -> None:
        """A fresh draft (nothing reused) that expanded ``expanded`` nodes in ``ms``."""
        self._draft.observe(float(expanded), float(ms), self.decay)

    def draft_ms_per_node(self) -> float:
        slope = self._draft.line()[1]
        average = self._draft.y_per_x()
        if slope <= 0.0 and average is not None:
            return average  # sizes never varied: the average
        return slope

    def observe_rate(self, tokens: int, ms: float) -> None:
        if ms <= 0:
            return
        self.rate = ewma(self.rate, tokens / ms)
        # the sessions that shared the draft worker with this round: those drafting, not those
        # decoding plainly beside it (one session measuring speculation among 15 plain ones got
        # 16 x its rate credited, as if all 16 could draft that fast)
        self.rate_sessions = ewma(self.rate_sessions, float(max(1, self.speculating)))
        self.round_tokens = ewma(self.round_tokens, float(tokens))
        self._rounds_seen += 1

    def observe_plain(self, tokens: int, overhead_ms: float) -> None:
        """A plain round (no draft call) delivered ``tokens`` and spent ``overhead_ms`` besides
        its verify forward. It updates what the rest of a forward is expected to deliver
        (``round_tokens``: the sessions sharing a forward decode plainly together), never
        ``rate``: that is what speculative rounds deliver, which ``plain_pays`` weighs plain
        decoding against."""
        self.round_tokens = ewma(self.round_tokens, float(tokens))
        self.plain_overhead_ms = ewma(self.plain_overhead_ms, max(0.0, overhead_ms))

    def observe_speculation(self, tokens: int, draft_busy_ms: float, *, draft_ms: float | None = None,
                            nodes: int | None = None) -> None:
        """A drafted round delivered ``tokens`` and held the draft worker ``draft_busy_ms``, of
        which its draft call took ``draft_ms``; its tree sent ``nodes`` tokens to verify."""
        if draft_busy_ms > 0:
            self.spec_tokens = ewma(self.spec_tokens, float(tokens))
            self.draft_busy_ms = ewma(self.draft_busy_ms, draft_busy_ms)
            if draft_ms is not None:
                self.draft_call_ms = ewma(self.draft_call_ms, max(0.0, draft_ms))
            if nodes is not None:
                self.spec_nodes = ewma(self.spec_nodes, float(max(nodes, tokens)))

    def measuring(self) -> bool:
        """No drafted round measured yet: the next one is ``plain_pays``'s measurement."""
        return self.spec_tokens is None or self.draft_busy_ms is None

    def plain_pays(self) -> bool:
        """Whether the sessions under way deliver more together by plain decoding (no draft
        call: root-only trees, which the target verifies in one batched forward) than by
        speculating. A draft worker runs one session's draft at a time, so speculative rounds
        together deliver at most ``spec_tokens / draft_busy_ms`` tokens per ms however many
        sessions wait; N sessions decoding plainly share one forward of N tokens and deliver
        ``N / verify_ms(N)``. Speculation is credited with the larger of that bound and what its
        rounds measurably delivered together: the per-session rate of speculative rounds times
        the sessions they shared the workers with when measured (several draft workers, or
        lockstep drafting, beat the one-worker bound), up to N. Not N x a rate measured under a
        lighter load: one session's rate says nothing of what 16 sessions sharing one draft
        worker get each, and extrapolating it flipped plain-decoding batches back to a slower
        speculation whenever one slow forward tilted the verify line (docs/results.md, eb8e964).
        Every input is measured (draft time, acceptance, the verify line, round rates); a lone
        session always speculates. The estimate favours speculation (nothing else in its round
        costs), so the switch comes late rather than early, and back as soon as the sessions
        under way are few.

        The one-worker bound is itself capped by what the sessions' rounds take end to end when
        they all draft: each round's draft call waits behind the others' (``n`` x the measured
        draft call), then one forward verifies every session's tree (``n`` x the measured tokens a
        drafted round sends). Without that cap a cheap draft call (a 1-node catch-up) made
        speculation look nearly as good as plain decoding, every session switched to drafting at
        once, and their rounds slowed to the draft queue plus a forward they no longer shared.
        Until a drafted round has been measured, one session at a time drafts to measure it and
        the others decode plainly: sessions starting together all drafting at round 0 queue every
        prompt prefill on the one draft worker. Figures: docs/results.md, commit cf5a4c3."""
        n = self.active_sessions
        if n < 2:
            return False
        if self.measuring():
            return self.speculating > 0  # nothing measured: one session measures, the rest decode
        if self._verify.n <= 0:
            return False
        plain = n / max(MIN_MS, self.verify_ms(n, explore=False))
        shared = n if self.rate_sessions is None else min(float(n), self.rate_sessions)
        one_worker = self.spec_tokens / self.draft_busy_ms
        if self.draft_call_ms is not None:
            lockstep_ms = n * self.draft_call_ms + self.verify_ms(n * (self.spec_nodes or self.spec_tokens),
                                                                  explore=False)
            one_worker = min(one_worker, n * self.spec_tokens / max(MIN_MS, lockstep_ms))
        spec = max(one_worker, shared * (self.rate or 0.0))
        return plain > spec

    def batch_rate(self) -> float | None:
        """Tokens per ms the whole verify batch delivers: the sessions sharing it, each at the
        measured per-session rate."""
        return None if self.rate is None else self.rate * (1.0 + (self.others_sessions or 0.0))

    def draft_spec(self, spec: TreeSpec) -> TreeSpec:
        """``spec`` with the round's ``min_path_prob``: the lowest draft path probability whose
        calibrated acceptance still pays for one more expanded node, priced at the whole batch's
        rate (a node's draft and verify time delays every session sharing the workers).
        Until the model has seen enough rounds and fresh drafts, ``spec`` as configured."""
        if (self.rate is None or self._rounds_seen < self.min_observations
                or self._draft.n <= 0 or self._verify.n <= 0):
            return spec
        need = self.batch_rate() * (self.draft_ms_per_node() + self.verify_line()[1])
        if need <= 0.0:
            return spec.model_copy(update={"min_path_prob": 0.0})
        grid = (k / THRESHOLD_STEPS for k in range(THRESHOLD_STEPS + 1))
        paying = next((p for p in grid if self.accept_prob(p) >= need), 1.0)  # the lowest path probability that pays
        return spec.model_copy(update={"min_path_prob": paying})

    def verify_ms(self, tokens: float, explore: bool | None = None) -> float:
        """Expected ms of a verify forward of ``tokens`` tokens (fractional: an average load,
        between the two sizes around it). ``explore`` (default: when the forward is expected to
        serve this session alone) prices a size never measured at the least it can cost."""
        explore = not self.shared() if explore is None else explore
        lo = math.floor(tokens)
        if tokens == lo:
            return self._size_ms(int(lo), explore)
        low = self._size_ms(lo, explore)
        return low + (tokens - lo) * (self._size_ms(lo + 1, explore) - low)

    def _size_ms(self, n: int, explore: bool) -> float:
        a, b = self.verify_line()
        line = a + b * n
        if not 1 <= n <= TABLE_TOKENS:
            return line
        sizes = self._sizes
        if sizes[n].measured:  # its own average, the line weighing in while it is new
            return sizes[n].price(line)
        # never measured: exploring, the measured cost of the nearest smaller size, the least it
        # can cost (a size that would pay at that price gets chosen, and so measured, once;
        # priced by the line, a lone session never tried a 4-token verify); else the line, kept
        # between the measured costs of the sizes around it. A shared forward does not explore:
        # its size is every session's choice, and each pricing its nodes at the smaller batch's
        # cost kept a batch speculating where plain decoding paid
        below = next((m for m in range(n - 1, 0, -1) if sizes[m].measured), 0)
        if below and explore:
            return self._size_ms(below, explore)
        above = next((m for m in range(n + 1, TABLE_TOKENS + 1) if sizes[m].measured), 0)
        if above:
            line = min(line, self._size_ms(above, explore))
        if below:
            line = max(line, self._size_ms(below, explore))
        return line

    def observe_overhead(self, ms: float) -> None:
        self.overhead_ms = ewma(self.overhead_ms, ms)

    # ---- acceptance ---------------------------------------------------------------------
    def accept_prob(self, path_prob: float) -> float:
        """Calibrated probability that a node whose draft path probability is ``path_prob`` is
        accepted (its whole path matches), smoothed toward the draft's own estimate."""
        return self._acc[_bin(path_prob)].posterior(path_prob, DRAFT_PRIOR_WEIGHT)

    def chain_prob(self, source: Source, position: int) -> float:
        """Calibrated probability that a chain node from ``source`` (proposer name, calibration
        key) at ``position`` in its chain ends on the accepted path."""
        return self._chain_cell(source, position).posterior(CHAIN_PRIOR_MEAN, CHAIN_PRIOR_WEIGHT)

    def lookup_prob(self, position: int, ngram: int = 0) -> float:
        """``chain_prob`` of a prompt-lookup node, or (``ngram`` > 0, the length of the n-gram
        that proposed it) of an n-gram cache candidate."""
        return self.chain_prob((NGRAMS, ngram) if ngram > 0 else (LOOKUP, 0), position)

    def _chain_cell(self, source: Source, position: int, learn: bool = False) -> Hits:
        """``source``'s cell at ``position`` (keys capped at CACHE_NGRAMS, positions at
        LOOKUP_POSITIONS - 1). ``learn``: made if new and marked most recently observed, the least
        recent pair dropped past MAX_CHAINS; otherwise a pair never observed reads as the prior."""
        name, key = source
        source = (name, min(max(key, 0), CACHE_NGRAMS))
        position = min(position, LOOKUP_POSITIONS - 1)
        if not learn:
            cells = self.chains.get(source)
            return Hits() if cells is None else cells[position]
        cells = self.chains.pop(source, None) or [Hits() for _ in range(LOOKUP_POSITIONS)]
        self.chains[source] = cells
        if len(self.chains) > MAX_CHAINS:
            del self.chains[next(iter(self.chains))]
        return cells[position]

    def _calibration(self, tree: FlatTree, chain: dict[int, Source],
                     learn: bool = False) -> Iterator[tuple[int, Hits, float, float]]:
        """Every node but the root with its calibration cell and that cell's prior (mean,
        weight): a chain node (in ``chain``) by its source and its position (its parent's + 1
        under a chain node, else 0); any other by the bin of its draft path probability, which
        is also its prior's mean. ``learn``: as for ``_chain_cell``."""
        score = [0.0] * tree.num_nodes
        pos = [0] * tree.num_nodes
        for i in range(1, tree.num_nodes):
            p = tree.parents[i]
            if i in chain:
                pos[i] = pos[p] + 1 if p in chain else 0
                yield i, self._chain_cell(chain[i], pos[i], learn), CHAIN_PRIOR_MEAN, CHAIN_PRIOR_WEIGHT
            else:
                score[i] = score[p] + (tree.draft_logprobs[i] if tree.draft_logprobs else 0.0)
                path_prob = math.exp(min(0.0, score[i]))
                yield i, self._acc[_bin(path_prob)], path_prob, DRAFT_PRIOR_WEIGHT

    def node_probs(self, tree: FlatTree, lookup: Collection[int] = frozenset(), cached: dict[int, int] | None = None,
                   *, sources: dict[int, Source] | None = None) -> list[float]:
        """Estimated acceptance probability of every node (root: 1). The chain nodes, by
        ``chain_sources``: ``lookup`` (prompt lookup's), ``cached`` (of those, the ones the n-gram
        cache proposed, with the length of the n-gram that proposed each) and ``sources`` (node
        -> (proposer name, calibration key))."""
        probs = [1.0] * tree.num_nodes
        for i, cell, prior_mean, prior_weight in self._calibration(tree, chain_sources(lookup, cached, sources)):
            probs[i] = min(probs[tree.parents[i]], cell.posterior(prior_mean, prior_weight))
        return probs

    def observe_round(self, tree: FlatTree, accepted_nodes: list[int], lookup: Collection[int] = frozenset(),
                      cached: dict[int, int] | None = None, *, sources: dict[int, Source] | None = None) -> None:
        """Learn from one verified tree: which nodes were on the accepted path (chain nodes as for
        ``node_probs``). Every node counts, also those under a rejected parent (a miss): a cell
        holds the probability that a node with that draft path probability (or chain position)
        ends on the accepted path, which is what ``choose`` and ``draft_spec`` sum and price.
        Counting only the nodes whose parent was accepted measured P(node | parent accepted)
        instead, and ``node_probs`` took it for the node's own: deep trees looked worth drafting
        and predictions ran high (docs/speculation.md)."""
        on_path = set(accepted_nodes)
        for i, cell, _, _ in self._calibration(tree, chain_sources(lookup, cached, sources), learn=True):
            cell.add(i in on_path)

    # ---- the choice ---------------------------------------------------------------------
    def choose(self, tree: FlatTree, sync_tokens: int, lookup: Collection[int] = frozenset(), *,
               plain: bool = False, cached: dict[int, int] | None = None,
               sources: dict[int, Source] | None = None, measure: bool = False) -> Choice:
        """The prefix-closed node set (grown most-likely-first from the root) with the most
        expected tokens per millisecond of round time, counting the whole verify forward: the
        tokens the rest of the batch brings and delivers (``load``) are in both sides of the
        ratio. Alone, at least ``min_nodes`` nodes (when the tree has them; in a plain round once
        in ``EXPLORE_EVERY`` such rounds). ``plain``: a round
        without a draft call (prompt-lookup nodes under a root), priced with a plain round's
        overhead. ``lookup``, ``cached``, ``sources``: the chain nodes, as for ``node_probs``.
        ``measure``: the drafted round that measures speculation for ``plain_pays`` keeps
        ``min_nodes`` even under load: a root-only choice measured a draft that delivers nothing
        (no node verified), and plain decoding then never drafted again while the load lasted."""
        probs = self.node_probs(tree, lookup, cached, sources=sources)
        children: list[list[int]] = [[] for _ in range(tree.num_nodes)]
        for i in range(1, tree.num_nodes):
            children[tree.parents[i]].append(i)
        overhead = (self.plain_overhead_ms if plain else self.overhead_ms) or 0.0
        others_tokens, others_expected = self.load()
        base = sync_tokens + others_tokens  # the forward's tokens besides this tree's
        floor = 0 if self.shared() and not measure else self.min_nodes
        if floor and plain and tree.num_nodes > 1:
            self._plain_chances += 1
            if (self._plain_chances - 1) % EXPLORE_EVERY:  # the first, the (1 + EXPLORE_EVERY)th, ...: forced
                floor = 0
        chosen, frontier = [0], list(children[0])
        expected = 1.0
        best = Choice([0], expected, overhead + self.verify_ms(base + 1))
        while frontier:
            nxt = max(frontier, key=lambda i: (probs[i], -i))
            frontier.remove(nxt)
            frontier.extend(children[nxt])
            chosen.append(nxt)
            expected += probs[nxt]
            ms = overhead + self.verify_ms(base + len(chosen))
            if (len(chosen) - 1 <= floor
                    or (expected + others_expected) * best.expected_ms > (best.expected_tokens + others_expected) * ms):
                best = Choice(sorted(chosen), expected, ms)
        return best


def chain_sources(lookup: Collection[int] = frozenset(), cached: dict[int, int] | None = None,
                  sources: dict[int, Source] | None = None) -> dict[int, Source]:
    """Every chain node's (proposer name, calibration key): a ``lookup`` node is prompt lookup's
    (LOOKUP, 0), or the n-gram cache's (NGRAMS, n) where ``cached`` gives it an n-gram length n > 0;
    ``sources`` adds (or overrides) nodes. lookup {3, 4}, cached {4: 2} -> {3: ("lookup", 0),
    4: ("ngrams", 2)}."""
    cached = cached or {}
    chain = {i: (NGRAMS, cached[i]) if cached.get(i, 0) > 0 else (LOOKUP, 0) for i in lookup}
    if sources:
        chain.update(sources)
    return chain


def _bin(path_prob: float) -> int:
    return min(BINS - 1, max(0, int(path_prob * BINS)))


def expanded_nodes(tree: FlatTree) -> int:
    """Nodes of ``tree`` the draft forwarded to give them children (its draft steps' work)."""
    return len(set(tree.parents[1:]))


def select_nodes(tree: FlatTree, nodes: list[int]) -> FlatTree:
    """The sub-tree of ``tree`` made of ``nodes`` (ascending, prefix-closed, root first)."""
    if len(nodes) == tree.num_nodes:
        return tree
    index = {old: new for new, old in enumerate(nodes)}
    return FlatTree(
        token_ids=[tree.token_ids[i] for i in nodes],
        parents=[-1] + [index[tree.parents[i]] for i in nodes[1:]],
        draft_logprobs=[tree.draft_logprobs[i] for i in nodes] if tree.draft_logprobs else [],
    )
