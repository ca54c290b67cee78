"""What every wire message builds on: the protocol's absolute limits, the field types, the error
codes and the ``Message`` base class (``schemas.messages`` defines the messages and re-exports
these)."""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

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
