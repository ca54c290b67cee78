"""SpecSplit wire schemas: message models, message kinds and the msgpack codec.

Imports pydantic and msgpack only (never torch or zmq).
"""

from schemas.codec import (
    KIND_TO_CLASS,
    MAX_BODY_BYTES,
    PROTO,
    CodecError,
    Envelope,
    MsgKind,
    check_envelope,
    decode,
    encode,
    kind_of,
    pack_frames,
    parse_kind,
    unpack_frames,
)
from schemas.messages import (
    MAX_BRANCH,
    MAX_CONTEXT_TOKENS,
    MAX_DIST_SUPPORT,
    MAX_GROWN_DEPTH,
    MAX_GROWN_NODES,
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    Ack,
    AuthChallenge,
    AuthResponse,
    CacheSync,
    ClientHello,
    DraftReply,
    DraftRequest,
    EndSession,
    ErrorCode,
    ErrorReply,
    FlatTree,
    GrammarSpec,
    GrownTree,
    GrowReply,
    GrowRequest,
    Heartbeat,
    Logprobs,
    Message,
    SamplingSpec,
    SpecPVSpec,
    TokenBias,
    TreeSpec,
    VerifyReply,
    VerifyRequest,
    WorkerHello,
)
from schemas.producer import Cancel, GenerateDone, GenerateRequest, TokenChunk

__all__ = [name for name in dir() if not name.startswith("_")]
