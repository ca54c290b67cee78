"""The engine side of ``specsplit bench replay`` (the command, and what it measures:
``specsplit.bench.replay``): a trace's rounds sent to a target engine, and to a draft engine with
``--draft``, at the recorded contexts and tree shapes (``Replayer``), beside the target alone;
the engines built as a worker builds them (``build_target``, ``build_draft``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from schemas import (
    CacheSync,
    DraftReply,
    DraftRequest,
    EndSession,
    ErrorReply,
    FlatTree,
    GrowRequest,
    TreeSpec,
    VerifyReply,
    VerifyRequest,
)
from specsplit.bench.replay_trace import TracedRound, TracedSession
from specsplit.orchestrator.replay import read_trace, segments
from specsplit.tree import DraftTree, depths_of, path_to

GROW_FRACTION, GROW_WIDTH = 0.9, 4  # the fleet's growth after a draft: SPECSPLIT_GROW_FRACTION, SPECSPLIT_GROW_WIDTH
MIN_ROUNDS = 3  # ``--max-seconds`` stops a replay only after this many rounds


class ReplayError(RuntimeError):
    """The engine refused a request or its cache left the recorded progression."""


@dataclass(frozen=True, slots=True)
class ReplayedRound:
    trace: str
    session: str
    round: int
    context_len: int
    nodes: int
    sync_tokens: int  # in the timed forward
    accepted: int  # recorded
    engine_accepted: int  # this engine's verdict (then overruled)
    catchup_tokens: int  # appended by an untimed request first
    verify_ms: float  # the reply's
    wall_ms: float  # around the engine's handle
    recorded_verify_ms: float
    recorded_draft_ms: float
    recorded_wall_ms: float
    clean: bool
    batch_size: int
    draft_ms: float | None = None  # the replayed draft's (None: not replayed)
    reused: int = 0  # recorded: its tree was grown during the previous round's verify
    grow_ms: float | None = None  # the replayed growth after its draft (None: not replayed)
    rerooted: bool = False  # the replayed draft re-rooted the tree grown during the verify before
    fleet_ms: float | None = None  # the round's critical path, measured (``--fleet``, ``--overlap``)
    beside: bool = False  # its draft request went beside the verify: the grown tree re-rooted by the orchestrator


@dataclass(frozen=True, slots=True)
class AloneStep:
    trace: str
    session: str
    context_len: int
    verify_ms: float
    wall_ms: float


class Replayer:
    """Sends a trace's rounds to ``engine`` (a TargetEngine) as the orchestrator would."""

    def __init__(self, engine, seed: int = 0, draft=None, branch: int = 2) -> None:
        self.engine, self.rng = engine, random.Random(seed)
        self.draft, self.branch = draft, branch  # a DraftEngine on the same device, or None
        self._round: dict[str, int] = {}
        self._draft_held: dict[str, int] = {}
        self._grown: set[str] = set()  # draft sessions whose kept tree grew after their last request
        self.deadline: float | None = None  # perf_counter time past which no round starts (``--max-seconds``)
        self.replayed = 0  # rounds replayed (the deadline cuts a run after MIN_ROUNDS)

    def out_of_time(self) -> bool:
        return self.deadline is not None and self.replayed >= MIN_ROUNDS and time.perf_counter() > self.deadline

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.engine.vocab_size) for _ in range(n)]

    def send(self, sid: str, sync: CacheSync, parents: Sequence[int]) -> tuple[VerifyReply, float]:
        """(reply, wall ms) of one verify of a random tree shaped ``parents``."""
        rnd = self._round[sid] = self._round.get(sid, -1) + 1
        req = VerifyRequest(session_id=sid, round=rnd, sync=sync,
                            tree=FlatTree(token_ids=self.tokens(len(parents)), parents=list(parents)))
        t0 = time.perf_counter()
        reply = self.engine.handle(req)
        wall = (time.perf_counter() - t0) * 1e3
        if isinstance(reply, ErrorReply):
            raise ReplayError(f"session {sid} request {rnd}: the engine answered {reply.code}: {reply.message}")
        return reply, wall

    def expect(self, sid: str, reply: VerifyReply, want: int, what: str) -> None:
        """Fail unless the reply and the engine's session both hold ``want`` committed tokens."""
        session = self.engine.store.get(sid)
        held = -1 if session is None else self.engine.committed_len(session)
        if reply.cache_len != want or held != want:
            raise ReplayError(f"session {sid}, {what}: the engine's cache holds {held} tokens (reply: "
                              f"{reply.cache_len}), the recorded progression implies {want}")

    def prefill(self, sid: str, prompt: list[int]) -> int:
        """The prompt as round 0 sends it (sync + root-only tree); the cached length."""
        self._round.pop(sid, None)
        reply, _ = self.send(sid, CacheSync(base_len=0, append_token_ids=prompt[:-1], prompt_len=len(prompt)), [-1])
        self.expect(sid, reply, len(prompt), "prefill")
        return len(prompt)

    def catch_up(self, sid: str, held: int, want: int) -> int:
        """Untimed: bring a cache holding ``held`` committed tokens to ``want`` (> held)."""
        reply, _ = self.send(sid, CacheSync(base_len=held, append_token_ids=self.tokens(want - held - 1)), [-1])
        self.expect(sid, reply, want, f"appending {want - held} tokens")
        return want

    def session(self, s: TracedSession, prompt: list[int],
                sid: str | None = None) -> tuple[list[ReplayedRound], list[AloneStep]]:
        """Every round of ``s`` at its recorded context and shape, committing what it recorded;
        after (or, every other round, before) each clean round, the target alone decodes that
        round's tokens at their contexts in a second session, so the machine's drift hits both alike."""
        sid = sid or s.session
        lone = f"alone-{sid}"
        held = self.prefill(sid, prompt)
        lone_held = self.prefill(lone, prompt)
        rounds: list[ReplayedRound] = []
        steps: list[AloneStep] = []
        for i, r in enumerate(s.rounds):
            if self.out_of_time():
                break
            self.replayed += 1
            contexts = range(r.context_len, r.context_len + r.committed) if r.clean else range(0)
            if i % 2:
                for c in contexts:
                    lone_held = self.decode(lone, lone_held, c, s, steps)
            held = self.replay_round(sid, held, r, s, rounds)
            if not i % 2:
                for c in contexts:
                    lone_held = self.decode(lone, lone_held, c, s, steps)
        for name in (sid, lone):
            self.engine.handle(EndSession(session_id=name))
        if self.draft is not None:
            self.draft.handle(EndSession(session_id=sid))
            self._draft_held.pop(sid, None)
            self._grown.discard(sid)
        return rounds, steps

    def replay_round(self, sid: str, held: int, r: TracedRound, s: TracedSession, out: list[ReplayedRound]) -> int:
        """Round ``r`` timed, its row appended to ``out``; the committed tokens the cache then holds."""
        sync, catchup, held = self.place(sid, held, r)
        reply, wall = self.send(sid, self.round_sync(r, s, sync), r.parents)
        self.expect(sid, reply, r.context_len + len(reply.accepted_nodes), f"round {r.round}")
        draft_ms, grow_ms, rerooted = None, None, False
        if self.draft is not None and r.clean:
            draft_ms, rerooted = self.draft_round(sid, r, self.reuse(r, s, out))
            grow_ms = self.grow(sid, GROW_FRACTION * reply.verify_ms) if draft_ms else None
        out.append(self.row(r, s, sync, catchup, reply, wall, draft_ms, grow_ms, rerooted))
        return min(reply.cache_len, r.context_len + r.accepted)  # what the recorded round committed

    def place(self, sid: str, held: int, r: TracedRound) -> tuple[int, int, int]:
        """(sync tokens the timed forward carries, tokens an untimed catch-up appended first, the
        tokens the cache then holds) for round ``r`` on a cache of ``held``."""
        sync = r.sync_tokens if r.clean else 0  # a prefill / resend round's sync: the prefill did it
        base = r.context_len - 1 - sync
        catchup = max(0, base - held)
        if catchup:
            held = self.catch_up(sid, held, base)
        return sync, catchup, held

    def round_sync(self, r: TracedRound, s: TracedSession, sync: int) -> CacheSync:
        """Round ``r``'s CacheSync: ``sync`` random tokens after the recorded context's base."""
        base = r.context_len - 1 - sync
        return CacheSync(base_len=base, append_token_ids=self.tokens(sync),
                         prompt_len=s.prompt_len if base < s.prompt_len - 1 else 0)

    @staticmethod
    def reuse(r: TracedRound, s: TracedSession, out: list[ReplayedRound]) -> int:
        """The tokens the verdict before round ``r`` committed where the trace's round re-rooted a
        grown tree (the depth its re-rooting path may reach); 0 otherwise."""
        before = out[-1] if out and (out[-1].trace, out[-1].session) == (s.trace, s.session) else None
        committed = before.accepted + 1 if before is not None and before.round == r.round - 1 else 0
        return committed if r.reused else 0

    @staticmethod
    def row(r: TracedRound, s: TracedSession, sync: int, catchup: int, reply, wall: float, draft_ms, grow_ms,
            rerooted: bool, **fleet) -> ReplayedRound:
        return ReplayedRound(
            s.trace, s.session, r.round, r.context_len, len(r.parents), sync, r.accepted, len(reply.accepted_nodes),
            catchup, reply.verify_ms, wall, r.verify_ms, r.draft_ms, r.wall_ms, r.clean, r.batch_size, draft_ms,
            r.reused, grow_ms, rerooted, **fleet)

    def grow(self, sid: str, budget_ms: float) -> float:
        """The fleet's GrowRequest after a greedy draft, while the target verifies: the kept tree
        grows for ``budget_ms`` (GROW_FRACTION of the verify). Its ms, timed."""
        rnd = self._round.get(f"draft-{sid}", 0)
        reply = self.draft.handle(GrowRequest(session_id=sid, round=rnd, budget_ms=max(budget_ms, 0.01),
                                              width=GROW_WIDTH))
        if isinstance(reply, ErrorReply):
            raise ReplayError(f"draft session {sid} grow {rnd}: the engine answered {reply.code}: {reply.message}")
        self._grown.add(sid)
        return reply.grow_ms

    def grown_path(self, sid: str, committed: int) -> list[int]:
        """Tokens of a path of the draft's grown tree from its root to a forwarded node at most
        ``committed`` deep (the deepest, then the most probable): the verdict a recorded re-rooted
        round stands for, on weights whose trees are not the real pair's. [] when none."""
        session = self.draft.store.get(sid)
        g = getattr(session, "draft_tree", None) if sid in self._grown else None
        return forwarded_path(g, committed) if g is not None else []

    def draft_round(self, sid: str, r: TracedRound, reuse: int = 0) -> tuple[float, bool]:
        """(ms, re-rooted) of the draft's request for round ``r`` (0 ms for a root-only round).
        ``reuse`` > 0 (the round re-rooted in the trace, after a verdict committing ``reuse``
        tokens): the timed request follows a path of the grown tree (``grown_path``), as the
        fleet's re-rooting does; otherwise, or with no such path, the draft's cache is brought
        to the round's context (untimed) and one timed request drafts a tree of the recorded
        size and depth from scratch."""
        spec = self.draft_spec(r)
        if spec is None:
            return 0.0, False
        path = self.grown_path(sid, reuse) if reuse else []
        self._grown.discard(sid)
        if path:
            held = self._draft_held[sid]
            reply = self._request(sid, CacheSync(base_len=held, append_token_ids=path[:-1]), path[-1], spec)
            return reply.draft_ms, reply.reused_nodes > 0
        held = self._draft_held.get(sid, 0)
        base = min(held, r.context_len - 1)
        if r.context_len - 1 - base > 1:  # untimed: all but one of the tokens it has not seen
            self._draft(sid, base, r.context_len - 2 - base, TreeSpec(max_nodes=1, max_depth=0))
            base = r.context_len - 2
        ms = self._draft(sid, base, r.context_len - 1 - base, spec)  # the reply's, as verify's: graph captures out
        self._draft_held[sid] = r.context_len
        return ms, False

    def draft_spec(self, r: TracedRound) -> TreeSpec | None:
        """The budget of round ``r``'s draft request: the recorded tree's size and depth
        (``min_path_prob`` 0, so random weights build it whole); None for a root-only round."""
        nodes, depth = len(r.drafted), max(depths_of(r.drafted))
        if nodes < 2 or depth < 1:
            return None
        return TreeSpec(max_nodes=nodes, max_depth=depth, branch=self.branch, min_path_prob=0.0)

    def _draft(self, sid: str, base: int, append: int, spec: TreeSpec) -> float:
        """One draft request of random tokens; its reply's draft_ms."""
        sync = CacheSync(base_len=base, append_token_ids=self.tokens(append))
        return self._request(sid, sync, self.tokens(1)[0], spec).draft_ms

    def _request(self, sid: str, sync: CacheSync, root: int, spec: TreeSpec) -> DraftReply:
        rnd = self._round[f"draft-{sid}"] = self._round.get(f"draft-{sid}", -1) + 1
        reply = self.draft.handle(DraftRequest(session_id=sid, round=rnd, sync=sync, root=root, tree=spec))
        if isinstance(reply, ErrorReply):
            raise ReplayError(f"draft session {sid} request {rnd}: the engine answered {reply.code}: {reply.message}")
        self._draft_held[sid] = sync.base_len + len(sync.append_token_ids) + 1
        return reply

    def decode(self, sid: str, held: int, c: int, s: TracedSession, out: list[AloneStep]) -> int:
        """The target alone's step at context ``c`` (a plain round: root-only), timed into ``out``."""
        if held < c - 1:
            held = self.catch_up(sid, held, c - 1)
        reply, wall = self.send(sid, CacheSync(base_len=c - 1), [-1])
        self.expect(sid, reply, c, f"decoding at context {c}")
        out.append(AloneStep(s.trace, s.session, c, reply.verify_ms, wall))
        return c


