"""Candidates at no model cost from what earlier sessions generated (torch-free).

Prompt lookup (``specsplit.tree.lookup_continuation``) only finds continuations in a session's
own context, and a session's answer rarely repeats itself before it is half written. Answers repeat
each other instead (the code fence a reply opens with, ``return``, the idioms of the language, the
model's own stock phrases), as llama.cpp's lookup decoding exploits with its dynamic n-gram cache.
``NgramCache`` is that cache for an orchestrator: every finished session's generated tokens (led
in by the last prompt tokens) are counted as n-grams of ``min_ngram``..``max_ngram`` tokens with
the token that followed them, and a round whose context has no prompt-lookup candidate gets the most
frequent continuation of its longest known suffix, token by token, while that continuation was
seen at least ``min_count`` times and in at least ``min_share`` of that suffix's occurrences.

Replayed on the target's answers to HumanEval prompts, the cache finds candidates at many more
positions than prompt lookup alone, a longer key's candidates are accepted more often, and keys
of one token lose more on poor guesses than they gain; the gain is larger where a multi-token
verify costs what one does (a GPU). Figures: docs/results.md, commits 46c49fc (the replay) and
807be65 (the llama.cpp lookup fleet). The acceptance of each node is calibrated by the length of
the key that proposed it (``CostModel``).

The cache is bounded (``max_keys`` n-grams, the least recently written dropped first; at most
``max_next`` continuations per n-gram) and only proposes: greedy output is the target's whatever
it holds. It is shared by the orchestrator's sessions, so a session's speed can reveal whether
others generated the same text (a timing channel, as with any cross-request cache such as prefix
caching); ``SPECSPLIT_LOOKUP_CACHE_KEYS=0`` turns it off where clients must not learn that.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

_TOTAL = -1  # a key's total count lives beside its continuations (token ids are >= 0)


class NgramCache:
    def __init__(self, max_keys: int, *, min_ngram: int = 2, max_ngram: int = 4, min_count: int = 2,
                 min_share: float = 0.5, max_next: int = 4) -> None:
        if (max_keys < 1 or not 1 <= min_ngram <= max_ngram or min_count < 1 or not 0.0 < min_share <= 1.0
                or max_next < 1):
            raise ValueError("NgramCache needs max_keys, min_count, max_next >= 1, 1 <= min_ngram <= max_ngram "
                             "and 0 < min_share <= 1")
        self.max_keys, self.min_ngram, self.max_ngram = max_keys, min_ngram, max_ngram
        self.min_count, self.min_share, self.max_next = min_count, min_share, max_next
        self._table: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def add(self, tokens: Sequence[int]) -> None:
        """Count every n-gram of ``tokens`` (min_ngram..max_ngram long) with the token after it."""
        table = self._table
        toks = list(tokens)
        for i in range(1, len(toks)):
            nxt = toks[i]
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                key = tuple(toks[i - n:i])
                counts = table.get(key)
                if counts is None:
                    counts = table[key] = {_TOTAL: 0}
                    if len(table) > self.max_keys:
                        table.popitem(last=False)
                else:
                    table.move_to_end(key)
                counts[_TOTAL] += 1
                counts[nxt] = counts.get(nxt, 0) + 1
                if len(counts) > self.max_next + 1:  # keep the most frequent; the total stays whole
                    del counts[min((t for t in counts if t != _TOTAL), key=counts.__getitem__)]

    def continuation(self, context: Sequence[int], *, max_tokens: int) -> tuple[list[int], list[int]]:
        """Up to ``max_tokens`` tokens predicted after ``context``, each the most frequent
        continuation of the longest suffix (context plus the tokens predicted so far) that has a
        confident one; and, per token, the length of that suffix (the cost model calibrates the
        acceptance by it). ([], []) when nothing qualifies."""
        ctx = list(context[-self.max_ngram:])
        out: list[int] = []
        lengths: list[int] = []
        while len(out) < max_tokens:
            pick = None
            for n in range(min(self.max_ngram, len(ctx)), self.min_ngram - 1, -1):
                counts = self._table.get(tuple(ctx[len(ctx) - n:]))
                if counts is None:
                    continue
                tok, seen = max(((t, c) for t, c in counts.items() if t != _TOTAL), key=lambda tc: (tc[1], -tc[0]))
                if seen >= self.min_count and seen >= self.min_share * counts[_TOTAL]:
                    pick = tok, n
                    break
            if pick is None:
                break
            out.append(pick[0])
            lengths.append(pick[1])
            ctx.append(pick[0])
        return out, lengths
