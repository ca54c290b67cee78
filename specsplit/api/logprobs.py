"""The output's log-probabilities on the HTTP API (``logprobs``): each token's, as the target
reported it (``schemas.Logprobs``: its raw distribution, vLLM's default), released with the text
the token makes, in OpenAI's shapes.

``LogprobTrail`` pairs each chunk's log-probabilities with its tokens and the text they decode
to (``textstream.ChoiceText.push_each``), and releases a token's once its text is out: text held
back (a character split over tokens, a possible stop string) holds its tokens' too. A stop
string keeps the tokens whose text begins before it; a chat's end tokens (which show no text)
are left out, as OpenAI leaves them, and a completion lists them, as vLLM does (so ``echo`` with
``max_tokens: 1`` lists exactly one token after the prompt's, whatever it is: what lm-eval's
loglikelihood reads). So the tokens listed are those of the text returned, streamed or not. With
``echo``, the prompt's tokens come first (``prompt_entries``). No torch, no sockets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from schemas import Logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: a prompt's first token (``echo``), which nothing precedes
    top: tuple[tuple[int, float], ...] | None  # the most likely tokens there, most likely first
    offset: int  # where the token's text begins in the choice's text


class LogprobTrail:
    """One choice's log-probabilities: ``add`` each chunk's before its tokens, ``tokens`` with the
    text each token made, ``release`` what the text emitted so far covers, ``finish`` the rest."""

    def __init__(self, skip: frozenset[int] | set[int] | tuple[int, ...]) -> None:
        self.skip = frozenset(skip)  # tokens not listed (a chat's end tokens: no text)
        self._queued: list[Logprobs] = []
        self._pending: list[tuple[int, TokenLogprob]] = []  # (where its text ends, it)
        self._ended = False  # ``finish`` ran: tokens after it (past a stop string) are not listed

    def add(self, part: Logprobs) -> None:
        self._queued.append(part)

    def tokens(self, ids: list[int], spans: list[tuple[int, int]]) -> None:
        """``ids`` arrived, token i's text at ``spans[i]`` (start, end) of the choice's text."""
        part = self._queued.pop(0) if self._queued else None
        if part is None or len(part) != len(ids):  # none reported for them (cannot happen): not listed
            return
        for i, t in enumerate(ids):
            if t not in self.skip and not self._ended:
                entry = TokenLogprob(t, part.token[i], tuple(zip(part.top_ids[i], part.top[i])), spans[i][0])
                self._pending.append((spans[i][1], entry))

    def release(self, emitted: int) -> list[TokenLogprob]:
        """The tokens whose text lies within the first ``emitted`` characters."""
        k = 0
        while k < len(self._pending) and self._pending[k][0] <= emitted:
            k += 1
        out, self._pending = [e for _, e in self._pending[:k]], self._pending[k:]
        return out

    def finish(self, text_len: int) -> list[TokenLogprob]:
        """At the end: the tokens whose text begins within the final text (``text_len``
        characters, cut at a stop string), the last of them perhaps only in part."""
        out = [e for end, e in self._pending if e.offset < text_len or end <= text_len]
        self._pending, self._ended = [], True
        return out


Piece = Callable[[int], tuple[str, bytes]]  # a token's text and bytes (ServedTokenizer.token_piece)


def chat_logprobs(entries: list[TokenLogprob], piece: Piece) -> dict:
    """OpenAI's ``choices[].logprobs`` of a chat completion (or of one chunk)."""

    def one(token_id: int, logprob: float) -> dict:
        text, raw = piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def prompt_entries(ids: list[int], rows: Logprobs, spans: list[tuple[int, int]]) -> tuple[TokenLogprob, ...]:
    """A prompt's tokens as ``echo`` lists them before the answer's: the first without a
    log-probability (nothing precedes it), each other with the target's (``rows``: of ids[1:]),
    at where its text begins (``spans``: ``ChoiceText.push_each`` over the prompt)."""
    if len(rows) != len(ids) - 1 or len(spans) != len(ids):
        raise ValueError(f"{len(rows)} log-probabilities and {len(spans)} spans for a prompt of {len(ids)} tokens")
    first = TokenLogprob(ids[0], None, None, spans[0][0])
    return (first, *(TokenLogprob(t, rows.token[i], tuple(zip(rows.top_ids[i], rows.top[i])), spans[i + 1][0])
                     for i, t in enumerate(ids[1:])))


def completion_logprobs(entries: list[TokenLogprob], piece: Piece) -> dict:
    """OpenAI's ``choices[].logprobs`` of a (legacy) completion: each position's top tokens as a
    map that also holds the chosen one (null for an echoed prompt's first token)."""
    tops: list[dict | None] = []
    for e in entries:
        if e.top is None:
            tops.append(None)
            continue
        top = {piece(t)[0]: lp for t, lp in e.top}
        top.setdefault(piece(e.token_id)[0], e.logprob)
        tops.append(top)
    return {"tokens": [piece(e.token_id)[0] for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": [e.offset for e in entries]}