def forwarded_path(g: DraftTree, committed: int) -> list[int]:
    """Tokens of a path of ``g`` from its root to a forwarded node at most ``committed`` deep (the
    deepest, then the most probable, then the first); [] when none."""
    ends = [i for i in range(1, len(g.tokens)) if g.slot[i] >= 0 and g.depths[i] <= committed]
    if not ends:
        return []
    end = max(ends, key=lambda i: (g.depths[i], g.scores[i], -i))
    return [g.tokens[a] for a in path_to(end, g.parents)[1:]]


def run(replayer: Replayer, sessions: Sequence[TracedSession], *, warmup_rounds: int = 3,
        progress=None) -> tuple[list[ReplayedRound], list[AloneStep]]:
    """Each session replayed beside the target alone; a short untimed replay first warms the kernels."""
    if sessions and warmup_rounds:
        s = sessions[0]
        replayer.session(TracedSession(s.trace, s.session, s.prompt_len, s.rounds[:warmup_rounds]),
                         replayer.tokens(s.prompt_len), sid="warmup")
    rounds: list[ReplayedRound] = []
    alone: list[AloneStep] = []
    replayer.replayed = 0
    for i, s in enumerate(sessions):
        if replayer.out_of_time():
            if progress:
                progress(f"--max-seconds: stopped before session {i + 1}/{len(sessions)}")
            break
        got, steps = replayer.session(s, replayer.tokens(s.prompt_len))
        rounds += got
        alone += steps
        if progress:
            progress(f"session {i + 1}/{len(sessions)}: {len(s.rounds)} rounds")
    return rounds, alone


