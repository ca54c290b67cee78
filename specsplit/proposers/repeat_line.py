"""Repeat the last line: where the line being written so far is a prefix of the line before it,
propose the rest of that line (its line break included). Code and lists repeat the shape of their
previous line (``self.a = a`` / ``self.b = b``, argument lists, table rows); prompt lookup finds
such a line only when its last few tokens recur exactly.

Lines are split at the tokens whose text holds a line break, read once from the target's
tokenizer files (transformers with torch kept out, as the HTTP API loads it), so the orchestrator
needs those files (``SPECSPLIT_CACHE_DIR`` or the target model path) to run this proposer. Off by
default; ``SPECSPLIT_PROPOSERS=draft,lookup,ngrams,repeat_line`` turns it on."""

from __future__ import annotations

from collections.abc import Sequence

from specsplit.proposers.base import Budget, Proposal, Proposer, Shared, register

TOKENIZER_WAIT_S = 600.0  # the workers provision the model (and its tokenizer) on their first start


def line_break_ids(tokenizer) -> frozenset[int]:
    """The ids of every token whose text holds a line break."""
    vocab = tokenizer.get_vocab()
    ids = sorted(vocab.values())
    texts = tokenizer.batch_decode([[i] for i in ids])
    return frozenset(i for i, t in zip(ids, texts) if "\n" in t)


def last_line_continuation(context: Sequence[int], breaks: frozenset[int], max_tokens: int) -> list[int]:
    """The rest of the previous line when the current (unfinished) line is a prefix of it."""
    if max_tokens <= 0:
        return []
    ends = [i for i in range(len(context) - 1, -1, -1) if context[i] in breaks][:2]
    if not ends:
        return []
    current = list(context[ends[0] + 1:])
    start = ends[1] + 1 if len(ends) > 1 else 0
    previous = list(context[start:ends[0] + 1])  # ends with its line break
    if len(current) >= len(previous) or previous[:len(current)] != current:
        return []
    return previous[len(current):len(current) + max_tokens]


@register
class RepeatLine(Proposer):
    name = "repeat_line"

    @classmethod
    def create_shared(cls, shared: Shared) -> frozenset[int]:
        # here, not at the top: only an orchestrator that runs this proposer reads model files
        from specsplit.api.tokenizer import keep_torch_out, wait_for_tokenizer_dir
        from specsplit.models.settings import ModelSettings

        keep_torch_out()  # the orchestrator stays torch-free
        from transformers import AutoTokenizer

        path = wait_for_tokenizer_dir(ModelSettings(), TOKENIZER_WAIT_S)  # the workers' model settings
        return line_break_ids(AutoTokenizer.from_pretrained(str(path)))

    def suggest(self, committed: Sequence[int], budget: Budget) -> Proposal | None:
        chain = last_line_continuation(committed, self.resource(), budget.chain_tokens)
        return Proposal(chain=chain, keys=[0] * len(chain)) if chain else None
