"""What every wire message builds on: the protocol's absolute limits, the field types, the error
codes, the ``Message`` base class and the parts messages share (a grammar, log-probabilities, a
token's bias); ``schemas.messages`` defines the messages and re-exports these."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Absolute protocol limits (PROTOCOL.md, "Limits").
MAX_TREE_NODES = 256
MAX_TREE_DEPTH = 64
MAX_BRANCH = 32
MAX_DIST_SUPPORT = 256
MAX_CONTEXT_TOKENS = 131_072
MAX_SESSION_ID_LEN = 128
MAX_TEXT_LEN = 1_000_000
MAX_BATCH_SESSIONS = 4096  # sessions one verify forward may serve
MAX_BATCH_TOKENS = 1 << 24  # new tokens one verify forward may carry (all its sessions)
MAX_GROWN_NODES = 8 * MAX_TREE_NODES  # a grown tree (GrowReply.tree): growth keeps up to 4x a tree's nodes
MAX_GROWN_DEPTH = 2 * MAX_TREE_DEPTH  # growth reaches twice a tree's depth

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
SessionId = Annotated[str, Field(min_length=1, max_length=MAX_SESSION_ID_LEN)]
Round = Annotated[int, Field(ge=0, lt=2**53)]
MAX_TOP_LOGPROBS = 20  # alternatives a position's log-probabilities may list (OpenAI's top_logprobs cap)
# a prompt's log-probabilities travel in one message: positions x (1 + alternatives) at most this
# (~14 bytes each in msgpack: well within a body)
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18
HexNonce = Annotated[str, Field(max_length=128, pattern=r"^[0-9a-f]*$")]  # hex; routers require >= 32 digits
HexMac = Annotated[str, Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]  # HMAC-SHA256, hex


class ErrorCode(str, enum.Enum):
    """Typed error codes carried by ErrorReply."""

    CACHE_MISS = "CACHE_MISS"  # worker holds fewer than base_len tokens: resend with base_len 0
    STALE_ROUND = "STALE_ROUND"  # round older than one the worker already served
    BAD_REQUEST = "BAD_REQUEST"  # malformed frame/body, invalid tree, token out of range, ...
    NO_WORKER = "NO_WORKER"  # router has no live worker for the service
    OVERLOADED = "OVERLOADED"  # queue full / capacity exhausted; retry later
    INTERNAL = "INTERNAL"  # unexpected failure inside a worker
    UNAUTHENTICATED = "UNAUTHENTICATED"  # the peer has not (or no longer) proved the fleet secret


RETRYABLE_BY_DEFAULT: dict[ErrorCode, bool] = {
    ErrorCode.CACHE_MISS: True,
    ErrorCode.STALE_ROUND: False,
    ErrorCode.BAD_REQUEST: False,
    ErrorCode.NO_WORKER: True,
    ErrorCode.OVERLOADED: True,
    ErrorCode.INTERNAL: True,
    ErrorCode.UNAUTHENTICATED: True,  # authenticate again, then resend
}


class Message(BaseModel):
    """Base of every wire message: immutable, unknown fields rejected, types strict (an int field
    takes an int only: no strings, bools or floats coerced; PROTOCOL.md, "Errors")."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


MAX_GRAMMAR_CHARS = 65536
MAX_FORCED_TOKENS = 64  # tokens a grammar forces that a reply reports (VerifyReply.forced_token_ids)


class GrammarSpec(Message):
    """A constraint on a session's output: the target samples only tokens that keep it a prefix
    of the grammar's language (``json_schema``: a JSON Schema's text; ``lark``: a Lark grammar
    as llguidance reads it; ``regex``: a regular expression the whole output matches, Rust's
    syntax). Sent with every verify request of the session (so any target can
    rebuild its state), and every draft request (a draft that takes it proposes what it allows)."""

    kind: Literal["json_schema", "lark", "regex"]
    text: str = Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)


LOGPROB_FLOOR = -9999.0  # a token of no probability (OpenAI's value; JSON has no -inf)
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 64  # stop token ids a generation may name
MAX_PREDICTION_TOKENS = 32768  # a predicted output's tokens (GenerateRequest.prediction_token_ids)


class TokenBias(Message):
    """Added to the token's logit at every position before it is chosen (OpenAI's logit_bias)."""

    token_id: TokenId
    bias: float = Field(ge=-100.0, le=100.0)


class Logprobs(Message):
    """Log-probabilities of a list of tokens (a reply's or a chunk's, aligned with it) under the
    target's distribution at each of them: the log-softmax of its logits, before temperature,
    top-p/top-k and any grammar (vLLM's raw log-probabilities), floored at LOGPROB_FLOOR.
    ``token``: each chosen token's; ``top_ids``/``top``: each position's most likely tokens, most
    likely first (as many as asked; empty rows when none were)."""

    token: list[Annotated[float, Field(ge=LOGPROB_FLOOR, le=0.0)]] = Field(max_length=MAX_CONTEXT_TOKENS)
    top_ids: list[Annotated[list[TokenId], Field(max_length=MAX_TOP_LOGPROBS)]] = Field(max_length=MAX_CONTEXT_TOKENS)
    top: list[Annotated[list[Annotated[float, Field(ge=LOGPROB_FLOOR, le=0.0)]], Field(max_length=MAX_TOP_LOGPROBS)]] \
        = Field(max_length=MAX_CONTEXT_TOKENS)

    @model_validator(mode="after")
    def _aligned(self) -> Logprobs:
        if not len(self.token) == len(self.top_ids) == len(self.top):
            raise ValueError("token, top_ids and top must be as long as each other")
        if any(len(i) != len(v) for i, v in zip(self.top_ids, self.top)):
            raise ValueError("each row of top_ids and top must be as long as the other")
        return self

    def __len__(self) -> int:
        return len(self.token)

    def __getitem__(self, cut: slice) -> Logprobs:
        return Logprobs(token=self.token[cut], top_ids=self.top_ids[cut], top=self.top[cut])

    @classmethod
    def join(cls, parts: list[Logprobs]) -> Logprobs:
        return cls(token=[x for p in parts for x in p.token], top_ids=[x for p in parts for x in p.top_ids],
                   top=[x for p in parts for x in p.top])


def prompt_logprob_entries(prompt_tokens: int, top: int) -> int:
    """Entries a prompt's log-probabilities hold (its tokens after the first, each with ``top``
    alternatives): at most MAX_PROMPT_LOGPROB_ENTRIES in a message."""
    return max(0, prompt_tokens - 1) * (1 + top)
