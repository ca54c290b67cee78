"""Constrained decoding on the target: a session's output held to a grammar (a JSON schema).

The target's distribution at a tree node becomes its distribution masked to the tokens the
grammar allows after the node's path (the committed output, then the path's tokens), then
renormalized: what plain decoding under the same grammar samples from, greedy or not. The
verification rules are unchanged: they get the masked logits (``constrain``), so greedy output
equals masked greedy decoding and sampling stays lossless against the masked distribution. A
draft given a GrammarBook (SPECSPLIT_DRAFT_GRAMMAR) masks its own rows the same way
(``DraftGrammar``: a matcher of its own per session), so it proposes only what the grammar
allows; a draft without one proposes unconstrained, and a proposal the grammar forbids is simply
rejected.

Grammars are llguidance's (https://github.com/guidance-ai/llguidance, the engine vLLM and
llama.cpp use for structured output): compiled per request text (an LRU of compiled grammars),
one matcher per session on the session object (bounded as sessions are). A matcher holds the
session's generated tokens; a request that does not continue them (a resend from an empty cache,
a retried round, a cache copied from the prefix cache) rebuilds it from the request's tokens and
the session's (``Session.tokens``), and one it cannot rebuild (its cache holds output no one
names) is a CACHE_MISS, which makes the client resend the whole context.

Masks are computed on the host (~20-70 us each) for every tree node the grammar allows
(depth-first, consuming and rolling back the path's tokens), then copied to the device at once.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import torch

from schemas import ErrorCode, GrammarSpec
from schemas.messages import MAX_FORCED_TOKENS
from specsplit.errors import SpecError
from specsplit.grammar_text import llguidance_grammar
from specsplit.vocab import end_ids

MAX_COMPILED = 64  # compiled grammars kept (by the text's hash)


@dataclass
class SessionGrammar:
    """A session's matcher: it has consumed ``generated`` (the committed tokens from
    ``prompt_len`` on) and is in the state after the last of them."""

    key: str
    prompt_len: int
    matcher: object
    generated: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        """The committed length the matcher covers."""
        return self.prompt_len + len(self.generated)


class GrammarBook:
    """Compiles grammars for one tokenizer and keeps each session's matcher in step."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        self._hf, self.vocab_size, self.eos_ids = hf_tokenizer, vocab_size, sorted(set(eos_ids))
        self._lltok = None
        self._compiled: OrderedDict[str, str] = OrderedDict()

    @classmethod
    def for_model(cls, hf_tokenizer, model_dir: str | Path, vocab_size: int) -> GrammarBook:
        """End ids: the tokenizer's eos and the generation config's (as the API stops at)."""
        return cls(hf_tokenizer, vocab_size, sorted(end_ids(hf_tokenizer, model_dir)))

    # ---- grammars ------------------------------------------------------------------------
    def _tokenizer(self):
        if self._lltok is None:  # ~2 s for a 150K vocabulary: once, at the first grammar
            import llguidance.hf

            try:
                self._lltok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self.eos_ids)
            except Exception as exc:  # noqa: BLE001  (a tokenizer llguidance cannot read: no grammars here)
                raise SpecError(ErrorCode.BAD_REQUEST, f"this target cannot apply grammars with its tokenizer: "
                                                       f"{type(exc).__name__}: {str(exc)[:200]}") from None
        return self._lltok

    def compile(self, spec: GrammarSpec) -> str:
        """The spec's llguidance grammar; BAD_REQUEST when it is not one."""
        key = hashlib.sha256(f"{spec.kind}\0{spec.text}".encode()).hexdigest()
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return key
        grammar = to_grammar(spec)
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar, self._tokenizer())
        if error and not error.startswith("WARNING"):
            raise SpecError(ErrorCode.BAD_REQUEST, f"the grammar is not valid: {error[:300]}")
        self._compiled[key] = grammar
        while len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return key

    def _matcher(self, key: str):
        from llguidance import LLMatcher

        m = LLMatcher(self._tokenizer(), self._compiled[key], log_level=0)
        if m.is_error():
            raise SpecError(ErrorCode.BAD_REQUEST, f"the grammar is not valid: {m.get_error()[:300]}")
        return m

    # ---- a session's state ----------------------------------------------------------------
    def at_root(self, session, req) -> SessionGrammar:
        """The session's matcher in the state after the verify request's root (every committed
        token from the prompt's end on consumed), rebuilt from the request where it must be."""
        return self.at(session, req.grammar, req.sync, req.tree.token_ids[0])

    def at(self, session, spec: GrammarSpec, sync, root: int) -> SessionGrammar:
        """The session's matcher for ``spec`` after ``sync``'s tokens and ``root``."""
        key = self.compile(spec)
        if sync.prompt_len < 1:
            raise SpecError(ErrorCode.BAD_REQUEST, "a grammar needs the sync's prompt_len")
        st: SessionGrammar | None = getattr(session, "grammar", None)
        root_at = sync.base_len + len(sync.append_token_ids)
        if st is None or st.key != key or st.prompt_len != sync.prompt_len or st.end < sync.base_len:
            st = session.grammar = SessionGrammar(key, sync.prompt_len, self._matcher(key))
            if sync.base_len > sync.prompt_len:  # output in the cache: named by the session's tokens
                held = session.tokens[st.prompt_len:sync.base_len] if len(session.tokens) >= sync.base_len else None
                if held is None or not st.matcher.consume_tokens(held):
                    session.grammar = None
                    raise SpecError(ErrorCode.CACHE_MISS, "no grammar state for the cached tokens: resend them")
                st.generated.extend(held)
        keep = max(0, sync.base_len - st.prompt_len)  # generated tokens the cache holds
        if len(st.generated) > keep:  # a retried round, or a cut: back to the cache's end
            rollback(session, st.matcher, len(st.generated) - keep)
            del st.generated[keep:]
        committed = [*sync.append_token_ids, root]  # positions base_len .. root_at
        new = committed[max(0, st.prompt_len - sync.base_len):] if root_at >= st.prompt_len else []
        if new and not st.matcher.consume_tokens(new):
            session.grammar = None
            raise SpecError(ErrorCode.BAD_REQUEST, f"committed tokens the grammar does not allow: "
                                                   f"{st.matcher.get_error()[:200]}")
        st.generated.extend(new)
        return st

    def accepted(self, session, req, path: list[int]) -> None:
        """The round's accepted nodes after the root are committed: the matcher consumes them."""
        st: SessionGrammar | None = getattr(session, "grammar", None)
        tokens = [req.tree.token_ids[i] for i in path[1:]]
        if st is not None and tokens:
            if st.matcher.consume_tokens(tokens):
                st.generated.extend(tokens)
            else:  # cannot happen for tokens chosen under the masks; the next request rebuilds it
                session.grammar = None

    def forced_after(self, session, bonus: int) -> tuple[int, ...]:
        """The tokens the grammar forces after the committed path and ``bonus`` (llguidance's
        fast-forward tokens; at most MAX_FORCED_TOKENS), for the orchestrator to propose: the
        matcher is left as it was."""
        st: SessionGrammar | None = getattr(session, "grammar", None)
        if bonus in self.eos_ids:  # the output ends: nothing to force (and no end stepped over, as in ``constrain``)
            return ()
        if st is None or not st.matcher.consume_token(bonus):
            if st is not None and st.matcher.is_error():  # a bonus the grammar forbids: cannot happen
                session.grammar = None
            return ()
        forced = tuple(st.matcher.compute_ff_tokens()[:MAX_FORCED_TOKENS])
        rollback(session, st.matcher, 1)
        return forced

    # ---- masks ----------------------------------------------------------------------------
    def constrain(self, session, req, layout, logits: torch.Tensor) -> torch.Tensor:
        """The tree's logits [N, V] with every token the grammar forbids after each node's path
        set to -inf. A node the grammar cannot reach (its token forbidden at its parent) is left
        as it is: no rule accepts it, so its row is never read."""
        st = self.at_root(session, req)
        n = logits.shape[0]
        bits = self.new_bits(n)  # host; all allowed until computed
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            children[layout.parents[i]].append(i)
        tokens, m, ends = req.tree.token_ids, st.matcher, frozenset(self.eos_ids)

        def visit(node: int) -> None:
            row = bits[node]
            fill_row(row, m.compute_bitmask())
            if m.is_error():  # (its mask allows nothing: the row would go unmasked)
                raise failed(session, m)
            for c in children[node]:
                t = tokens[c]
                # an end token ends the output: its row and subtree are never read, and the
                # matcher is never stepped past one (llguidance's rollback of an end leaves a
                # state that refuses the next end: tests/test_grammar.py)
                if t not in ends and row[t >> 3] >> (t & 7) & 1:
                    if not m.consume_token(t):  # allowed by the mask: only a resource limit refuses it
                        raise failed(session, m)
                    visit(c)
                    rollback(session, m, 1)

        visit(0)
        return apply_bits(bits, logits)

    def new_bits(self, n: int) -> torch.Tensor:
        """[n, words] of host bitmask rows, every token allowed until a row is computed."""
        return torch.full((n, (self.vocab_size + 31) // 32 * 4), 255, dtype=torch.uint8)


def fill_row(row: torch.Tensor, mask: bytes) -> None:
    """A bitmask row from the matcher's mask; left all-allowed when it allows nothing (past an
    end token, where the row is never read)."""
    if mask.count(0) < len(mask):
        row.copy_(torch.frombuffer(bytearray(mask), dtype=torch.uint8)[:row.numel()])


def apply_bits(bits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, V] with each token whose bit is clear in its row of ``bits`` (host uint8
    [N, words], little-endian bits) set to -inf (a copy). Where the logits are on the host the
    bits are unpacked there by numpy; elsewhere the packed bits go to the device in one copy and
    are unpacked there (~2.7x less time than shifts on the host for a draft's rows:
    docs/results.md)."""
    vocab = logits.shape[1]
    allowed = unpack_host(bits) if logits.device.type == "cpu" else unpack_on(bits, logits.device)
    allowed = allowed[:, :vocab]  # [N, V]
    if allowed.shape[1] < vocab:  # rows past the tokenizer's words: never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return torch.where(allowed, logits, float("-inf"))


def unpack_host(bits: torch.Tensor) -> torch.Tensor:
    """Host uint8 bitmask rows [N, words] as bools [N, 8 x words] (little-endian bits), by numpy."""
    return torch.from_numpy(numpy.unpackbits(bits.numpy(), axis=1, bitorder="little").view(numpy.bool_))


def unpack_on(bits: torch.Tensor, device) -> torch.Tensor:
    """The same, unpacked on ``device`` after one copy of the packed rows."""
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    return (bits.to(device).unsqueeze(-1) >> shifts & 1).flatten(1).bool()


@dataclass
class DraftGrammar:
    """A draft session's rows masked to its grammar: row i to what the grammar allows after the
    session's matcher state (at the round's root, ``GrammarBook.at``) and then ``paths[i]``. A
    row whose path the grammar forbids (a hinted chain's), or which passes an end token, is left
    as it is: nothing under it is accepted. Where the matcher cannot be rolled back its state is
    lost: the session's grammar goes (the next request rebuilds it) and later rows stay unmasked."""

    book: GrammarBook
    session: object
    state: SessionGrammar

    def mask(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        st, ends = self.state, frozenset(self.book.eos_ids)
        if self.session.grammar is not st:  # lost (or rebuilt by a later request): unmasked
            return logits
        bits, m = self.book.new_bits(len(paths)), st.matcher
        for i, path in enumerate(paths):
            if ends.intersection(path) or (path and m.validate_tokens(path) < len(path)):
                continue
            if path and not m.consume_tokens(path):  # validated: cannot happen
                self.session.grammar = None
                break
            fill_row(bits[i], m.compute_bitmask())
            if m.is_error():  # a resource limit: unmasked from here (the target refuses the request)
                self.session.grammar = None
                break
            if path and not m.rollback(len(path)):
                self.session.grammar = None
                break
        return apply_bits(bits, logits)


def failed(session, matcher) -> SpecError:
    """The session's grammar failed in llguidance (a resource limit: a regex or schema too large to
    apply, e.g. ``(a{1000}){1000}``): its state goes, and the request is refused, naming why, before
    any token is chosen without its mask."""
    session.grammar = None
    why = (matcher.get_error().strip().splitlines() or ["its engine failed"])[0]  # (then its state, at length)
    return SpecError(ErrorCode.BAD_REQUEST, f"the grammar cannot be applied: {why[:300]}")


def rollback(session, matcher, n: int) -> None:
    """Undo the matcher's last ``n`` tokens; where it cannot, its state is lost: the session's
    grammar goes, and the request is a CACHE_MISS (the resend rebuilds it)."""
    if not matcher.rollback(n):
        session.grammar = None
        raise SpecError(ErrorCode.CACHE_MISS, "the grammar's state could not be rolled back: resend")


def to_grammar(spec: GrammarSpec) -> str:
    """An llguidance grammar from the request's spec (BAD_REQUEST when it is not one)."""
    try:
        return llguidance_grammar(spec.kind, spec.text)
    except (ValueError, TypeError) as exc:
        raise SpecError(ErrorCode.BAD_REQUEST, f"the grammar is not valid: {exc}") from None
