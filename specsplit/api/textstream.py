"""Token ids -> text, incrementally, with stop strings: what one choice of a response emits.

``IncrementalDecoder`` turns the token ids of a generation, fed in chunks of any size, into text
deltas that concatenate to exactly the text the whole sequence decodes to. It decodes a short
window (a few ids already shown plus the new ones) and holds back text that ends in U+FFFD, so a
character whose UTF-8 bytes are split over tokens, or over rounds, is never emitted broken.
``finish`` flushes whatever was held.

``StopMatcher`` cuts the text where the first occurrence of any stop string begins (the earliest
start in the whole text, however it was chunked) and never emits a stop string, not even its
first characters: it holds back the longest tail of the text that is a prefix of some stop
string until the next delta settles it. Worked example, stop ``"\\n\\n"``:
feeding ``"a\\n"`` emits ``"a"`` (the ``"\\n"`` might start a stop), then ``"b"`` emits ``"\\nb"``,
then ``"\\n\\nc"`` emits nothing more and reports the stop. With ``min_tokens`` (vLLM's), a
stop string counts only where it ends in the text of the tokens after the first ``min_tokens``
(``StopMatcher.floor``). ``LineRules`` end the text by its lines (llama-server's ``n_indent`` and
``t_max_predict_ms``, for code completion).

Both are plain objects over a tokenizer's ``decode``; the non-streamed answer goes through the
same path, so streamed and non-streamed text are equal by construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"
PREFIX_TOKENS = 6  # ids of context decoded before the new ones (BPE merges, leading spaces)


class IncrementalDecoder:
    """Text deltas of a growing id sequence (after ``context`` ids, e.g. the prompt's)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context: Sequence[int] = ()) -> None:
        self._decode = decode
        self.ids: list[int] = list(context[-PREFIX_TOKENS:])
        self._prefix = 0  # ids[_prefix:_read] decode to text already accounted for
        self._read = len(self.ids)

    def push(self, ids: Sequence[int]) -> str:
        """The new text that ``ids`` complete ("" while a character is still incomplete)."""
        self.ids.extend(ids)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT):
            return ""
        # the ids just shown become the next decode's context (a window of one chunk or so)
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(prefix_text):]

    def held(self) -> int:
        """Characters of whole text the ids pushed so far make beyond what ``push`` returned
        (held behind an incomplete character)."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:]).rstrip(REPLACEMENT)
        return max(0, len(text) - len(prefix_text))

    def finish(self) -> str:
        """Whatever text was held back (a final incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(prefix_text):] if len(text) > len(prefix_text) else ""


@dataclass(frozen=True)
class LineLimits:
    """llama-server's limits for code completion, on the answer's lines after its first:
    ``n_indent``: a line indented by fewer spaces or tabs ends the answer where its text (or its
    end, a blank line) begins; ``max_predict_s``: past this many seconds since the first text,
    the answer ends after the next newline. 0: off."""

    n_indent: int = 0
    max_predict_s: float = 0.0

    def __bool__(self) -> bool:
        return self.n_indent > 0 or self.max_predict_s > 0


