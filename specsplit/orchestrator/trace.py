"""Round traces: one JSON line per round an orchestrator runs (``SPECSPLIT_TRACE_FILE``).

A round's line holds what its proposers offered (the merged tree before the cost model's choice:
tokens, parents, the draft's log-probabilities and each chain node's source), what the cost
model kept and expected, the verdict (accepted nodes, tokens), the measured draft, verify and
round milliseconds and the verify forward's batch. A session's last line holds its output, so a
greedy session's trace says which node of any round's merged tree the target would accept (its
path spells the output there), whatever subset was verified. ``specsplit.orchestrator.replay``
runs the cost model over such traces (tests/data holds some from the real pair); the GPU replay
runs the same tree shapes on a device.

The file is bounded (``max_bytes``): past it, rounds are no longer written (one warning).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from specsplit.logs import get_logger

TRACE_VERSION = 1
PROMPT_KEPT = 8192  # a session record keeps prompts of up to this many tokens (long-context ones only their length)


def tree_record(tree, sources: dict[int, tuple[str, int]]) -> dict[str, Any]:
    return {"token_ids": list(tree.token_ids), "parents": list(tree.parents),
            "draft_logprobs": [round(x, 5) for x in tree.draft_logprobs] if tree.draft_logprobs else [],
            "sources": [[i, name, key] for i, (name, key) in sorted(sources.items())]}


class TraceWriter:
    def __init__(self, path: str | Path, *, max_bytes: int, header: dict[str, Any] | None = None) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._f = open(self.path, "a", encoding="utf-8", buffering=1)  # a line at a time
        self._bytes = self.path.stat().st_size
        self._full = False
        self.log = get_logger("specsplit.orchestrator")
        self._write({"kind": "header", "version": TRACE_VERSION, "time": time.time(), "pid": os.getpid(),
                     **(header or {})})

    def _write(self, record: dict[str, Any]) -> None:
        if self._full:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        if self._bytes + len(line) > self.max_bytes:
            self._full = True
            self.log.warning("trace_full", path=str(self.path), max_bytes=self.max_bytes)
            return
        self._f.write(line)
        self._bytes += len(line)

    def round(self, actor, rp, cands, reply, timing, clean: bool) -> None:
        """One verified round of ``actor`` (a SessionActor)."""
        merged = cands.merged or cands.tree
        drafted = cands.drafted
        self._write({
            "kind": "round", "session": actor.sid, "round": rp.rnd, "prompt_len": len(actor.req.prompt_token_ids),
            "context_len": rp.context_len, "sync_tokens": rp.sync_tokens, "plain": rp.plain, "confirm": rp.confirm,
            "greedy": actor.sampling.greedy, "max_depth": rp.spec.max_depth, "min_path_prob": rp.spec.min_path_prob,
            "merged": tree_record(merged, cands.merged_sources),
            "drafted_nodes": drafted.tree.num_nodes if drafted is not None else 0,
            "chosen": list(cands.choice.nodes) if cands.choice is not None else None,
            "expected_tokens": cands.choice.expected_tokens if cands.choice is not None else None,
            "expected_ms": cands.choice.expected_ms if cands.choice is not None else None,
            "verified_nodes": cands.tree.num_nodes, "accepted_nodes": list(reply.accepted_nodes),
            "accepted_token_ids": list(reply.accepted_token_ids), "bonus_token_id": reply.bonus_token_id,
            "draft_ms": round(timing.draft_ms, 3), "grow_ms": round(timing.grow_ms, 3),
            "verify_ms": round(timing.verify_ms, 3), "wall_ms": round(timing.wall_ms, 3),
            "propose_ms": round(timing.propose_ms, 3), "verify_rpc_ms": round(timing.verify_rpc_ms, 3),
            "reused": drafted.reused if drafted is not None else 0,
            "rerooted_here": drafted.rerooted_here if drafted is not None else False,
            "batch_size": reply.batch_size, "batch_tokens": reply.batch_tokens, "partial": reply.partial,
            "clean": clean, "active_sessions": actor.cost.active_sessions if actor.cost is not None else None,
        })

    def session(self, actor, done) -> None:
        prompt = actor.req.prompt_token_ids
        self._write({"kind": "session", "session": actor.sid, "prompt_len": len(prompt),
                     # what a draft replayed against the output needs (``specsplit bench growth``)
                     **({"prompt": list(prompt)} if len(prompt) <= PROMPT_KEPT else {}),
                     "max_new_tokens": actor.req.max_new_tokens, "greedy": actor.sampling.greedy,
                     "output": list(done.token_ids), "finish": done.finish_reason, "rounds": done.rounds,
                     "elapsed_ms": round(done.elapsed_ms, 3), "predicted_tok_s": done.predicted_tok_s})

    def close(self) -> None:
        self._f.close()
