"""The tokens a grammar forces: in a session held to a grammar (``response_format``, a required
tool call), the target reports with each verdict the tokens its grammar allows as the only
continuation after the bonus token (``VerifyReply.forced_token_ids``: a schema's keys, its
punctuation). This proposer hangs them under the next round's root, where the draft, which
proposes unconstrained, often guesses otherwise. They are verified like any node: the answer is
the target's, and a forced token the target would tokenize differently is simply not accepted.
Proposes nothing in other sessions."""

from __future__ import annotations

from collections.abc import Sequence

from specsplit.proposers.base import Budget, Proposal, Proposer, Verdict, register


@register
class GrammarForced(Proposer):
    name = "grammar"

    def __init__(self, session, shared) -> None:
        super().__init__(session, shared)
        self.forced: tuple[int, ...] = ()  # after the last verdict's bonus: the next round's root

    def learn(self, verdict: Verdict) -> None:
        self.forced = tuple(verdict.forced)

    def suggest(self, committed: Sequence[int], budget: Budget) -> Proposal | None:
        if not self.forced:
            return None
        chain, self.forced = list(self.forced[:budget.chain_tokens]), ()  # for the round right after only
        return Proposal(chain=chain, keys=[0] * len(chain))