class LineRules:
    """``LineLimits`` over a growing text: ``cut`` says where the text ends, if it must."""

    def __init__(self, limits: LineLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self.started: float | None = None
        self._scan = 0  # text before this has been judged
        self._line: int | None = None  # where the line being judged begins; None: not in one

    def cut(self, text: str, new_from: int) -> int | None:
        """Where ``text`` (of which ``text[new_from:]`` is new) must end; None: it goes on."""
        now = self.clock()
        if self.started is None:
            self.started = now
        out = self._indent(text) if self.limits.n_indent else None
        if self.limits.max_predict_s and now - self.started > self.limits.max_predict_s:
            nl = text.find("\n", new_from)
            if nl >= 0 and (out is None or nl + 1 < out):
                out = nl + 1
        return out

    def _indent(self, text: str) -> int | None:
        i = self._scan
        while i < len(text):
            if self._line is None:  # find the next line's start
                nl = text.find("\n", i)
                if nl < 0:
                    i = len(text)
                    break
                self._line = i = nl + 1
            elif text[i] in " \t":
                i += 1
            elif i - self._line < self.limits.n_indent:
                self._scan = i
                return i
            else:  # indented enough: the line passes (a newline here begins the next one)
                self._line = None
        self._scan = i
        return None


class StopMatcher:
    """Cuts a stream of text deltas at the first stop string (see the module docstring), or
    where ``rules`` end it (``limited``)."""

    def __init__(self, stops: Sequence[str], include: bool = False, rules: LineRules | None = None) -> None:
        self.stops = [s for s in stops if s]
        self.include = include  # the text ends after the stop string, not before it (vLLM's option)
        self.rules = rules
        self.text = ""  # everything fed so far, cut at the stop once one is found
        self.emitted = 0  # characters of text already returned
        self.stopped = False
        self.word: str | None = None  # the stop string that ended the text
        self.limited = False  # the rules ended it
        # a stop string counts where it ends past this many characters; None: none counts yet
        self.floor: int | None = 0

    def feed(self, delta: str) -> str:
        """The part of the text that is now safe to emit."""
        if self.stopped:
            return ""
        start = len(self.text)
        self.text += delta
        end = self.rules.cut(self.text, start) if self.rules is not None and delta else None
        if end is not None:  # the text ends there (>= start), unless a stop string ends within it
            self.text = self.text[:end]
            cut = self._first_stop(self.emitted)
            if cut is not None:
                return self._stop(cut)
            self.stopped = self.limited = True
            return self._emit(end)
        cut = self._first_stop(self.emitted)
        held = len(self.text) - self._held_tail()  # where a stop still being completed may begin
        if cut is not None and (cut[0] <= held or self.include):  # (with include: none can end earlier)
            return self._stop(cut)
        return self._emit(held if cut is None else min(cut[0], held))

    def flush(self) -> str:
        """At the end of the generation: a stop found while a longer one might still have begun
        earlier cuts now; a held tail that began no stop is emitted."""
        if self.stopped:
            return ""
        cut = self._first_stop(self.emitted)
        return self._emit(len(self.text)) if cut is None else self._stop(cut)

    def _stop(self, cut: tuple[int, int]) -> str:
        """Stop at the stop string found at ``cut`` (start, end): the text ends at its start, or
        at its end with ``include``."""
        self.stopped = True
        self.word = self.text[cut[0]:cut[1]]
        end = cut[1] if self.include else cut[0]
        self.text = self.text[:end]
        return self._emit(end)

    def _emit(self, upto: int) -> str:
        out = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return out

    def _first_stop(self, start: int) -> tuple[int, int] | None:
        """(start, end) of the stop string that ends the text, counting only those that end past
        the floor; None: none yet. Cut before it: the one that begins first. Kept (``include``):
        the one that is complete first, as the text streams (of those ending together, the
        longest), whatever pieces the text comes in."""
        if self.floor is None:
            return None
        found = []
        for s in self.stops:
            i = self.text.find(s, max(start, self.floor - len(s) + 1))  # the first that ends past the floor
            if i >= 0:
                found.append((i + len(s), i) if self.include else (i, i + len(s)))
        if not found:
            return None
        a, b = min(found)
        return (b, a) if self.include else (a, b)

    def _held_tail(self) -> int:
        """Length of the longest tail of text (not yet emitted) that begins some stop string."""
        best = 0
        pending = len(self.text) - self.emitted
        for s in self.stops:
            for k in range(min(len(s) - 1, pending), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best


class ChoiceText:
    """One choice's text: ids in, safe text deltas out, the stop string cut (one that ends in
    the text of the first ``min_tokens`` ids does not count)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context: Sequence[int], stops: Sequence[str],
                 min_tokens: int = 0, include_stop: bool = False, lines: LineLimits | None = None) -> None:
        self.decoder = IncrementalDecoder(decode, context)
        self.matcher = StopMatcher(stops, include_stop, LineRules(lines) if lines else None)
        self.min_tokens, self.tokens = min_tokens, 0
        if min_tokens > 0:
            self.matcher.floor = None

    def _split(self, ids: Sequence[int]) -> int:
        """How many of ``ids`` come before stop strings start to count (all: none)."""
        if self.matcher.floor is not None:
            return 0
        return min(len(ids), self.min_tokens - self.tokens)

    def _floor_after(self, k: int, held: bool = True) -> None:
        """``k`` more ids pushed: the floor is set once the first ``min_tokens`` are in (their
        text: what the matcher was fed, and the whole characters the decoder holds, ``held``,
        where it has decoded no further ids)."""
        self.tokens += k
        if self.matcher.floor is None and self.tokens >= self.min_tokens:
            self.matcher.floor = len(self.matcher.text) + (self.decoder.held() if held else 0)

    @property
    def stopped(self) -> bool:
        """A stop string was found: the generation should end now."""
        return self.matcher.stopped

    def push(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        k = self._split(ids)
        out = self.matcher.feed(self.decoder.push(ids[:k])) if k else ""
        self._floor_after(k)
        if k < len(ids):
            out += self.matcher.feed(self.decoder.push(ids[k:]))
            self._floor_after(len(ids) - k)
        return out

    def push_each(self, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
        """``push``, one id at a time: also where each id's text lies in the text fed so far
        ((start, end); a character split over ids belongs to the id that completes it)."""
        if self.stopped:
            return "", [(len(self.matcher.text), len(self.matcher.text))] * len(ids)
        at, pieces, spans = len(self.matcher.text), [], []
        for t in ids:
            piece = self.decoder.push([t])
            spans.append((at, at + len(piece)))
            pieces.append(piece)
            at += len(piece)
        k = self._split(ids)
        out = self.matcher.feed("".join(pieces[:k])) if k else ""
        self._floor_after(k, held=False)  # (a character is the text of the id that completes it)
        if k < len(ids):
            out += self.matcher.feed("".join(pieces[k:]))
            self._floor_after(len(ids) - k, held=False)
        return out, spans

    @property
    def emitted(self) -> int:
        """Characters of text returned so far."""
        return self.matcher.emitted

    @property
    def length(self) -> int:
        """Characters of the text so far (cut at a stop string once one is found)."""
        return len(self.matcher.text)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self.matcher.feed(self.decoder.finish()) + self.matcher.flush()
