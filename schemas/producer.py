"""Producer <-> orchestrator messages: a generation asked for, its tokens streamed, its end.

The worker-side messages are in ``schemas.messages``; ``schemas.codec`` gives each its kind.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from schemas.base import (
    MAX_CONTEXT_TOKENS,
    MAX_PREDICTION_TOKENS,
    MAX_PROMPT_LOGPROB_ENTRIES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    MAX_TREE_DEPTH,
    Logprobs,
    Message,
    Round,
    SessionId,
    TokenId,
    prompt_logprob_entries,
)
from schemas.messages import GrammarSpec, SamplingSpec, SpecPVSpec, TreeSpec


class GenerateRequest(Message):
    """Producer -> orchestrator: generate up to max_new_tokens after prompt_token_ids."""

    session_id: SessionId
    prompt_token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_CONTEXT_TOKENS)
    max_new_tokens: int = Field(default=128, ge=1, le=MAX_CONTEXT_TOKENS)
    sampling: SamplingSpec = SamplingSpec()
    tree: TreeSpec | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    # no stop token among the first min_tokens new tokens (vLLM's min_tokens): the target and the
    # draft mask them there; at most max_new_tokens
    min_tokens: int = Field(default=0, ge=0, le=MAX_CONTEXT_TOKENS)
    # a predicted output (OpenAI's ``prediction``): what the answer is expected to be, mostly;
    # greedy rounds hang its next tokens under their root (the ``prediction`` proposer)
    prediction_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_PREDICTION_TOKENS)
    specpv: SpecPVSpec | None = None  # None: the orchestrator's default (SPECSPLIT_SPECPV_*; off unless set)
    grammar: GrammarSpec | None = None  # constrained decoding: the session runs without SpecPV
    # a resumed generation: prompt_token_ids[output_from:] is output an earlier session generated
    # (the grammar holds from there); None: all of prompt_token_ids is the prompt
    output_from: int | None = Field(default=None, ge=1)
    # stream the log-probabilities of the output (with this many alternatives; no SpecPV with it)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # the prompt's log-probabilities (of its tokens after the first: the first chunk's
    # ``prompt_logprobs``), with this many alternatives; the prompt is forwarded whole (no prefix
    # cache) and the session runs without SpecPV
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _output_in_prompt(self) -> GenerateRequest:
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} exceeds max_new_tokens {self.max_new_tokens}")
        if self.min_tokens and self.grammar is not None:  # a grammar may allow only an end token
            raise ValueError("min_tokens with a grammar is not supported")
        if self.output_from is not None and self.output_from > len(self.prompt_token_ids):
            raise ValueError(f"output_from {self.output_from} is past the {len(self.prompt_token_ids)} prompt tokens")
        if self.prompt_logprobs is not None:
            n = prompt_logprob_entries(self.prompt_len, self.prompt_logprobs)
            if n > MAX_PROMPT_LOGPROB_ENTRIES:
                raise ValueError(f"the prompt's log-probabilities would hold {n} entries (tokens x (1 + alternatives)); "
                                 f"at most {MAX_PROMPT_LOGPROB_ENTRIES}")
        return self

    @property
    def prompt_len(self) -> int:
        """The prompt's tokens: those before the output a resumed generation carries."""
        return self.output_from or len(self.prompt_token_ids)


class TokenChunk(Message):
    """Orchestrator -> producer: newly committed tokens of one round (streamed)."""

    session_id: SessionId
    round: Round
    token_ids: list[TokenId]
    accepted: int = 0
    logprobs: Logprobs | None = None  # asked for: of token_ids
    # asked for (GenerateRequest.prompt_logprobs), on the session's first chunk: of the prompt's
    # tokens after its first
    prompt_logprobs: Logprobs | None = None


class GenerateDone(Message):
    """Orchestrator -> producer: the session finished (finish_reason: stop | length | cancelled)."""

    session_id: SessionId
    token_ids: list[TokenId]
    finish_reason: str
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    elapsed_ms: float = 0.0
    # tokens per second the orchestrator's cost model expected of the trees it chose (0: no model)
    predicted_tok_s: float = Field(default=0.0, ge=0.0)
    # from the request's arrival at the orchestrator (admission queueing included) to its first
    # streamed token; None: no token was streamed
    first_token_ms: float | None = Field(default=None, ge=0.0)
    # accepted tokens by position (index i: depth i + 1 of the tree; sums to accepted_tokens)
    accepted_per_pos: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=MAX_TREE_DEPTH)
    # prompt tokens the target copied from its prefix cache instead of forwarding (its first reply's)
    cached_tokens: int = Field(default=0, ge=0, le=MAX_CONTEXT_TOKENS)


class Cancel(Message):
    session_id: SessionId
