"""Oracles for the tree forward and the KV compaction (fp32, tiny random models)."""

from __future__ import annotations

import random

import pytest
import torch

from specsplit.engine.base import Engine, EngineLimits
from specsplit.engine.kvcache import SessionKV
from specsplit.engine.masks import causal, linear_then_tree, positions
from specsplit.tree import depths_of, root_to_leaf_paths
from tests.conftest import FAMILIES, fp32_tolerance, on_device, tiny_model


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def prefill(engine: Engine, prefix: list[int]) -> SessionKV:
    kv = engine.store.get_or_create("s").kv
    if prefix:
        t = len(prefix)
        engine.forward(kv, prefix, torch.arange(t, device=engine.device), causal(t, 0, engine.device), keep=1)
    return kv


def tree_logits(engine: Engine, kv: SessionKV, tokens, parents) -> torch.Tensor:
    p, dev = kv.length, engine.device
    vis = torch.ones(len(tokens), p + len(tokens), dtype=torch.bool, device=dev)
    vis[:, p:] = linear_then_tree(0, parents, dev)
    pos = positions(depths_of(parents), p, dev)
    return engine.forward(kv, tokens, pos, vis, keep=len(tokens))


@torch.no_grad()
def sequential_logits(model, ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(torch.tensor([ids], device=device)).logits[0].float()  # [T, V]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_matches_each_path(family, attn, device):
    check_each_path(on_device(tiny_model(family, seed=1, attn=attn), device), device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI and dev boxes are CPU-only)")
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_forward_matches_each_path_through_grouped_matmuls_cuda(family, monkeypatch):
    """CUDA workers attend for trees over long caches through grouped matmuls with the values
    in chunks (``specsplit.models.attention``); here its thresholds are lowered so that a tiny
    model's short caches take that path."""
    from specsplit.models import attention

    monkeypatch.setattr(attention, "ACCEL_MIN_KEYS", 0)
    monkeypatch.setattr(attention, "ACCEL_VALUE_CHUNK", 8)
    check_each_path(on_device(tiny_model(family, seed=1), "cuda"), torch.device("cuda"))


def check_each_path(model, device) -> None:
    rng = random.Random(7)
    for offset in (0, 1, 9, 33):
        for n in (1, 2, 7, 23, 64):
            engine = Engine(model, EngineLimits(max_session_tokens=256))
            prefix = [rng.randrange(128) for _ in range(offset)]
            kv = prefill(engine, prefix)
            parents = random_parents(n, rng)
            tokens = [rng.randrange(128) for _ in range(n)]
            logits = tree_logits(engine, kv, tokens, parents)  # [N, V]
            assert kv.length == offset + n
            for path in root_to_leaf_paths(parents):
                ref = sequential_logits(model, prefix + [tokens[i] for i in path])[offset:]
                torch.testing.assert_close(logits[path], ref, **fp32_tolerance(device))


@pytest.mark.parametrize("family", FAMILIES)
def test_compaction_equals_sequential_cache(family, device):
    model = on_device(tiny_model(family, seed=2), device)
    rng = random.Random(3)
    for trial in range(6):
        engine = Engine(model, EngineLimits(max_session_tokens=256, cache_chunk=16))
        prefix = [rng.randrange(128) for _ in range(rng.randrange(1, 40))]
        kv = prefill(engine, prefix)
        n = rng.randrange(2, 40)
        parents = random_parents(n, rng)
        tokens = [rng.randrange(128) for _ in range(n)]
        tree_logits(engine, kv, tokens, parents)
        path = rng.choice(root_to_leaf_paths(parents))
        path = path[: rng.randrange(1, len(path) + 1)]
        kv.compact([len(prefix) + i for i in path], len(prefix))
        ref_engine = Engine(model, EngineLimits(max_session_tokens=256))
        ref = prefill(ref_engine, prefix + [tokens[i] for i in path])
        assert kv.length == ref.length == len(prefix) + len(path)
        for a, b in zip(kv.layers, ref.layers):
            torch.testing.assert_close(a.keys, b.keys, **fp32_tolerance(device))
            torch.testing.assert_close(a.values, b.values, **fp32_tolerance(device))
        # and the compacted cache continues exactly like the sequential one
        nxt = [rng.randrange(128)]  # and the compacted cache continues like the sequential one
        la = tree_logits(engine, kv, nxt, [-1])
        lb = tree_logits(ref_engine, ref, nxt, [-1])
        torch.testing.assert_close(la, lb, **fp32_tolerance(device))


def test_cache_grows_in_chunks_and_respects_limit():
    from specsplit.engine.kvcache import CacheFull

    model = tiny_model("llama", seed=3)
    engine = Engine(model, EngineLimits(max_session_tokens=40, cache_chunk=16))
    kv = prefill(engine, list(range(10)))
    assert kv.layers[0]._k.shape[2] == 16  # one chunk, not the model's context
    tree_logits(engine, kv, [1] * 10, list(range(-1, 9)))
    assert kv.layers[0]._k.shape[2] == 32
    assert kv.nbytes == sum(layer.nbytes for layer in kv.layers) > 0
    kv.crop_to(5)  # O(1) rollback keeps the buffer
    assert kv.length == 5 and kv.layers[0]._k.shape[2] == 32
    with pytest.raises(CacheFull):
        kv.layers[0].update(*(torch.zeros(1, 2, 40, 16),) * 2)


def test_cache_grows_geometrically_and_reserves_little():
    """A session that decodes a token at a time holds at most an eighth (and a chunk) more than it
    wrote, and its buffer is reallocated (copied) O(log) times, not once per chunk; a short one
    reserves one chunk; the limit holds exactly. Fails with fixed 16-token steps (313 copies)."""
    from specsplit.engine.kvcache import ChunkedLayer, grown_capacity

    layer = ChunkedLayer(max_len=6000, chunk=16)
    copies, cap, worst = 0, 0, 0.0
    for n in range(1, 5001):
        layer.update(torch.full((1, 2, 1, 4), float(n)), torch.full((1, 2, 1, 4), -float(n)))
        copies += layer._k.shape[2] != cap  # a new buffer, the cache copied into it
        cap = layer._k.shape[2]
        assert n <= cap <= max(16, n + n // 8 + 16), (n, cap)
        worst = max(worst, cap / n) if n >= 128 else worst
    assert copies <= 45, copies
    assert worst <= 1.25
    written = torch.arange(1, 5001, dtype=torch.float32)[None, None, :, None].expand(1, 2, 5000, 4)
    assert torch.equal(layer.keys, written) and torch.equal(layer.values, -written)  # every copy kept them
    assert grown_capacity(16, 17, 16, 6000) == 32 and grown_capacity(5984, 5990, 16, 6000) == 6000
    short = ChunkedLayer(max_len=6000, chunk=16)
    short.update(torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4))
    assert short._k.shape[2] == 16
