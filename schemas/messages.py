"""Wire messages: frozen pydantic models, one class per message kind.

Every message on a SpecSplit socket is one of these classes, encoded by ``schemas.codec``.
Field caps here are absolute protocol limits (a worker may configure tighter ones); structural
tree checks (parent order, depth, vocabulary range) happen once in ``specsplit.tree``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from schemas.base import (  # noqa: F401  (re-exported: schemas.messages is where callers find them)
    MAX_BATCH_SESSIONS,
    MAX_BATCH_TOKENS,
    MAX_BRANCH,
    MAX_CONTEXT_TOKENS,
    MAX_DIST_SUPPORT,
    MAX_FORCED_TOKENS,
    MAX_GRAMMAR_CHARS,
    MAX_GROWN_DEPTH,
    MAX_GROWN_NODES,
    MAX_LOGIT_BIAS,
    MAX_PROMPT_LOGPROB_ENTRIES,
    MAX_SESSION_ID_LEN,
    MAX_STOP_TOKEN_IDS,
    MAX_TEXT_LEN,
    MAX_TOP_LOGPROBS,
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    RETRYABLE_BY_DEFAULT,
    ErrorCode,
    GrammarSpec,
    HexMac,
    HexNonce,
    Logprobs,
    Message,
    Round,
    SessionId,
    TokenBias,
    TokenId,
    prompt_logprob_entries,
)


class SamplingSpec(Message):
    """How tokens are chosen. temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 mean off. The
    penalties (None: off) are vLLM's (PROTOCOL.md, "Penalties"); logit_bias, OpenAI's."""

    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=MAX_DIST_SUPPORT * 1024)
    # tokens less probable than min_p x the most probable one are dropped (after top-k and top-p)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    # true: the temperature divides the logits after top-k, top-p and min-p chose the tokens
    # (llama.cpp's default order), not before them (transformers' and vLLM's); None is false and
    # is left off the wire, so peers without the field still read every other request
    temperature_last: bool | None = None
    # true: llama.cpp's infill sampler chooses among the tokens top-k / top-p / min-p kept, before
    # a last temperature (specsplit.engine.infill); needs a top-k; None is false and off the wire
    infill: bool | None = None
    seed: int = Field(default=0, ge=0, lt=2**63)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logit_bias: list[TokenBias] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)  # before the penalties' logits
    # never chosen at any node (their logits -inf, after the bias and penalties): the stop tokens
    # of a round whose tokens are all within the answer's ``GenerateRequest.min_tokens``
    masked_token_ids: list[TokenId] | None = Field(default=None, max_length=2 * MAX_STOP_TOKEN_IDS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty not in (None, 1.0)

    @property
    def processed(self) -> bool:
        """Logits the target changes before choosing: verified against the full cache only."""
        return self.penalized or bool(self.logit_bias) or bool(self.masked_token_ids)


class TreeSpec(Message):
    """Draft tree budget. max_nodes counts every node including the root (node 0).

    A chain of k drafted tokens is TreeSpec(max_nodes=k + 1, max_depth=k, branch=1).
    max_nodes=1 or max_depth=0 means no speculation (plain decoding, one token per round).
    min_path_prob: the draft stops adding levels once the most probable frontier path (product
    of draft probabilities from the root) falls below it; 0 always drafts to max_depth.
    """

    max_nodes: int = Field(default=16, ge=1, le=MAX_TREE_NODES)
    max_depth: int = Field(default=6, ge=0, le=MAX_TREE_DEPTH)
    branch: int = Field(default=2, ge=1, le=MAX_BRANCH)
    min_path_prob: float = Field(default=0.0, ge=0.0, le=1.0)


class SpecPVSpec(Message):
    """SpecPV partial verification of one session's trees (None where it travels: full verification).

    Past ``threshold`` context tokens the target verifies a tree against a partial view of its
    KV cache instead of the whole prefix: the first ``sink_blocks`` blocks, the
    ``retrieval_blocks`` blocks whose key summaries score highest against the tree's queries
    (per layer and KV head), the last ``window_blocks`` blocks, and a buffer of up to
    ``buffer_tokens`` tokens accepted since the last full verification. A full verification
    runs every ``refresh_every`` rounds, when the buffer would overflow, or when an invariant
    fails; it re-encodes the buffered tokens against the whole cache. ``exact``: tokens accepted
    under the partial view are provisional until that full verification re-checks them (greedy
    only; the output then equals full verification's); otherwise SpecPV's approximate semantics.
    """

    block_size: int = Field(default=16, ge=2, le=256)
    sink_blocks: int = Field(default=2, ge=0, le=256)
    retrieval_blocks: int = Field(default=256, ge=0, le=8192)
    window_blocks: int = Field(default=8, ge=0, le=1024)
    buffer_tokens: int = Field(default=128, ge=8, le=4096)
    threshold: int = Field(default=4096, ge=0, le=MAX_CONTEXT_TOKENS)
    refresh_every: int = Field(default=32, ge=1, le=4096)
    exact: bool = True

    @model_validator(mode="after")
    def _budget(self) -> SpecPVSpec:
        view = (self.sink_blocks + self.retrieval_blocks + self.window_blocks) * self.block_size
        if view > MAX_CONTEXT_TOKENS:
            raise ValueError(f"the view's blocks hold {view} tokens, more than {MAX_CONTEXT_TOKENS}")
        return self

    @property
    def budget_tokens(self) -> int:
        """Tokens a partial view holds at most (sink + retrieval + window + one partial block + buffer)."""
        return (self.sink_blocks + self.retrieval_blocks + self.window_blocks + 1) * self.block_size + self.buffer_tokens


class FlatTree(Message):
    """A token tree in topological order.

    token_ids[i]      token of node i; node 0 is the root (newest committed token).
    parents[i]        index of node i's parent; parents[0] == -1 and 0 <= parents[i] < i.
    draft_logprobs[i] draft log-probability of token_ids[i] given its parent (0.0 for the root).
    child_dist_ids[i], child_dist_probs[i]
                      Only when the draft sampled (temperature > 0): the exact distribution the
                      children of node i were drawn i.i.d. from, as a sparse support (ids with
                      probabilities summing to 1). Empty lists for nodes without children.
                      Both outer lists are empty for a greedy tree.
    """

    token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_TREE_NODES)
    parents: list[int] = Field(min_length=1, max_length=MAX_TREE_NODES)
    draft_logprobs: list[float] = Field(default_factory=list, max_length=MAX_TREE_NODES)
    child_dist_ids: list[list[TokenId]] = Field(default_factory=list, max_length=MAX_TREE_NODES)
    child_dist_probs: list[list[float]] = Field(default_factory=list, max_length=MAX_TREE_NODES)

    @model_validator(mode="after")
    def _lengths(self) -> FlatTree:
        n = len(self.token_ids)
        if len(self.parents) != n:
            raise ValueError(f"parents has {len(self.parents)} entries for {n} nodes")
        if self.draft_logprobs and len(self.draft_logprobs) != n:
            raise ValueError(f"draft_logprobs has {len(self.draft_logprobs)} entries for {n} nodes")
        if len(self.child_dist_ids) != len(self.child_dist_probs):
            raise ValueError("child_dist_ids and child_dist_probs differ in length")
        if self.child_dist_ids and len(self.child_dist_ids) != n:
            raise ValueError(f"child distributions given for {len(self.child_dist_ids)} of {n} nodes")
        for ids, probs in zip(self.child_dist_ids, self.child_dist_probs):
            if len(ids) != len(probs):
                raise ValueError("a child distribution has ids and probs of different lengths")
            if len(ids) > MAX_DIST_SUPPORT:
                raise ValueError(f"a child distribution exceeds {MAX_DIST_SUPPORT} entries")
        return self

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def sampled(self) -> bool:
        return bool(self.child_dist_ids)


class CacheSync(Message):
    """Commit clause: keep the first base_len cached tokens, then append append_token_ids.

    After applying it, the worker's cache for the session holds exactly committed[:-1].

    prompt_len: how many leading tokens of committed are the request's prompt (0: not said). A
    target may prefill a long prompt on a faster attention path than the one it decodes with; it
    does so the same way every time (the same chunks from position 0, and only for the prompt),
    so a session stays equal to its own greedy decoding of that prompt, resends included.
    """

    base_len: int = Field(ge=0, le=MAX_CONTEXT_TOKENS)
    append_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_CONTEXT_TOKENS)
    prompt_len: int = Field(default=0, ge=0, le=MAX_CONTEXT_TOKENS + 1)

    @model_validator(mode="after")
    def _prompt_fits(self) -> CacheSync:
        if self.prompt_len > self.base_len + len(self.append_token_ids) + 1:
            raise ValueError(f"prompt_len {self.prompt_len} exceeds the {self.base_len + len(self.append_token_ids) + 1} "
                             "committed tokens")
        return self


class DraftRequest(Message):
    """``grammar``: the session's (as its VerifyRequests carry it), with a sync that names the
    prompt; a draft that takes grammars (SPECSPLIT_DRAFT_GRAMMAR) proposes only what it allows."""

    session_id: SessionId
    round: Round
    sync: CacheSync
    root: TokenId
    tree: TreeSpec = TreeSpec()
    sampling: SamplingSpec = SamplingSpec()
    grammar: GrammarSpec | None = None


class DraftReply(Message):
    """reused_nodes: tree nodes the draft already held from growing the previous round's tree
    (0 when it drafted from scratch)."""

    session_id: SessionId
    round: Round
    tree: FlatTree
    draft_ms: float = Field(default=0.0, ge=0.0)
    reused_nodes: int = Field(default=0, ge=0)


class GrowRequest(Message):
    """Sent to the draft worker while the target verifies round ``round`` (greedy sessions only):
    keep expanding that round's tree, most probable paths first, for at most ``budget_ms``
    (stopping early when other requests wait), so the next DraftRequest can start from the
    subtree under the real bonus token instead of from scratch. ``width`` nodes per forward.

    ``tree``: the tree the target verifies this round, when other proposers (prompt lookup's
    chains) added nodes the draft's tree lacks, rooted at the round's root; ``node_probs[i]``:
    the orchestrator's estimate that node i ends on the accepted path. The draft adds the
    missing nodes to its kept tree and grows them with its own, most probable first, so a
    round after an accepted chain can start from the grown tree too."""

    session_id: SessionId
    round: Round
    budget_ms: float = Field(gt=0.0, le=60_000.0)
    width: int = Field(default=4, ge=1, le=MAX_BRANCH)
    tree: FlatTree | None = None
    node_probs: list[Annotated[float, Field(ge=0.0, le=1.0)]] = Field(default_factory=list,
                                                                     max_length=MAX_TREE_NODES)
    return_tree: bool = False  # answer with the grown tree (GrowReply.tree) where the draft can

    @model_validator(mode="after")
    def _probs(self) -> GrowRequest:
        n = self.tree.num_nodes if self.tree is not None else 0
        if len(self.node_probs) != n:
            raise ValueError(f"node_probs has {len(self.node_probs)} entries for a tree of {n} nodes")
        return self


class GrownTree(Message):
    """A draft's kept tree of a greedy round after growth, all of it, so the orchestrator can
    re-root it at the verdict's bonus token itself and send the next round's tree to the target
    without waiting for the draft (the draft re-roots its own copy the same way meanwhile).

    prefix_len        committed tokens the draft holds; the root is the last of them.
    token_ids, parents, draft_logprobs
                      as FlatTree's (topological order, node 0 the root).
    expanded[i]       node i was forwarded: its children are the draft's (a node re-rooted at
                      must be).
    hinted[i]         node i came from another proposer (GrowRequest.tree): re-rooting drops it
                      and its subtree unless it is on the path re-rooted along.
    max_nodes, max_depth
                      the draft's tree limits: the next round's tree is the ``max_nodes - 1``
                      most probable nodes of the re-rooted tree within ``max_depth`` of the
                      request's TreeSpec clamped to these, as the draft's reply would be."""

    prefix_len: int = Field(ge=1, le=MAX_CONTEXT_TOKENS)
    token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_GROWN_NODES)
    parents: list[int] = Field(min_length=1, max_length=MAX_GROWN_NODES)
    draft_logprobs: list[float] = Field(min_length=1, max_length=MAX_GROWN_NODES)
    expanded: list[bool] = Field(min_length=1, max_length=MAX_GROWN_NODES)
    hinted: list[bool] = Field(min_length=1, max_length=MAX_GROWN_NODES)
    max_nodes: int = Field(ge=1, le=MAX_TREE_NODES)
    max_depth: int = Field(ge=1, le=MAX_TREE_DEPTH)

    @model_validator(mode="after")
    def _lengths(self) -> GrownTree:
        n = len(self.token_ids)
        for name in ("parents", "draft_logprobs", "expanded", "hinted"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} nodes")
        return self

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)


class GrowReply(Message):
    """tree: the grown tree when the request asked for it (``return_tree``) and the draft can
    give one its next DraftReply would re-root the same way (None: re-root through a
    DraftRequest)."""

    session_id: SessionId
    round: Round
    grown_nodes: int = Field(default=0, ge=0)
    grow_ms: float = Field(default=0.0, ge=0.0)
    tree: GrownTree | None = None


class VerifyRequest(Message):
    """specpv: partial verification of this session (None: full verification; the target keeps
    the partial view beside the session's cache). confirm: verify against the full cache this
    round whatever the spec says. confirmed_len (exact mode): how many tokens of committed full
    verification has confirmed; the rest (up to the root) are provisional, and the next full
    verification re-checks them (None: all are confirmed)."""

    session_id: SessionId
    round: Round
    sync: CacheSync
    tree: FlatTree
    sampling: SamplingSpec = SamplingSpec()
    specpv: SpecPVSpec | None = None
    confirm: bool = False
    confirmed_len: int | None = Field(default=None, ge=1, le=MAX_CONTEXT_TOKENS + 1)
    grammar: GrammarSpec | None = None  # constrained decoding (no SpecPV with it)
    # report the log-probabilities of the tokens the round commits, with this many alternatives
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # report the log-probabilities of the prompt's tokens after its first (committed[1:prompt_len],
    # sync.prompt_len) with this many alternatives: a sync from an empty cache that names the
    # prompt; the prompt is forwarded whole (no prefix cache)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _full_verification(self) -> VerifyRequest:
        held = self.grammar is not None or self.logprobs is not None or self.sampling.processed
        held = held or self.prompt_logprobs is not None
        if held and (self.specpv is not None or self.confirmed_len is not None):
            raise ValueError("a grammar, logprobs, prompt logprobs or penalties are verified against the full cache: "
                             "no specpv, no confirmed_len")
        if self.prompt_logprobs is not None:
            if self.sync.base_len or self.sync.prompt_len < 2:
                raise ValueError("prompt_logprobs needs a sync from an empty cache (base_len 0) that names a prompt "
                                 "of 2 or more tokens (prompt_len)")
            n = prompt_logprob_entries(self.sync.prompt_len, self.prompt_logprobs)
            if n > MAX_PROMPT_LOGPROB_ENTRIES:
                raise ValueError(f"the prompt's log-probabilities would hold {n} entries; at most "
                                 f"{MAX_PROMPT_LOGPROB_ENTRIES}")
        return self


class VerifyReply(Message):
    """accepted_token_ids excludes the root; committed += accepted_token_ids + [bonus_token_id].

    SpecPV: ``partial`` says the tree was verified against the partial view. Exact mode only:
    ``rollback_len`` (when set) first cuts committed to that many tokens (a provisional token the
    full verification disagreed with, and everything after it, is dropped; the bonus is the
    target's own token there), and ``confirmed_len`` is how many committed tokens (after this
    reply) full verification has confirmed: only those may be streamed. None: all of them.

    The forward that served the reply (what ``verify_ms`` measured): ``batch_tokens`` new tokens
    in it, every session's (0: not reported, as from a peer that predates the field) and
    ``batch_size`` sessions (1: this one alone).

    ``cached_tokens``: of this request's sync tokens, how many the worker copied from its prefix
    cache instead of forwarding (a session's first request; 0: none, or a peer that predates the
    field)."""

    session_id: SessionId
    round: Round
    accepted_token_ids: list[TokenId] = Field(max_length=MAX_TREE_NODES)
    accepted_nodes: list[int] = Field(default_factory=list, max_length=MAX_TREE_NODES)
    bonus_token_id: TokenId
    cache_len: int = Field(ge=0)
    verify_ms: float = Field(default=0.0, ge=0.0)
    partial: bool = False
    rollback_len: int | None = Field(default=None, ge=1, le=MAX_CONTEXT_TOKENS)
    confirmed_len: int | None = Field(default=None, ge=1, le=MAX_CONTEXT_TOKENS + 1)
    batch_tokens: int = Field(default=0, ge=0, le=MAX_BATCH_TOKENS)
    batch_size: int = Field(default=1, ge=1, le=MAX_BATCH_SESSIONS)
    cached_tokens: int = Field(default=0, ge=0, le=MAX_CONTEXT_TOKENS)
    # a grammar's session: the tokens the grammar forces after the bonus (llguidance's
    # fast-forward tokens), which the orchestrator proposes in the next round's tree
    forced_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_FORCED_TOKENS)
    logprobs: Logprobs | None = None  # asked for: of accepted_token_ids + [bonus_token_id]
    prompt_logprobs: Logprobs | None = None  # asked for: of committed[1:prompt_len] (the request's sync)

    @model_validator(mode="after")
    def _batch(self) -> VerifyReply:
        if self.logprobs is not None and len(self.logprobs) != len(self.accepted_token_ids) + 1:
            raise ValueError("logprobs must cover the accepted tokens and the bonus")
        # every session brings at least its root; this one at least its root and accepted nodes
        if self.batch_tokens and (self.batch_tokens < self.batch_size
                                  or self.batch_tokens <= len(self.accepted_token_ids)):
            raise ValueError(f"batch_tokens {self.batch_tokens} cannot hold {self.batch_size} sessions "
                             f"and {len(self.accepted_token_ids)} accepted nodes")
        return self


class EndSession(Message):
    session_id: SessionId


class Ack(Message):
    """Reply to EndSession (and any request that only needs an acknowledgement)."""

    session_id: SessionId = "-"
    existed: bool = False


class ErrorReply(Message):
    code: ErrorCode = Field(strict=False)  # an enum travels as its string value
    message: str = Field(default="", max_length=4096)
    retryable: bool = False
    session_id: str | None = None
    round: int | None = None

    @classmethod
    def of(cls, code: ErrorCode, message: str, **kw) -> ErrorReply:
        kw.setdefault("retryable", RETRYABLE_BY_DEFAULT[code])
        return cls(code=code, message=message[:4096], **kw)


class WorkerHello(Message):
    """First message of a worker to its router (READY). The router admits a worker only if
    service, vocab_size and tokenizer_hash match the workers it already has."""

    service: str = Field(min_length=1, max_length=64)
    model_id: str = Field(max_length=1024)
    vocab_size: int = Field(ge=1)
    tokenizer_hash: str = Field(max_length=128)
    pid: int = 0
    capacity: int = Field(default=1, ge=1)
    nonce: HexNonce = ""  # the worker's fresh nonce: the router proves the fleet secret over it


class ClientHello(Message):
    """A router client (orchestrator) opens its authentication: its fresh nonce (PROTOCOL.md,
    "Security model")."""

    nonce: HexNonce


class AuthChallenge(Message):
    """Router -> peer, answering a ClientHello or WorkerHello: the router's fresh nonce and its
    proof that it holds the fleet secret (HMAC over both nonces and the peer's identity)."""

    nonce: HexNonce
    proof: HexMac


class AuthResponse(Message):
    """Peer -> router: HMAC of the fleet secret over both nonces, the peer's identity and (a
    worker) its hello's body; the router answers HEARTBEAT (admitted) or ERROR (refused)."""

    mac: HexMac


class Heartbeat(Message):
    """Liveness beacon between a router and its workers (either direction), and the ping a client
    sends a router or an orchestrator. Answering a client's ping, a router names the tokenizer its
    admitted workers serve (``tokenizer_hash``, ``vocab_size``; empty / 0 while it has no live
    worker), and an orchestrator passes on what its target router said: a client that turns text
    into token ids (the HTTP API) checks that it holds the fleet's tokenizer."""

    sent_at: float = 0.0
    tokenizer_hash: str = Field(default="", max_length=128)
    vocab_size: int = Field(default=0, ge=0, lt=2**31)
    # an orchestrator's answer: prompt + new tokens it admits for one session (0: not said)
    max_session_tokens: int = Field(default=0, ge=0, le=MAX_CONTEXT_TOKENS * 2)
