"""Target engine: apply the sync, ONE forward over the whole tree, verify, compact the cache."""

from __future__ import annotations

import time

import torch

from schemas import Message, VerifyReply, VerifyRequest
from specsplit.engine.base import Engine
from specsplit.engine.masks import linear_then_tree, positions
from specsplit.engine.sampling import make_generator
from specsplit.engine.verify import verify_greedy, verify_sampling
from specsplit.tree import validate_tree


class TargetEngine(Engine):
    role = "target"

    def _dispatch(self, msg: Message) -> Message:
        if isinstance(msg, VerifyRequest):
            return self.verify(msg)
        return super()._dispatch(msg)

    def verify(self, req: VerifyRequest) -> VerifyReply:
        t0 = time.perf_counter()
        layout = validate_tree(
            req.tree,
            vocab_size=self.vocab_size,
            max_nodes=self.limits.max_tree_nodes,
            max_depth=self.limits.max_tree_depth,
        )
        sync = req.sync
        session = self.open_session(req.session_id, req.round, sync, layout.num_nodes)
        with session.lock:
            self.check_locked(session, req.round, sync)

            def run():
                kv, dev = session.kv, self.device
                kv.crop_to(sync.base_len)
                s = len(sync.append_token_ids)
                start = sync.base_len + s  # position of the root
                n = layout.num_nodes
                visible = torch.ones(s + n, start + n, dtype=torch.bool, device=dev)  # [S+N, P+S+N]
                visible[:, sync.base_len:] = linear_then_tree(s, layout.parents, dev)
                pos = torch.cat([torch.arange(sync.base_len, start, dtype=torch.long, device=dev),
                                 positions(layout.depths, start, dev)])  # [S+N]
                logits = self.forward(kv, [*sync.append_token_ids, *req.tree.token_ids], pos, visible, keep=n)  # [N, V]
                if req.sampling.greedy:
                    verdict = verify_greedy(req.tree, layout, logits, visible[s:, start:])
                else:
                    g = make_generator(req.sampling.seed, req.round, "target", dev)
                    verdict = verify_sampling(req.tree, layout, logits, req.sampling, g)
                kv.compact([start + i for i in verdict.path], start)
                session.last_round = req.round
                return verdict

            verdict = self.guarded(session, run)
            cache_len = session.kv.length
        accepted = verdict.path[1:]
        return VerifyReply(
            session_id=req.session_id,
            round=req.round,
            accepted_token_ids=[req.tree.token_ids[i] for i in accepted],
            accepted_nodes=accepted,
            bonus_token_id=verdict.bonus,
            cache_len=cache_len,
            verify_ms=self.elapsed_ms(t0),
        )
