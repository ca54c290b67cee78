"""The KV pool's size (issue 45): ``SPECSPLIT_*_KV_POOL_GB`` reaches the engines, and ``auto`` (the
default) sizes a pool from a CUDA card's free memory beside a reserve, and makes none on a CPU; on
CUDA an automatic pool serves greedy decoding through graphs equal to plain greedy."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from schemas import TreeSpec
from specsplit.engine.draft import DraftEngine
from specsplit.engine.kvpool import AUTO_RESERVE_BYTES, GB, PooledKV, auto_slots, pool_shape
from specsplit.engine.target import TargetEngine
from specsplit.local import generate
from tests.conftest import greedy_reference, tiny_model
from tests.test_kvpool import GREEDY, LIMITS, MARGIN


def test_settings_reach_the_engine_limits(monkeypatch):
    from specsplit.backends import CudaBackend
    from specsplit.config import WorkerSettings
    from specsplit.workers import engine_limits

    monkeypatch.setenv("SPECSPLIT_TARGET_KV_POOL_GB", "2.5")
    s = WorkerSettings()
    assert s.draft_kv_pool_gb == "auto" and s.target_kv_pool_gb == 2.5  # auto by default
    assert engine_limits(s, "target").kv_pool_gb == 2.5 and engine_limits(s, "draft").kv_pool_gb == "auto"
    assert engine_limits(s).kv_pool_gb == 0.0
    # graphs replay over a pool on CUDA: an automatic one too; never without a pool, nor off CUDA
    cuda = CudaBackend(torch.device("cuda"), cudnn_attention=True)  # constructs without a GPU
    assert engine_limits(s, "draft", cuda).graphs == "cuda" and engine_limits(s, "target", cuda).graphs == "cuda"
    assert engine_limits(s, "draft").graphs == "off"
    monkeypatch.setenv("SPECSPLIT_DRAFT_KV_POOL_GB", "0")
    assert engine_limits(WorkerSettings(), "draft", cuda).graphs == "off"
    for bad in ("-1", "lots", "AUTO"):
        monkeypatch.setenv("SPECSPLIT_TARGET_KV_POOL_GB", bad)
        with pytest.raises(ValueError, match="target_kv_pool_gb"):
            WorkerSettings()


def test_automatic_pool_sizing():
    """``auto``: the sessions a worker keeps, or what free memory holds beside a reserve of 10 %
    of the device (at least AUTO_RESERVE_BYTES), within half the card (a second worker on it, the
    other role of a one-GPU fleet, finds room); on a CPU no pool at all (caches grow)."""
    shape = pool_shape(tiny_model("qwen3", seed=1), 160, torch.float32)
    slot, small, big = shape.slot_bytes, 24 * GB, 141 * GB
    assert auto_slots(shape, 257, 20 * GB, big) == 257  # room for every session: what the worker keeps
    assert auto_slots(shape, 10**9, small - 15 * GB, small) == (small - 15 * GB - AUTO_RESERVE_BYTES) // slot  # floor
    assert auto_slots(shape, 10**9, big - 80 * GB, big) == (big - 80 * GB - round(0.1 * big)) // slot  # 10 %
    # at most half the card, whatever is free: a second worker started on it finds room
    assert auto_slots(shape, 10**9, small, small) == auto_slots(shape, 10**9, big, small) == (small // 2) // slot
    # a 24 GB card: the target loads 3 GB of weights and takes its pool, then the draft loads 1 GB
    first = auto_slots(shape, 10**9, small - 3 * GB, small)
    second = auto_slots(shape, 10**9, small - 3 * GB - first * slot - GB, small)
    assert first * slot <= small // 2 and second * slot >= 4 * GB
    # (uncapped, the target's pool would have left the draft less free memory than the reserve)
    assert small - 3 * GB - (small - 3 * GB - AUTO_RESERVE_BYTES) - GB < AUTO_RESERVE_BYTES
    assert auto_slots(shape, 64, AUTO_RESERVE_BYTES + 5 * slot + slot // 2, small) == 5  # whole slots only
    assert auto_slots(shape, 64, AUTO_RESERVE_BYTES + slot - 1, small) == 0  # not one: no pool
    assert auto_slots(shape, 64, GB, small) == 0  # less free than the reserve
    engine = TargetEngine(tiny_model("qwen3", seed=1), replace(LIMITS, kv_pool_gb="auto", graphs="static"))
    assert engine.kv_pool is None and engine.graphs is None
    assert not isinstance(engine.store.get_or_create("s").kv, PooledKV)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_automatic_pool_on_cuda_serves_through_graphs():
    """On CUDA ``auto`` allocates every session's slot where memory allows, and greedy decoding
    through its graphs equals plain greedy decoding."""
    model = tiny_model("qwen3", seed=1).to("cuda")
    free_before = torch.cuda.mem_get_info()[0]
    limits = replace(LIMITS, kv_pool_gb="auto", graphs="cuda")
    target, draft = TargetEngine(model, limits), DraftEngine(tiny_model("qwen3", seed=2).to("cuda"), limits)
    shape = pool_shape(model, LIMITS.max_session_tokens, torch.float32)
    want = auto_slots(shape, LIMITS.max_sessions + 1, free_before, torch.cuda.mem_get_info()[1]) - 1
    assert target.kv_pool is not None and target.kv_pool.slots == want == LIMITS.max_sessions
    assert target.graphs is not None and draft.graphs is not None
    prompt = [3, 17, 5, 9, 11]
    ref, gap = greedy_reference(model, prompt, 24)
    assert gap >= MARGIN, "a near-tie: pick another prompt"
    out = generate(draft.model, model, prompt, max_new_tokens=24, tree=TreeSpec(max_nodes=8, max_depth=4),
                   sampling=GREEDY, make_target_engine=lambda m, _: target, make_draft_engine=lambda m, _: draft)
    assert out == ref
    assert target.graphs.served > 0 and draft.graphs.served > 0
