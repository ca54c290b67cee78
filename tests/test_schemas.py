"""Every message kind round-trips; malformed input is rejected with one typed error."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    KIND_TO_CLASS, PROTO, Ack, AuthChallenge, AuthResponse, CacheSync, ClientHello, Cancel, CodecError, DraftReply, DraftRequest, EndSession, ErrorCode,
    ErrorReply, FlatTree, GenerateDone, GenerateRequest, GrowReply, GrowRequest, Heartbeat, MsgKind, SamplingSpec, TokenChunk, TreeSpec,
    VerifyReply, VerifyRequest, WorkerHello, decode, encode, pack_frames, unpack_frames,
)

TREE = FlatTree(token_ids=[5, 6, 7], parents=[-1, 0, 0], draft_logprobs=[0.0, -0.1, -2.3],
                child_dist_ids=[[6, 7], [], []], child_dist_probs=[[0.75, 0.25], [], []])
SAMPLES = [
    DraftRequest(session_id="s", round=3, sync=CacheSync(base_len=4, append_token_ids=[1, 2]), root=9,
                 tree=TreeSpec(max_nodes=8, max_depth=3, branch=2, min_path_prob=0.25), sampling=SamplingSpec(temperature=0.7, top_p=0.9, top_k=20, seed=5)),
    DraftReply(session_id="s", round=3, tree=TREE, draft_ms=1.5, reused_nodes=2),
    GrowRequest(session_id="s", round=3, budget_ms=250.0, width=4),
    GrowRequest(session_id="s", round=3, budget_ms=250.0, width=4, tree=FlatTree(token_ids=[5, 6, 8], parents=[-1, 0, 1]),
                node_probs=[1.0, 0.75, 0.5]),
    GrowReply(session_id="s", round=3, grown_nodes=12, grow_ms=240.0),
    VerifyRequest(session_id="s", round=3, sync=CacheSync(base_len=0), tree=TREE),
    VerifyReply(session_id="s", round=3, accepted_token_ids=[6], accepted_nodes=[1], bonus_token_id=2, cache_len=7, verify_ms=3.0,
                batch_tokens=40, batch_size=5),
    EndSession(session_id="s"),
    Ack(session_id="s", existed=True),
    ErrorReply.of(ErrorCode.CACHE_MISS, "resend", session_id="s", round=3),
    WorkerHello(service="target", model_id="m", vocab_size=100, tokenizer_hash="abc", pid=1, nonce="0f" * 16),
    ClientHello(nonce="ab" * 16),
    AuthChallenge(nonce="cd" * 16, proof="e1" * 32),
    AuthResponse(mac="f2" * 32),
    Heartbeat(sent_at=1.0),
    GenerateRequest(session_id="s", prompt_token_ids=[1, 2], max_new_tokens=5, stop_token_ids=[0]),
    TokenChunk(session_id="s", round=1, token_ids=[3, 4], accepted=1),
    GenerateDone(session_id="s", token_ids=[3, 4], finish_reason="length", rounds=1),
    Cancel(session_id="s"),
]


def test_every_kind_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(KIND_TO_CLASS.values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = pack_frames(msg, "s", b"\x01\x02")
    env = unpack_frames(frames)
    assert env.msg == msg and env.session_id == "s" and env.request_id == b"\x01\x02"
    assert decode(env.kind, encode(msg)) == msg


def test_structural_schema_errors():
    for body in (
        {"token_ids": [1, 2], "parents": [-1]},
        {"token_ids": [], "parents": []},
        {"token_ids": [-1], "parents": [-1]},
        {"token_ids": [1], "parents": [-1], "extra": 1},
        {"token_ids": [1, 2], "parents": [-1, 0], "child_dist_ids": [[1]], "child_dist_probs": [[1.0]]},
    ):
        with pytest.raises(CodecError):
            decode(MsgKind.DRAFT_REPLY, msgpack.packb({"session_id": "s", "round": 0, "tree": body}))
    with pytest.raises(CodecError):
        decode(MsgKind.VERIFY_REQUEST, msgpack.packb({"session_id": "s"}))
    grow = {"session_id": "s", "round": 0, "budget_ms": 5.0, "tree": {"token_ids": [1, 2], "parents": [-1, 0]}}
    for probs in ([1.0], [1.0, 1.5], [1.0, -0.1], [1.0, float("nan")]):  # one per node, each in [0, 1]
        with pytest.raises(CodecError):
            decode(MsgKind.GROW_REQUEST, msgpack.packb({**grow, "node_probs": probs}))
    with pytest.raises(CodecError):  # probabilities without a tree
        decode(MsgKind.GROW_REQUEST, msgpack.packb({"session_id": "s", "round": 0, "budget_ms": 5.0, "node_probs": [1.0]}))
    with pytest.raises(CodecError):
        decode(0x7F, b"\x80")
    with pytest.raises(CodecError):
        unpack_frames([b"XXXX", b"\x01", b"s", b"r", b"\x80"])
    with pytest.raises(CodecError):
        unpack_frames([PROTO, b"\x05", b"s", b"r"])
    with pytest.raises(CodecError):  # session frame and body disagree
        unpack_frames([PROTO, b"\x05", b"other", b"r", encode(EndSession(session_id="s"))])


def test_verify_reply_batch_measurements_are_optional_and_bounded():
    base = {"session_id": "s", "round": 1, "accepted_token_ids": [6, 7], "accepted_nodes": [1, 2],
            "bonus_token_id": 2, "cache_len": 9}
    old = decode(MsgKind.VERIFY_REPLY, msgpack.packb(base))  # a peer that predates the fields
    assert (old.batch_tokens, old.batch_size) == (0, 1)
    for extra in ({"batch_size": 0}, {"batch_size": 4097}, {"batch_tokens": -1}, {"batch_tokens": 1 << 25},
                  {"batch_tokens": 3, "batch_size": 4},  # fewer tokens than sessions
                  {"batch_tokens": 2, "batch_size": 1},  # fewer than its own root and 2 accepted nodes
                  {"batch_size": 2.0}):
        with pytest.raises(CodecError):
            decode(MsgKind.VERIFY_REPLY, msgpack.packb({**base, **extra}))


def test_cache_sync_prompt_len_is_optional_and_within_the_committed_tokens():
    tree = {"token_ids": [5], "parents": [-1]}
    req = {"session_id": "s", "round": 0, "tree": tree}
    old = decode(MsgKind.VERIFY_REQUEST, msgpack.packb({**req, "sync": {"base_len": 0, "append_token_ids": [1, 2]}}))
    assert old.sync.prompt_len == 0  # a peer that predates the field: no prompt named
    ok = {"base_len": 0, "append_token_ids": [1, 2], "prompt_len": 3}  # committed = [1, 2, root]
    assert decode(MsgKind.VERIFY_REQUEST, msgpack.packb({**req, "sync": ok})).sync.prompt_len == 3
    for bad in (4, -1, 1.0, "3"):
        with pytest.raises(CodecError):
            decode(MsgKind.VERIFY_REQUEST, msgpack.packb({**req, "sync": {**ok, "prompt_len": bad}}))


def test_wire_types_are_strict():
    """Integers are integers, as PROTOCOL.md says: a string, a bool or a float where an integer
    belongs is refused (a typed CodecError), never coerced."""
    good = {"session_id": "s", "round": 1, "sync": {"base_len": 0}, "tree": {"token_ids": [1], "parents": [-1]}}
    assert decode(MsgKind.VERIFY_REQUEST, msgpack.packb(good)).round == 1
    for path, bad in ((("round",), "1"), (("round",), True), (("round",), 1.0), (("sync", "base_len"), "0"),
                      (("tree", "token_ids"), ["1"]), (("tree", "parents"), [-1.0])):
        body = {**good, "sync": dict(good["sync"]), "tree": dict(good["tree"])}
        holder = body
        for key in path[:-1]:
            holder = holder[key]
        holder[path[-1]] = bad
        with pytest.raises(CodecError):
            decode(MsgKind.VERIFY_REQUEST, msgpack.packb(body))
    # an error code still travels as its string value
    err = decode(MsgKind.ERROR, encode(ErrorReply.of(ErrorCode.CACHE_MISS, "x", session_id="s")))
    assert err.code is ErrorCode.CACHE_MISS


@settings(max_examples=400, deadline=None)
@given(kind=st.integers(0, 255), body=st.binary(max_size=64))
def test_garbage_bodies_raise_only_codec_error(kind, body):
    try:
        decode(kind, body)
    except CodecError:
        pass


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(list(MsgKind)), obj=json_like)
def test_wellformed_msgpack_wrong_schema_raises_only_codec_error(kind, obj):
    try:
        decode(kind, msgpack.packb(obj))
    except CodecError:
        pass


def test_optional_fields_at_none_stay_off_the_wire():
    """Every ``X | None`` field of every message defaults to None, so leaving the Nones out is
    lossless, and a peer that predates an optional field (a GenerateRequest's ``grammar``, a
    rolling upgrade) still takes a message that does not use it."""
    import typing

    import msgpack

    from schemas import GenerateRequest, KIND_TO_CLASS

    for cls in KIND_TO_CLASS.values():
        for name, field in cls.model_fields.items():
            if type(None) in typing.get_args(field.annotation):
                assert field.default is None, (cls.__name__, name)
    req = GenerateRequest(session_id="s", prompt_token_ids=[1, 2])
    body = msgpack.unpackb(encode(req))
    assert "grammar" not in body and "output_from" not in body and "specpv" not in body
    assert decode(MsgKind.GENERATE_REQUEST, encode(req)) == req