def build_target(args) -> tuple[Any, dict[str, Any]]:
    """(TargetEngine, description) as a target worker's on ``args.device``, by
    ``specsplit.bench.gpu``'s loader: the preset's pulled weights (never downloaded), else random
    weights of its config.json (``--target-config``); the device's backend; the workers' limits."""
    from specsplit.bench.gpu import load_engine
    from specsplit.config import WorkerSettings
    from specsplit.models import ModelSettings

    ms = ModelSettings(**({"preset": args.preset} if args.preset else {}), target_device=args.device)
    settings = WorkerSettings(**({"target_threads": args.threads} if args.threads else {}))
    engine, described = load_engine("target", args, ms, settings)
    return engine, {"preset": ms.preset, **described}


def build_draft(args) -> tuple[Any, dict[str, Any]] | tuple[None, None]:
    """The draft engine replayed beside the target (``--draft`` / ``--draft-config``), or None."""
    if not (args.draft or args.draft_config):
        return None, None
    from specsplit.bench.gpu import load_engine
    from specsplit.config import WorkerSettings
    from specsplit.models import ModelSettings

    ms = ModelSettings(**({"preset": args.preset} if args.preset else {}), draft_device=args.device)
    engine, described = load_engine("draft", args, ms, WorkerSettings())
    return engine, described


def trace_branch(paths: Sequence[str]) -> int:
    """The draft trees' branch the first trace's header names (the fleet's default: 2)."""
    for header, _ in segments(read_trace(paths[0])):
        return int((header.get("tree") or {}).get("branch") or 2)
    return 2
