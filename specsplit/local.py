"""The in-process reference loop: draft -> verify rounds through the same engines the workers use.

``generate`` is the project's public Python entry point (outside checks call it directly) and
the baseline for what the transport costs.
"""

from __future__ import annotations

import math
import time

from schemas import DraftRequest, ErrorReply, GrammarSpec, GrowRequest, SamplingSpec, SpecPVSpec, TreeSpec, VerifyRequest
from specsplit.orchestrator.costmodel import SMALL_SYNC, CostModel, expanded_nodes
from specsplit.orchestrator.hints import growth_hint
from specsplit.orchestrator.state import Candidates, RoundStats, SessionCursor, plan_round, remaining_tree, root_only
from specsplit.engine.draft import DraftEngine
from specsplit.engine.base import EngineLimits
from specsplit.engine.target import TargetEngine


def generate(
    draft,
    target,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    tree: TreeSpec,
    sampling: SamplingSpec,
    stop_token_ids=(),
    stats: RoundStats | None = None,
    session_id: str = "local",
    grow_budget_ms: float = 0.0,
    make_target_engine=TargetEngine,
    make_draft_engine=DraftEngine,
    lookup_max_tokens: int = 0,
    lookup_min_ngram: int = 3,
    cost_model: CostModel | None = None,
    specpv: SpecPVSpec | None = None,
    grow_chains: bool = True,
    grammar: GrammarSpec | None = None,
    grammars=None,
    grammar_chains: bool = True,
    draft_grammar: bool = False,
) -> list[int]:
    """Speculative generation in one process. Returns exactly the new token ids (at most
    max_new_tokens; stops early only at a stop id, which is included). At temperature 0 the
    result equals plain greedy decoding of ``target``. ``grow_budget_ms`` > 0 (greedy only) grows
    each draft tree before it is verified, as the fleet does while the target verifies (here it
    runs in turn, so it exercises re-rooting rather than saving time), told the lookup nodes
    (``grow_chains``). ``make_target_engine(target,
    limits)`` builds the verifier (anything with ``handle(msg)``; the bench puts one in another
    process to measure what a process split alone costs; ``make_draft_engine(draft, limits)`` the
    drafter: the llama.cpp engines take a ``LlamaCppModel`` each). ``lookup_max_tokens`` > 0 (greedy)
    hangs prompt-lookup candidates under each tree's root, and ``cost_model`` chooses each greedy
    round's nodes, as the orchestrator does. ``specpv`` verifies long contexts against a partial
    KV view (None: full verification); in its exact mode only confirmed tokens are returned, and
    they equal full verification's. ``grammar`` constrains the output (the target's
    ``grammars``, a ``specsplit.engine.grammar.GrammarBook``, compiles it); at temperature 0 the
    result equals greedy decoding of ``target`` masked to the grammar; with ``lookup_max_tokens``
    > 0 (and ``grammar_chains``) each greedy round also proposes the tokens the grammar forces
    after its root, as the target reported them (the ``grammar`` proposer's chain); with
    ``draft_grammar`` the draft proposes only what the grammar allows (SPECSPLIT_DRAFT_GRAMMAR)."""
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    if max_new_tokens <= 0:
        return []
    need = len(prompt_ids) + max_new_tokens + tree.max_nodes + lookup_max_tokens + tree.branch * tree.max_depth + 8
    limits = EngineLimits(
        max_sessions=1,
        # one session, served in turn: the draft's may sit idle while the target prefills a
        # long prompt for minutes on a CPU, and must not expire meanwhile
        session_ttl_s=math.inf,
        max_session_tokens=need,
        max_tree_nodes=max(tree.max_nodes + max(0, lookup_max_tokens), 1),
        max_tree_depth=max(tree.max_depth, 1),
    )
    d_eng, t_eng = make_draft_engine(draft, limits), make_target_engine(target, limits)
    if grammars is not None:
        t_eng.grammars = grammars
        if draft_grammar:
            d_eng.grammars = grammars
    cur = SessionCursor(list(prompt_ids))
    stop, out, stats = set(int(s) for s in stop_token_ids), [], stats or RoundStats()
    exact = specpv is not None and specpv.exact
    rnd, forced = 0, []
    while True:
        t_round = time.perf_counter()
        confirm = exact and cur.must_confirm(out, len(prompt_ids), max_new_tokens, stop)
        spec = remaining_tree(tree, max_new_tokens - cur.produced(len(prompt_ids)))
        if cost_model is not None and sampling.greedy:
            spec = cost_model.draft_spec(spec)
        sync_tokens = len(cur.target_sync().append_token_ids)
        if confirm:  # the provisional tokens would end the generation: confirm them, draft nothing
            plan = Candidates(root_only(cur.committed[-1]))
        else:
            d_grammar = grammar if draft_grammar else None
            d_reply = d_eng.handle(DraftRequest(session_id=session_id, round=rnd,
                                                sync=cur.draft_sync(sampling.penalized or d_grammar is not None),
                                                root=cur.committed[-1], tree=spec, sampling=sampling, grammar=d_grammar))
            _raise_if_error(d_reply)
            cur.after_draft()
            stats.reused_rounds += d_reply.reused_nodes > 0
            plan = plan_round(d_reply.tree, cur.committed, spec, sampling, lookup_max_tokens=lookup_max_tokens,
                              lookup_min_ngram=lookup_min_ngram, cost=cost_model, sync_tokens=sync_tokens,
                              forced=forced if grammar_chains else ())
            if grow_budget_ms > 0 and sampling.greedy:
                hint, probs = growth_hint(plan, cost_model) if grow_chains else (None, [])
                _raise_if_error(d_eng.handle(GrowRequest(session_id=session_id, round=rnd, budget_ms=grow_budget_ms,
                                                         tree=hint, node_probs=probs)))
        verify_tree = plan.tree
        v_reply = t_eng.handle(VerifyRequest(session_id=session_id, round=rnd, sync=cur.target_sync(grammar is not None or sampling.penalized),
                                             tree=verify_tree, sampling=sampling, specpv=specpv, confirm=confirm,
                                             confirmed_len=cur.confirmed if exact else None, grammar=grammar))
        _raise_if_error(v_reply)
        forced = v_reply.forced_token_ids or []
        new = cur.apply_verify(v_reply)
        if cost_model is not None and plan.choice is not None:
            cost_model.observe_round(verify_tree, v_reply.accepted_nodes, sources=plan.sources)
            # not the prompt's prefill, nor a SpecPV partial round (as the orchestrator learns)
            if rnd > 0 and sync_tokens <= SMALL_SYNC and not v_reply.partial:
                wall_ms = (time.perf_counter() - t_round) * 1e3
                cost_model.observe_forward(sync_tokens + verify_tree.num_nodes, v_reply.verify_ms,
                                           v_reply.batch_tokens, v_reply.batch_size)
                cost_model.observe_overhead(max(0.0, wall_ms - v_reply.verify_ms))
                cost_model.observe_rate(len(new), wall_ms)
                if d_reply.reused_nodes == 0:
                    cost_model.observe_draft(expanded_nodes(d_reply.tree), d_reply.draft_ms)
        stats.add(verify_tree, v_reply, cur.rolled_back)
        rnd += 1
        if cur.take_confirmed(out, len(prompt_ids), max_new_tokens, stop):
            return out


def _raise_if_error(reply) -> None:
    if isinstance(reply, ErrorReply):
        raise RuntimeError(f"{reply.code.value}: {reply.message}")
