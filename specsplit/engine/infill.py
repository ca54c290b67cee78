"""llama.cpp's ``infill`` sampler, the one editors' completion plugins ask for (llama.vim,
llama.vscode: ``samplers: ["top_k", "top_p", "infill"]``), as a choice of tokens per row.

It runs on a row's candidates (after top-k / top-p / min-p), their probabilities renormalized
over them, most probable first:
1. if the ends of generation hold enough of the mass (3 x p(EOG) x candidates > p(text)), only
   they stay;
2. otherwise a candidate whose text begins another's merges with it: the less probable of the
   two gives its probability to the other and leaves (in llama.cpp's loop order);
3. the text tokens under 0.2 leave (none left: the row is its EOT alone), then, renormalized,
   those under 1 / (text tokens + 1).

The draw then comes from the survivors' own logits (llama.cpp's ``dist`` recomputes the softmax),
so the sampler is a choice of tokens, as top-p is: ``InfillVocab.keep`` returns it, and the
engines' ``sampling.apply_infill`` masks the rest. Pieces are llama.cpp's
``token_to_piece(special=false)`` (``specsplit.vocab.llama_pieces``), compared as bytes.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np

from specsplit.vocab import end_ids, llama_eog_ids, llama_eot_id, llama_pieces

THOLD = 0.2  # llama.cpp's first cut of text tokens


class InfillVocab:
    """One vocabulary's pieces and ends of generation, for ``keep``."""

    def __init__(self, pieces: list[bytes], eog: set[int], eot: int) -> None:
        self.pieces, self.eog, self.eot = pieces, frozenset(eog), int(eot)

    @classmethod
    def for_tokenizer(cls, tok, model_dir: str | Path | None, size: int) -> InfillVocab:
        """The tables of ``tok`` for ids 0..size-1 (the model's output rows)."""
        ends = end_ids(tok, model_dir)
        eog = llama_eog_ids(tok, ends)
        return cls(llama_pieces(tok, eog, size), eog, llama_eot_id(tok, ends))

    def keep(self, ids: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of candidates: ``ids`` [N, M] and their probabilities [N, M] (renormalized over a
        row's candidates; 0: not a candidate) -> (the candidates the sampler keeps [N, M] bool,
        the rows it reduced to its EOT alone [N] bool)."""
        keep = np.zeros(ids.shape, dtype=bool)
        forced = np.zeros(ids.shape[0], dtype=bool)
        for r in range(ids.shape[0]):
            cols = np.flatnonzero(probs[r] > 0)
            cols = cols[np.argsort(-probs[r, cols], kind="stable")]  # most probable first
            kept = self._row([int(t) for t in ids[r, cols]], [float(p) for p in probs[r, cols]])
            if kept is None:
                forced[r] = True
            else:
                keep[r, cols[kept]] = True
        return keep, forced

    def _row(self, ids: list[int], p: list[float]) -> list[int] | None:
        """The sampler on one row (most probable first): the positions kept, None for its EOT."""
        n = len(ids)
        eog = [t in self.eog for t in ids]
        p_eog = sum(x for x, e in zip(p, eog, strict=True) if e)
        p_txt = sum(x for x, e in zip(p, eog, strict=True) if not e)
        if 3 * p_eog * n > p_txt:
            return [i for i in range(n) if eog[i]]
        pieces = [self.pieces[t] if 0 <= t < len(self.pieces) else b"" for t in ids]
        srt = sorted(range(n), key=pieces.__getitem__)
        keys = [pieces[i] for i in srt]  # the pieces a piece begins follow it in this order
        p, gone = list(p), [False] * n
        for a in range(n):
            pa = pieces[a]
            if not pa:
                continue
            j, begun = bisect.bisect_left(keys, pa), []
            while j < n and keys[j].startswith(pa):
                begun.append(srt[j])
                j += 1
            for b in sorted(begun):  # llama.cpp's inner loop, over the pairs that merge
                if gone[a]:
                    break
                if b == a or gone[b]:
                    continue
                dst, src = (b, a) if p[b] > p[a] else (a, b)  # into the more probable one
                p[dst] += p[src]
                p[src], gone[src] = 0.0, True
        first = [i for i in range(n) if p[i] >= THOLD or eog[i]]
        texts = sum(1 for i in first if not eog[i])
        if texts == 0:
            return None
        total = sum(p[i] for i in first)
        cut = 1.0 / (texts + 1)
        # a token merged into another keeps a -inf logit in llama.cpp: never drawn
        return [i for i in first if (p[i] / total >= cut or eog[i]) and not gone[i]]
