"""Protocol fuzzer, part 1: seeded fuzz cases built from the real schemas, and the oracle.

A case is the frames one socket of the fuzzer sends (a DEALER: the peer's ROUTER adds the
identity), the lane it is sent on, and what the fleet must do with it, decided from the frames
alone by the rules of PROTOCOL.md: ``ANSWER`` (a reply with the case's request id: a typed
ErrorReply, or the request's normal reply), one of the drop rules (PROTOCOL.md, "Dropped, not
answered"), or ``ANY`` for a lane whose routing is racy by design (a stolen worker identity).

Cases start as valid messages of the real schemas (``schemas.messages``), encoded by the real
codec, then get zero to three mutations: frame level (drop / add / swap / empty frames, wrong
PROTO, unknown or mismatched kinds, bad session or request ids, truncated / flipped / extended /
8 MiB+ / deeply nested bodies) or field level (wrong types, huge and negative ints, NaN, deep
nesting, missing and unknown fields; cyclic or out-of-range parents, token ids >= vocab, trees
over the caps, other clients' session ids). Torch-free and socket-free.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import msgpack

from schemas import (
    MAX_BODY_BYTES, PROTO, CacheSync, Cancel, CodecError, DraftReply, DraftRequest, EndSession, ErrorCode,
    ErrorReply, FlatTree, GenerateRequest, GrowRequest, Heartbeat, Message, MsgKind, SamplingSpec, TreeSpec,
    VerifyReply, VerifyRequest, WorkerHello, check_envelope, pack_frames, unpack_frames,
)
from schemas.messages import Ack

ANSWER = "answer"
ANY = "any"  # stolen identities: the real worker and the fuzzer race for the identity
# drop rules, as named in PROTOCOL.md ("Dropped, not answered")
DROP_CANCEL = "cancel_not_answered"
DROP_BAD_CONTROL = "malformed_control_from_worker"
DROP_CONTROL_KIND = "control_kind_not_for_router"
DROP_OR_HELLO = "from_unknown_worker"  # dropped; at most once a heartbeat answered "send WORKER_HELLO"
HELLO_RID = b"hello?"
PLACEHOLDER_RID = b"-"

FE_LANES = ("draft_fe", "target_fe")
ORCH_LANES = ("orch_a", "orch_b")
BE_LANES = ("draft_be", "target_be")
STEAL_LANES = ("draft_steal", "target_steal")
LANES = FE_LANES + ORCH_LANES + BE_LANES + STEAL_LANES
# lane weights: what share of the messages each socket gets
WEIGHTS = {"draft_fe": 24, "target_fe": 24, "orch_a": 16, "orch_b": 8, "draft_be": 12, "target_be": 12,
           "draft_steal": 2, "target_steal": 2}
FE_IDENTITY = {"draft_fe": b"fuzz-fe-draft", "target_fe": b"fuzz-fe-target"}
BE_IDENTITY = {"draft_be": b"fuzz-be-draft", "target_be": b"fuzz-be-target"}

BAD_VALUES = (None, True, False, "x", "", 1.5, -1, -(2**63), 2**64 - 1, 2**53, 2**31, float("nan"), float("inf"),
              float("-inf"), [], {}, [1, 2], {"a": 1}, [[[]]], "é" * 3000, 10**6, -0.0)


@dataclass(frozen=True, slots=True)
class Case:
    lane: str
    frames: list[bytes]
    key: bytes  # the request id a reply must carry (PLACEHOLDER_RID when unreadable)
    expect: str  # ANSWER, ANY or a drop rule
    what: str  # base message and mutations, for failure reports


# ------------------------------------------------------------------------------- oracle
def readable_rid(env: list[bytes], need_proto: bool = False) -> bytes:
    """The request id an error for ``env`` echoes: frame 3 when it is 1..32 bytes (the
    orchestrator also needs frame 0 to be PROTO), else ``-``."""
    if len(env) > 3 and 1 <= len(env[3]) <= 32 and (not need_proto or (len(env) >= 4 and env[0] == PROTO)):
        return bytes(env[3])
    return PLACEHOLDER_RID


def expect_of(lane: str, frames: list[bytes]) -> tuple[str, bytes]:
    """(expectation, reply key) for ``frames`` sent on ``lane`` (PROTOCOL.md rules only)."""
    if lane in STEAL_LANES:
        return ANY, readable_rid(frames[1:])
    if lane in FE_LANES:  # every frontend message is answered: by the router, or by a worker
        return ANSWER, readable_rid(frames)
    if lane in ORCH_LANES:
        try:
            env = unpack_frames(frames)
        except CodecError:
            return ANSWER, readable_rid(frames, need_proto=True)
        return (DROP_CANCEL if env.kind is MsgKind.CANCEL else ANSWER), env.request_id
    client_id, env = frames[0], frames[1:]
    if client_id:  # a "reply" from a worker the router never admitted, for a request never sent
        return DROP_OR_HELLO, HELLO_RID
    try:
        kind, _, rid = check_envelope(env)
    except CodecError:
        return DROP_BAD_CONTROL, PLACEHOLDER_RID
    if kind in (MsgKind.WORKER_HELLO, MsgKind.AUTH_RESPONSE):
        return ANSWER, rid  # challenged, refused (or admitted) with that request id
    if kind is MsgKind.HEARTBEAT:
        return DROP_OR_HELLO, HELLO_RID
    return DROP_CONTROL_KIND, PLACEHOLDER_RID


# ----------------------------------------------------------------------- valid messages
class Generator:
    """Seeded fuzz cases. ``foreign_sids``: session ids of other clients (e.g. a reference run's).
    ``stolen``: {lane: a real worker's identity} for the identity-stealing lanes."""

    def __init__(self, seed: int, vocab: int = 448, foreign_sids: tuple[str, ...] = (),
                 big_bodies: int = 12) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.foreign = list(foreign_sids) or ["someone-else"]
        self.own: dict[str, list[str]] = {lane: [] for lane in LANES}
        self.big_left = big_bodies
        self.n = 0

    def tok(self) -> int:
        return self.rng.randrange(min(self.vocab, 400))

    def toks(self, lo: int, hi: int) -> list[int]:
        return [self.tok() for _ in range(self.rng.randint(lo, hi))]

    def sid(self, lane: str) -> str:
        r, own = self.rng.random(), self.own[lane]
        if r < 0.15:
            return self.rng.choice(self.foreign)
        if r < 0.3:  # another lane's (another client's) session
            other = [s for lane2, sids in self.own.items() if lane2 != lane for s in sids[-8:]]
            if other:
                return self.rng.choice(other)
        if own and r < 0.6:
            return self.rng.choice(own[-8:])
        sid = f"fz-{lane}-{self.n}"
        own.append(sid)
        del own[:-64]
        return sid

    def sampling(self) -> SamplingSpec:
        if self.rng.random() < 0.7:
            return SamplingSpec()
        return SamplingSpec(temperature=self.rng.choice([0.3, 0.7, 1.0, 2.5]), top_p=self.rng.choice([1.0, 0.9, 0.2]),
                            top_k=self.rng.choice([0, 1, 5, 50]), seed=self.rng.randrange(2**31))

    def tree_spec(self) -> TreeSpec:
        return TreeSpec(max_nodes=self.rng.randint(1, 16), max_depth=self.rng.randint(0, 6),
                        branch=self.rng.randint(1, 4))

    def flat_tree(self, n: int | None = None) -> FlatTree:
        n = n or self.rng.randint(1, 12)
        parents = [-1] + [self.rng.randrange(i) for i in range(1, n)]
        logprobs = [0.0] + [-self.rng.random() * 3 for _ in range(n - 1)] if self.rng.random() < 0.5 else []
        return FlatTree(token_ids=[self.tok() for _ in range(n)], parents=parents, draft_logprobs=logprobs)

    def sync(self) -> CacheSync:
        base = 0 if self.rng.random() < 0.8 else self.rng.randint(1, 40)
        return CacheSync(base_len=base, append_token_ids=self.toks(0, 12))

    def base(self, lane: str) -> tuple[Message, str]:
        """A valid message for ``lane`` (sometimes one that belongs on another socket)."""
        g, r = self.rng, self.rng.random()
        sid = self.sid(lane)
        rnd = g.choice([0, 1, 2, 7, 100])
        wrong = [WorkerHello(service=g.choice(["draft", "target", "fuzz"]), model_id="fuzz", vocab_size=self.vocab,
                             tokenizer_hash="fuzz"), Heartbeat(sent_at=g.random()),
                 ErrorReply.of(ErrorCode.INTERNAL, "fuzz", session_id=sid), Cancel(session_id=sid),
                 GenerateRequest(session_id=sid, prompt_token_ids=self.toks(1, 5), max_new_tokens=2),
                 DraftReply(session_id=sid, round=rnd, tree=self.flat_tree()), Ack(session_id=sid)]
        if lane in FE_LANES:
            draft = DraftRequest(session_id=sid, round=rnd, sync=self.sync(), root=self.tok(), tree=self.tree_spec(),
                                 sampling=self.sampling())
            verify = VerifyRequest(session_id=sid, round=rnd, sync=self.sync(), tree=self.flat_tree(),
                                   sampling=self.sampling())
            hint = self.flat_tree() if g.random() < 0.3 else None  # a verified tree to grow (greedy; any root)
            main = [draft, GrowRequest(session_id=sid, round=rnd, budget_ms=g.choice([1.0, 5.0]), width=2, tree=hint,
                                       node_probs=[g.random() for _ in range(hint.num_nodes)] if hint else [])]
            if lane.startswith("target"):
                main = [verify, verify]
            if r < 0.75:
                return g.choice(main), sid
            if r < 0.85:
                return EndSession(session_id=sid), sid
            return g.choice([verify, draft, *wrong]), sid
        if lane in ORCH_LANES:
            if r < 0.6:
                gen = GenerateRequest(session_id=sid, prompt_token_ids=self.toks(1, 12), max_new_tokens=g.randint(1, 6),
                                      sampling=self.sampling(), tree=self.tree_spec() if g.random() < 0.3 else None,
                                      stop_token_ids=self.toks(0, 2))
                return gen, sid
            if r < 0.8:
                return Cancel(session_id=sid), sid
            return g.choice(wrong), sid
        # a fake worker: control messages, and replies for request ids never sent
        if r < 0.5:
            return g.choice([wrong[0], wrong[0], wrong[1], wrong[1], wrong[2], wrong[5]]), "-"
        return g.choice([DraftReply(session_id=sid, round=rnd, tree=self.flat_tree()), wrong[2], Ack(session_id=sid),
                         VerifyReply(session_id=sid, round=rnd, accepted_token_ids=[self.tok()], bonus_token_id=1,
                                     cache_len=3)]), sid

    # ----------------------------------------------------------------------------- cases
    def case(self, lane: str) -> Case:
        self.n += 1
        msg, sid = self.base(lane)
        rid = b"f%07d" % self.n + self.rng.randbytes(4)
        what = [type(msg).__name__]
        obj = msg.model_dump(mode="json")
        kind = MsgKind(pack_frames(msg, sid, rid)[1][0])
        frames: list[bytes] | None = None
        for _ in range(self.rng.choice([0, 1, 1, 1, 2, 3])):
            if frames is None and self.rng.random() < 0.65:
                what.append(self.mutate_body(obj, kind))
            else:
                if frames is None:
                    frames = [PROTO, kind.as_byte(), sid.encode(), rid, self.pack(obj)]
                what.append(self.mutate_frames(frames))
        if frames is None:
            frames = [PROTO, kind.as_byte(), sid.encode(), rid, self.pack(obj)]
        if lane in BE_LANES or lane in STEAL_LANES:
            frames = [self.client_id(lane, msg), *frames]
        expect, key = expect_of(lane, frames)
        return Case(lane, frames, key, expect, " ".join(what))

    def client_id(self, lane: str, msg: Message) -> bytes:
        """Control frames go to the router (empty client id); replies to a client: a made-up one,
        or the fuzzer's own frontend socket (a reply it never asked for)."""
        if isinstance(msg, (WorkerHello, Heartbeat)) or (isinstance(msg, ErrorReply) and self.rng.random() < 0.5):
            return b""
        return self.rng.choice([b"fuzz-fe-draft", b"fuzz-fe-target", self.rng.randbytes(5), b"\x00" + self.rng.randbytes(4)])

    def pack(self, obj) -> bytes:
        return msgpack.packb(obj, use_bin_type=True)

    def mutate_body(self, obj: dict, kind: MsgKind) -> str:
        """Mutate the body's map in place; returns what was done."""
        g = self.rng
        r = g.random()
        tree, sync = obj.get("tree"), obj.get("sync")
        if r < 0.35 and kind in (MsgKind.VERIFY_REQUEST, MsgKind.DRAFT_REPLY) and _tree_shaped(tree):
            return self.mutate_tree(tree)
        if r < 0.45 and isinstance(sync, dict):
            return self.mutate_sync(sync)
        if r < 0.5 and kind in (MsgKind.VERIFY_REQUEST, MsgKind.GENERATE_REQUEST):
            obj["specpv"] = dict(block_size=g.choice([2, 4, 16]), sink_blocks=g.randint(0, 3),
                                 retrieval_blocks=g.randint(0, 8), window_blocks=g.randint(0, 3),
                                 buffer_tokens=g.choice([8, 16, 128]), threshold=g.choice([0, 1, 8, 64]),
                                 refresh_every=g.randint(1, 4), exact=g.random() < 0.5)
            return "specpv"
        if r < 0.6 and "sampling" in obj:
            obj["sampling"] = dict(temperature=g.choice([0.0, 1e-9, 99.0, 1.0]), top_p=g.choice([1e-9, 0.5, 1.0]),
                                   top_k=g.choice([0, 1, 447, 448, 449, 262144]), seed=g.choice([0, 2**63 - 1]))
            return "extreme_sampling"
        if r < 0.67:
            obj[g.choice(["zzz", "", "session_id_", "x" * 300])] = copy.deepcopy(g.choice(BAD_VALUES))
            return "unknown_field"
        if r < 0.72 and obj:
            obj.pop(g.choice(sorted(obj)))
            return "missing_field"
        path = self.paths(obj)
        if not path:
            return "no_fields"
        holder, key = g.choice(path)
        holder[key] = self.bad_value(holder[key])
        return f"bad_value:{key}"

    def paths(self, obj, out=None, depth: int = 0) -> list:
        """(container, key) of every field and item, down to depth 6 (deep values stay packable)."""
        out = [] if out is None else out
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for k, v in items:
            out.append((obj, k))
            if isinstance(v, (dict, list)) and len(out) < 400 and depth < 6:
                self.paths(v, out, depth + 1)
        return out

    def bad_value(self, old):
        g = self.rng
        if isinstance(old, list) and old and g.random() < 0.3:
            return old * g.choice([300, 5000])  # too long
        if isinstance(old, str) and g.random() < 0.3:
            return old + "x" * 200
        if isinstance(old, int) and not isinstance(old, bool) and g.random() < 0.3:
            return max(-(2**63), min(2**64 - 1, g.choice([old + self.vocab, -old - 1, old * 2**20])))
        if g.random() < 0.05:
            deep = 0
            for _ in range(400):  # msgpack packs up to 511 levels; receivers must not recurse on it
                deep = [deep]
            return deep
        return copy.deepcopy(g.choice(BAD_VALUES))  # a fresh one: later mutations may edit it in place

    def mutate_tree(self, tree: dict) -> str:
        g, n = self.rng, len(tree["token_ids"])
        r = g.random()
        i = g.randrange(n)
        if r < 0.15 and n > 1:
            tree["parents"][i or 1] = g.choice([i or 1, n - 1, n + 3])
            return "tree_cyclic"
        if r < 0.3:
            tree["parents"][i] = g.choice([-2, -1, n + 5, 2**40, -(2**40)])
            return "tree_parent_out_of_range"
        if r < 0.4:
            tree["parents"][0] = g.choice([0, 1, 5])
            return "tree_bad_root"
        if r < 0.55:
            tree["token_ids"][i] = g.choice([self.vocab, self.vocab + 1, 100_000, 2**31 - 1])
            return "tree_token_out_of_vocab"
        if r < 0.7:
            m = g.choice([17, 20, 65, 257, 300])
            tree.update(token_ids=[self.tok() for _ in range(m)], parents=list(range(-1, m - 1)), draft_logprobs=[],
                        child_dist_ids=[], child_dist_probs=[])
            return f"tree_chain_{m}"
        if r < 0.8:
            tree["draft_logprobs"] = [g.choice([float("nan"), float("inf"), -1.0, 5.0]) for _ in range(n)]
            return "tree_bad_logprobs"
        if r < 0.9:
            probs = g.choice([[float("nan")], [-1.0], [2.0], [0.0], [float("inf")]])
            ids = [g.choice([self.tok(), self.vocab + 7])]
            tree["child_dist_ids"] = [ids if tree["parents"].count(k) else [] for k in range(n)]
            tree["child_dist_probs"] = [probs if tree["parents"].count(k) else [] for k in range(n)]
            return "tree_bad_child_dist"
        tree["parents"] = tree["parents"][: max(0, n - 1)]
        return "tree_length_mismatch"

    def mutate_sync(self, sync: dict) -> str:
        g = self.rng
        r = g.random()
        if r < 0.3:
            sync["base_len"] = g.choice([1, 100, 4095, 131_072, 131_073])
            return "sync_base_len"
        if r < 0.6:
            sync["append_token_ids"] = [g.choice([self.vocab, 2**31 - 1, self.tok()]) for _ in range(4)]
            return "sync_token_out_of_vocab"
        sync["append_token_ids"] = [i % 400 for i in range(g.choice([4097, 9000]))]
        return "sync_over_capacity"

    def mutate_frames(self, frames: list[bytes]) -> str:
        g = self.rng
        r = g.random()
        i = g.randrange(len(frames)) if frames else 0
        if r < 0.08 and frames:
            frames.pop(i)
            return f"drop_frame{i}"
        if r < 0.14:
            frames.insert(i, g.choice([b"", g.randbytes(g.randint(1, 40)), PROTO]))
            return f"extra_frame{i}"
        if r < 0.18 and len(frames) > 1:
            j = g.randrange(len(frames))
            frames[i], frames[j] = frames[j], frames[i]
            return "swap_frames"
        if r < 0.22 and frames:
            frames[i] = b""
            return f"empty_frame{i}"
        if len(frames) < 5:
            frames.append(g.randbytes(3))
            return "short_message_padded"
        if r < 0.28:
            frames[0] = g.choice([b"SPS2", b"SPS", b"SPS1\x00", g.randbytes(4)])
            return "wrong_proto"
        if r < 0.38:
            frames[1] = g.choice([bytes([g.randrange(256)]), b"\x01\x01", b"", bytes([g.choice(list(MsgKind)).value])])
            return "kind"
        if r < 0.46:
            frames[2] = g.choice([b"", b"s" * 129, b"\xff\xfe", g.choice(self.foreign).encode(), b"-"])
            return "session_id_frame"
        if r < 0.52:
            frames[3] = g.choice([b"", b"r" * 33, frames[3] + g.randbytes(2)])
            return "request_id_frame"
        body = frames[4]
        if r < 0.62:
            frames[4] = body[: g.randrange(len(body))] if body else b"\xc1"
            return "truncated_body"
        if r < 0.7 and body:
            b = bytearray(body)
            for _ in range(g.randint(1, 4)):
                b[g.randrange(len(b))] ^= 1 << g.randrange(8)
            frames[4] = bytes(b)
            return "flipped_body"
        if r < 0.76:
            frames[4] = body + g.randbytes(g.randint(1, 64))
            return "extended_body"
        if r < 0.8:
            frames[4] = g.randbytes(g.randint(0, 256))
            return "random_body"
        if r < 0.85:
            frames[4] = g.choice([msgpack.packb([1, 2]), msgpack.packb(7), msgpack.packb(None), b"\x81\x01\x02",
                                  msgpack.packb({b"k": 1}, use_bin_type=True)])
            return "body_not_a_str_keyed_map"
        if r < 0.9:
            frames[4] = b"\x81\xa9sync_deep" + b"\x91" * g.choice([100, 5000, 200_000]) + b"\x00"
            return "deeply_nested_body"
        if self.big_left <= 0:
            frames[4] = g.randbytes(g.randint(0, 64))
            return "random_body"
        self.big_left -= 1
        if self.big_left % 2:
            size = MAX_BODY_BYTES + g.randint(1, 4096)
            frames[4] = b"\x81\xa1a\xdb" + size.to_bytes(4, "big") + b"a" * size
            return "body_over_8MiB"
        frames[4] = msgpack.packb({"prompt_token_ids": list(range(200_000)), "token_ids": list(range(200_000))})
        return "body_2MB_lists"



def _tree_shaped(tree) -> bool:
    """Still a FlatTree's map (an earlier mutation may have replaced or cut it)."""
    return (isinstance(tree, dict) and isinstance(tree.get("token_ids"), list) and isinstance(tree.get("parents"), list)
            and len(tree["token_ids"]) == len(tree["parents"]) > 0)
