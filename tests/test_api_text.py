"""Incremental decoding and stop strings of the HTTP API (specsplit.api.textstream), against the
whole text decoded at once: a byte-level tokenizer (every id one UTF-8 byte, so characters split
across chunks) and the tiny preset's real tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsplit.api.textstream import (
    REPLACEMENT,
    ChoiceText,
    IncrementalDecoder,
    LineLimits,
    LineRules,
    StopMatcher,
)


def byte_decode(ids) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(points, points[1:])]


TEXT = st.text(alphabet=st.sampled_from(list("ab \n") + ["é", "€", "😀", "中"]), max_size=40)


def streamed(choice: ChoiceText, text: str, cuts: list[int], want: str) -> str:
    """``text``'s bytes pushed through ``choice`` in the pieces ``cuts`` makes, until it stops:
    what it emits, each prefix of it checked to be a prefix of ``want``."""
    out = ""
    for chunk in chunked(list(text.encode()), cuts):
        out += choice.push(chunk)
        assert want.startswith(out)
        if choice.stopped:
            break
    return out + choice.finish()


def reference(text: str, stops: list[str]) -> str:
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[:min(found)] if found else text


@settings(max_examples=300, deadline=None)
@given(text=TEXT, cuts=st.lists(st.integers(0, 200), max_size=12))
def test_deltas_concatenate_to_the_whole_decode_and_never_break_a_character(text, cuts):
    ids = list(text.encode())
    dec = IncrementalDecoder(byte_decode, context=list(b"prompt "))
    deltas = [dec.push(chunk) for chunk in chunked(ids, cuts)] + [dec.finish()]
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)


@settings(max_examples=400, deadline=None)
@given(text=TEXT, cuts=st.lists(st.integers(0, 200), max_size=12),
       stops=st.lists(st.text(alphabet=st.sampled_from(list("ab \n") + ["é", "😀"]), min_size=1, max_size=4),
                      max_size=3))
def test_stop_strings_cut_exactly_and_no_stop_character_is_ever_emitted(text, cuts, stops):
    want = reference(text, stops)
    choice = ChoiceText(byte_decode, [], stops)
    out = ""
    for chunk in chunked(list(text.encode()), cuts):
        out += choice.push(chunk)
        assert want.startswith(out)  # every prefix emitted is a prefix of the cut text
        if choice.stopped:
            break
    out += choice.finish()
    assert out == want
    assert choice.stopped == (want != text or any(s and s in text for s in stops))


@settings(max_examples=400, deadline=None)
@given(text=TEXT, cuts=st.lists(st.integers(0, 200), max_size=12),
       stops=st.lists(st.text(alphabet=st.sampled_from(list("ab \n") + ["é"]), min_size=1, max_size=3), max_size=3),
       min_tokens=st.integers(0, 30), each=st.booleans())
def test_with_min_tokens_a_stop_counts_only_where_it_ends_after_them(text, cuts, stops, min_tokens, each):
    """vLLM's rule: a stop string ending in the text of the first ``min_tokens`` ids does not
    cut; the first one ending after it does (``push`` and ``push_each`` alike)."""
    ids = list(text.encode())
    floor = len(bytes(ids[:min_tokens]).decode("utf-8", errors="ignore"))  # whole characters only
    found = [i for i in (text.find(s, max(0, floor - len(s) + 1)) for s in stops) if i >= 0]
    want = text[:min(found)] if found else text
    choice = ChoiceText(byte_decode, [], stops, min_tokens=min_tokens)
    out = ""
    for chunk in chunked(ids, cuts):
        out += choice.push_each(chunk)[0] if each else choice.push(chunk)
        assert want.startswith(out)
        if choice.stopped:
            break
    out += choice.finish()
    assert out == want


def test_stop_matcher_holds_a_possible_stop_start_then_releases_it():
    m = StopMatcher(["\n\n"])
    assert m.feed("a\n") == "a"
    assert m.feed("b") == "\nb"
    assert m.feed("\n\nc") == "" and m.stopped
    assert m.text == "a\nb"


def test_finish_flushes_a_held_tail_that_was_no_stop():
    choice = ChoiceText(byte_decode, [], ["END"])
    assert choice.push(list(b"the EN")) == "the "
    assert choice.finish() == "EN"


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from specsplit.api.tokenizer import ServedTokenizer

    out = subprocess.run([sys.executable, "-m", "specsplit", "models", "path", "tiny"], capture_output=True,
                         text=True, timeout=300, check=True)
    return ServedTokenizer(json.loads(out.stdout)["target"])


def test_real_tokenizer_streamed_equals_whole(tiny_tokenizer):
    tok = tiny_tokenizer
    text = "def f(x):\n    return x * 2  # ünïcödé ✓ 中文 😀\n"
    ids = tok.encode(text)
    whole = tok.decode(ids)
    for step in (1, 2, 3, 7):
        dec = IncrementalDecoder(tok.decode, context=tok.encode("Q: "))
        got = "".join(dec.push(ids[i:i + step]) for i in range(0, len(ids), step)) + dec.finish()
        assert got == whole


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=30)
       | st.text(alphabet=st.sampled_from(["a", "\n", "\r", "\x0b", "\x1c", "\x85", "\u2028", "\u2029", "é"]),
                 max_size=12))
def test_a_streamed_event_is_one_line_whatever_its_text(text):
    """A server-sent event's JSON keeps every line break of its text escaped, including the ones
    JSON leaves raw (U+0085, U+2028, U+2029) that str.splitlines() (httpx's iter_lines) ends a line
    at: a reader that splits lines gets the event whole, and the same text back."""
    from specsplit.api.streaming import sse

    event = sse({"choices": [{"text": text}]}).decode()
    lines = event.splitlines()
    assert event.endswith("\n\n") and len(lines) == 2 and lines[1] == "" and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):]) == {"choices": [{"text": text}]}


@settings(max_examples=400, deadline=None)
@given(text=TEXT, cuts=st.lists(st.integers(0, 200), max_size=12),
       stops=st.lists(st.text(alphabet=st.sampled_from([*"ab \n", "é", "😀"]), min_size=1, max_size=4), max_size=3))
def test_with_include_stop_the_text_ends_after_the_stop_string(text, cuts, stops):
    """vLLM's ``include_stop_str_in_output``: the text through the end of the stop string that
    is complete first, whatever pieces the text streams in."""
    found = [text.find(s) + len(s) for s in stops if s in text]
    want = text[:min(found)] if found else text
    choice = ChoiceText(byte_decode, [], stops, include_stop=True)
    assert streamed(choice, text, cuts, want) == want and choice.stopped == bool(found)


# ---- llama-server's line limits (n_indent, t_max_predict_ms) -----------------------------------------
def indent_reference(text: str, n: int) -> str:
    """Where ``n_indent`` ends ``text``: at the first character (a newline too) after the
    leading spaces and tabs of a line after the first, when there are fewer than n of them."""
    lines = text.split("\n")
    at = len(lines[0]) + 1
    for k, line in enumerate(lines[1:], 1):
        ws = len(line) - len(line.lstrip(" \t"))
        ends = k < len(lines) - 1  # a newline follows: a blank or short-indented line is complete
        if ws < n and (ws < len(line) or ends):
            return text[:at + ws]
        at += len(line) + 1
    return text


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet=st.sampled_from([*"ab \n\t", "é", "😀"]), max_size=40),
       cuts=st.lists(st.integers(0, 200), max_size=12), n=st.integers(1, 3),
       stops=st.lists(st.text(alphabet=st.sampled_from([*"ab \n"]), min_size=1, max_size=3), max_size=2),
       include=st.booleans())
def test_n_indent_ends_the_text_where_a_line_is_indented_less(text, cuts, n, stops, include):
    """The text is cut where a line after the first is indented by fewer than ``n`` spaces or
    tabs (a stop string complete before that still cuts first), whatever pieces it streams in."""
    kept = indent_reference(text, n)
    found = [(kept.find(s), kept.find(s) + len(s)) for s in stops if s in kept]  # (start, end)
    want = kept[:min(e if include else b for b, e in found)] if found else kept
    choice = ChoiceText(byte_decode, [], stops, include_stop=include, lines=LineLimits(n_indent=n))
    assert streamed(choice, text, cuts, want) == want
    assert choice.matcher.limited == (kept != text and not found)


def test_n_indent_keeps_the_first_line_and_the_indentation_of_the_line_it_cuts():
    for text, n, want in [("x = 1\n    y = 2\n    z = 3\nw = 4\n", 4, "x = 1\n    y = 2\n    z = 3\n"),
                          ("if a:\n        b\n    c\n", 8, "if a:\n        b\n    "),
                          ("a\n\n    b", 4, "a\n"),  # a blank line ends it (llama-server's)
                          ("a\n\t\tb\n", 2, "a\n\t\tb\n")]:
        matcher = StopMatcher([], rules=LineRules(LineLimits(n_indent=n)))
        assert matcher.feed(text) + matcher.flush() == want and matcher.limited == (want != text)


def test_past_max_predict_the_text_ends_after_the_next_newline():
    now = [0.0]
    matcher = StopMatcher([], rules=LineRules(LineLimits(max_predict_s=1.0), clock=lambda: now[0]))
    assert matcher.feed("a\nb") == "a\nb"  # within the time: a newline goes by
    now[0] = 0.5
    assert matcher.feed("c\nd") == "c\nd"
    now[0] = 1.5
    assert matcher.feed("ef") == "ef" and not matcher.stopped  # late, but no newline yet
    assert matcher.feed("g\nh\ni") == "g\n" and matcher.stopped and matcher.limited
    assert matcher.text == "a\nbc\ndefg\n"
