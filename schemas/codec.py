"""msgpack codec and frame layout.

Frames (client <-> router, after the router adds/strips identities):
    [PROTO, kind, session_id, request_id, body]
PROTO is ``b"SPS1"``; kind is one byte (``MsgKind``); session_id is UTF-8; request_id is 1..32
opaque bytes chosen by the requester and echoed in the reply; body is a msgpack map of the
schema for ``kind``. Every malformed input raises ``CodecError`` (code BAD_REQUEST).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgpack
from pydantic import ValidationError

from schemas.messages import (
    Ack,
    AuthChallenge,
    AuthResponse,
    ClientHello,
    DraftReply,
    DraftRequest,
    EndSession,
    ErrorCode,
    ErrorReply,
    GrowReply,
    GrowRequest,
    Heartbeat,
    Message,
    VerifyReply,
    VerifyRequest,
    WorkerHello,
)
from schemas.producer import Cancel, GenerateDone, GenerateRequest, TokenChunk

PROTO = b"SPS1"
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_REQUEST_ID_BYTES = 32


class MsgKind(enum.IntEnum):
    """One-byte message kinds (frame 1)."""

    DRAFT_REQUEST = 0x01
    DRAFT_REPLY = 0x02
    VERIFY_REQUEST = 0x03
    VERIFY_REPLY = 0x04
    END_SESSION = 0x05
    ACK = 0x06
    ERROR = 0x07
    WORKER_HELLO = 0x10
    HEARTBEAT = 0x11
    CLIENT_HELLO = 0x12
    AUTH_CHALLENGE = 0x13
    AUTH_RESPONSE = 0x14
    GENERATE_REQUEST = 0x20
    TOKEN_CHUNK = 0x21
    GENERATE_DONE = 0x22
    CANCEL = 0x23
    GROW_REQUEST = 0x08
    GROW_REPLY = 0x09

    def as_byte(self) -> bytes:
        return bytes([self.value])


KIND_TO_CLASS: dict[MsgKind, type[Message]] = {
    MsgKind.DRAFT_REQUEST: DraftRequest,
    MsgKind.DRAFT_REPLY: DraftReply,
    MsgKind.GROW_REQUEST: GrowRequest,
    MsgKind.GROW_REPLY: GrowReply,
    MsgKind.VERIFY_REQUEST: VerifyRequest,
    MsgKind.VERIFY_REPLY: VerifyReply,
    MsgKind.END_SESSION: EndSession,
    MsgKind.ACK: Ack,
    MsgKind.ERROR: ErrorReply,
    MsgKind.WORKER_HELLO: WorkerHello,
    MsgKind.HEARTBEAT: Heartbeat,
    MsgKind.CLIENT_HELLO: ClientHello,
    MsgKind.AUTH_CHALLENGE: AuthChallenge,
    MsgKind.AUTH_RESPONSE: AuthResponse,
    MsgKind.GENERATE_REQUEST: GenerateRequest,
    MsgKind.TOKEN_CHUNK: TokenChunk,
    MsgKind.GENERATE_DONE: GenerateDone,
    MsgKind.CANCEL: Cancel,
}
CLASS_TO_KIND: dict[type[Message], MsgKind] = {cls: kind for kind, cls in KIND_TO_CLASS.items()}


class CodecError(ValueError):
    """Any malformed frame or body. Always maps to ErrorCode.BAD_REQUEST."""

    code = ErrorCode.BAD_REQUEST

    def to_reply(self, session_id: str | None = None) -> ErrorReply:
        return ErrorReply.of(ErrorCode.BAD_REQUEST, str(self), session_id=session_id)


def kind_of(msg: Message) -> MsgKind:
    try:
        return CLASS_TO_KIND[type(msg)]
    except KeyError:
        raise CodecError(f"{type(msg).__name__} is not a wire message") from None


def parse_kind(raw: bytes | int) -> MsgKind:
    """Frame 1 -> MsgKind, or CodecError."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = bytes(raw)
        if len(raw) != 1:
            raise CodecError(f"kind frame must be 1 byte, got {len(raw)}")
        raw = raw[0]
    try:
        return MsgKind(raw)
    except ValueError:
        raise CodecError(f"unknown message kind 0x{int(raw):02x}") from None


def encode(msg: Message) -> bytes:
    """Message -> msgpack body bytes. Fields at None are left out: every optional field defaults
    to None, so the receiver reads the same message, and a peer that predates an optional field
    takes a message that does not use it."""
    kind_of(msg)
    return msgpack.packb(msg.model_dump(mode="json", exclude_none=True), use_bin_type=True)


def decode(kind: bytes | int | MsgKind, body: bytes) -> Message:
    """(kind, msgpack body) -> validated Message, or CodecError."""
    k = kind if isinstance(kind, MsgKind) else parse_kind(kind)
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise CodecError("body must be bytes")
    if len(body) > MAX_BODY_BYTES:
        raise CodecError(f"body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        obj = msgpack.unpackb(bytes(body), raw=False, strict_map_key=True, max_bin_len=0)
    except Exception as exc:  # msgpack raises a family of unrelated exception types
        raise CodecError(f"body is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise CodecError(f"body must be a msgpack map, got {type(obj).__name__}")
    cls = KIND_TO_CLASS[k]
    try:
        return cls.model_validate(obj)
    except ValidationError as exc:
        errs = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise CodecError(f"invalid {cls.__name__}: {errs}") from None


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded message with its routing frames."""

    kind: MsgKind
    session_id: str
    request_id: bytes
    msg: Message


def pack_frames(msg: Message, session_id: str, request_id: bytes) -> list[bytes]:
    """Message -> [PROTO, kind, session_id, request_id, body]."""
    if not 1 <= len(request_id) <= MAX_REQUEST_ID_BYTES:
        raise CodecError(f"request_id must be 1..{MAX_REQUEST_ID_BYTES} bytes")
    return [PROTO, kind_of(msg).as_byte(), session_id.encode(), request_id, encode(msg)]


def check_envelope(frames: list[bytes]) -> tuple[MsgKind, str, bytes]:
    """Validate the four envelope frames without touching the body (what routers do)."""
    if len(frames) != 5:
        raise CodecError(f"expected 5 frames [PROTO, kind, session_id, request_id, body], got {len(frames)}")
    proto, kind, sid, rid, _ = frames
    if bytes(proto) != PROTO:
        raise CodecError(f"unknown protocol {bytes(proto)[:16]!r}, expected {PROTO!r}")
    k = parse_kind(kind)
    if not 1 <= len(sid) <= 128:
        raise CodecError("session_id frame must be 1..128 bytes")
    try:
        session_id = bytes(sid).decode("utf-8")
    except UnicodeDecodeError:
        raise CodecError("session_id is not UTF-8") from None
    if not 1 <= len(rid) <= MAX_REQUEST_ID_BYTES:
        raise CodecError(f"request_id frame must be 1..{MAX_REQUEST_ID_BYTES} bytes")
    return k, session_id, bytes(rid)


def unpack_frames(frames: list[bytes]) -> Envelope:
    """[PROTO, kind, session_id, request_id, body] -> Envelope, or CodecError."""
    k, session_id, rid = check_envelope(frames)
    msg = decode(k, frames[4])
    body_sid = getattr(msg, "session_id", None)
    if isinstance(body_sid, str) and body_sid not in (session_id, "-"):
        raise CodecError("session_id frame and body disagree")
    return Envelope(k, session_id, rid, msg)
