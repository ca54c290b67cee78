"""Tensors of the engine path are created on the engine's device.

Two checks that need no GPU:
- the model on the ``meta`` device: the engine path runs up to its first data-dependent step
  (the one host copy, which meta tensors cannot give), so any tensor built on the CPU and mixed
  into the computation raises a device mismatch first;
- on CPU, every tensor factory called from SpecSplit's engine code (torch.tensor, zeros, ones,
  arange, rand, ...) names its device: nothing is left to the CPU default.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from schemas import CacheSync, DraftRequest, FlatTree, GrowRequest, SamplingSpec, TreeSpec, VerifyRequest
from specsplit.engine.base import EngineLimits
from specsplit.engine.draft import DraftEngine
from specsplit.engine.target import TargetEngine
from specsplit.errors import SpecError
from specsplit.tree import DraftTree
from tests.conftest import tiny_model

LIMITS = EngineLimits(max_sessions=4, max_session_tokens=128, max_tree_nodes=16, max_tree_depth=6)
FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn,
             torch.randint, torch.eye, torch.linspace, torch.as_tensor}
META_COPY = "Cannot copy out of meta tensor"


class FactoryAudit(TorchFunctionMode):
    """Records factory calls made from specsplit's engine code without an explicit device."""

    def __init__(self):
        super().__init__()
        self.undeviced: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1)
            path = caller.f_code.co_filename
            if "/specsplit/" in path and "/tests/" not in path:
                self.undeviced.append(f"{func.__name__} at {path}:{caller.f_lineno}")
        return func(*args, **kwargs)


def meta_model():
    return tiny_model("qwen2", seed=4).to("meta")


def verify_request(sampling=SamplingSpec()):
    return VerifyRequest(session_id="m", round=0, sync=CacheSync(base_len=0, append_token_ids=[5, 6, 7, 8]),
                         tree=FlatTree(token_ids=[9, 3, 4, 5], parents=[-1, 0, 0, 1]), sampling=sampling)


def test_target_path_on_meta_reaches_its_host_copy():
    """Masks, positions, the forward and greedy verification all run on meta; the first failure
    is the verdict's one host copy, never a CPU tensor mixed in."""
    eng = TargetEngine(meta_model(), LIMITS)
    assert eng.device.type == "meta"
    with pytest.raises(SpecError, match=META_COPY) as info:
        eng.verify(verify_request())
    assert isinstance(info.value.__cause__, NotImplementedError)


def test_draft_path_on_meta_reaches_its_host_copy():
    eng = DraftEngine(meta_model(), LIMITS)
    req = DraftRequest(session_id="m", round=0, sync=CacheSync(base_len=0, append_token_ids=[5, 6, 7]), root=8,
                       tree=TreeSpec(max_nodes=8, max_depth=3, branch=2))
    with pytest.raises(SpecError, match=META_COPY) as info:
        eng.draft(req)
    assert isinstance(info.value.__cause__, NotImplementedError)


def test_draft_tree_forward_and_compaction_on_meta():
    """The draft's tree forward (mask scattered from ancestor slots) and the KV compaction index."""
    eng = DraftEngine(meta_model(), LIMITS)
    kv = eng.store.get_or_create("m").kv
    eng.drive(eng._root_forward(kv, CacheSync(base_len=0, append_token_ids=[5, 6, 7]), 8))
    g = DraftTree(8, kv.length, 2)
    a, b = g.add_children(0, [3, 4], [-0.1, -0.2])
    rows = eng.forward_one(eng._nodes_segment(kv, g, [a, b], [kv.length, kv.length]))  # [2, V]
    g.slot[a], g.slot[b] = kv.length - 2, kv.length - 1
    c = g.add(a, 9, -0.3)
    rows = eng.forward_one(eng._nodes_segment(kv, g, [c], [kv.length - 1]))
    assert rows.device.type == "meta" and rows.shape[0] == 1
    kv.compact([4, 6], 4)
    assert kv.length == 6 and kv.layers[0].keys.device.type == "meta"


@pytest.mark.parametrize("greedy", [True, False])
def test_engine_factories_name_their_device(greedy):
    """Draft, grow and verify requests on CPU: every tensor factory in specsplit's code passes
    ``device=``, so the same code builds its tensors on CUDA or MPS."""
    model = tiny_model("qwen2", seed=4)
    d_eng, t_eng = DraftEngine(model, LIMITS), TargetEngine(model, LIMITS)
    sampling = SamplingSpec() if greedy else SamplingSpec(temperature=0.9, top_p=0.95, seed=3)
    sync = CacheSync(base_len=0, append_token_ids=[5, 6, 7])
    audit = FactoryAudit()
    with audit:
        d = d_eng.handle(DraftRequest(session_id="f", round=0, sync=sync, root=8, sampling=sampling,
                                      tree=TreeSpec(max_nodes=8, max_depth=3, branch=2)))
        if greedy:
            d_eng.handle(GrowRequest(session_id="f", round=0, budget_ms=60_000, width=2))
        v = t_eng.handle(VerifyRequest(session_id="f", round=0, sync=sync, tree=d.tree, sampling=sampling))
        committed = [5, 6, 7, 8, *v.accepted_token_ids, v.bonus_token_id]
        d_eng.handle(DraftRequest(session_id="f", round=1, sampling=sampling, root=committed[-1],
                                  sync=CacheSync(base_len=4, append_token_ids=committed[4:-1]),
                                  tree=TreeSpec(max_nodes=8, max_depth=3, branch=2)))
    assert type(v).__name__ == "VerifyReply"
    assert not audit.undeviced, audit.undeviced


@pytest.mark.parametrize("backend_name", ["cpu", "cuda", "mps", "llamacpp"])
def test_worker_loaded_line_for_every_backend(backend_name):
    """The line a worker logs once its model is loaded, for each backend: a GPU backend's
    description names its device too, which once made every CUDA worker die at startup
    (``got multiple values for keyword argument 'device'``), seen on an H200."""
    from types import SimpleNamespace

    from specsplit.backends import CpuBackend, CudaBackend, LlamaCppBackend, MpsBackend
    from specsplit.workers import log_loaded

    class Recorder:  # a logger's call as structlog receives it (whatever logging earlier tests set up)
        def __init__(self):
            self.lines = []

        def info(self, event, **fields):
            self.lines.append({"event": event, **fields})

    backend = {"cpu": lambda: CpuBackend(1, 2), "cuda": lambda: CudaBackend(torch.device("cuda:0")),
               "mps": lambda: MpsBackend(torch.device("mps")), "llamacpp": lambda: LlamaCppBackend(1, 2)}[backend_name]()
    device = getattr(backend, "device", torch.device("cpu"))
    engine = SimpleNamespace(device=device, dtype=torch.bfloat16, backend=backend)
    log = Recorder()
    log_loaded(log, engine, identity="target-0", inline=True)
    (line,) = [e for e in log.lines if e["event"] == "worker_loaded"]
    assert line["backend"] == backend_name and line["device"] == str(device) and line["dtype"] == "bfloat16"
    assert line["identity"] == "target-0" and line["inline"] is True


def test_cuda_backend_keeps_attention_off_cudnn(monkeypatch):
    """A CUDA worker's backend turns torch's cuDNN attention off unless the setting allows it:
    with a tree's additive mask cuDNN builds a plan for every new key length (~70 ms each on an
    H200, and a session's cache has a new length every round). Needs no GPU: it is a switch."""
    from specsplit.backends import build_backend
    from specsplit.config import WorkerSettings

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        backend = build_backend("target", "cuda:0", WorkerSettings())
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert backend.describe()["cudnn_attention"] is False
        torch.backends.cuda.enable_cudnn_sdp(True)
        monkeypatch.setenv("SPECSPLIT_CUDA_CUDNN_ATTENTION", "1")
        backend = build_backend("draft", "cuda:0", WorkerSettings())
        assert torch.backends.cuda.cudnn_sdp_enabled() and backend.describe()["cudnn_attention"] is True
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_cuda_backend_runs_trees_through_grouped_matmuls(monkeypatch, kv_heads):
    """A CUDA worker's model attends through ``gqa_attention`` (grouped or not): for a few queries
    sdpa's masked kernel occupies one block of threads per head, a tenth of an H200 at 64K keys.
    Decode steps and trees over long caches take the grouped matmuls there while their scores stay
    bounded; longer forwards and short caches, and every forward on the CPU above 16 queries,
    stay on sdpa. The setting keeps sdpa."""
    from specsplit.backends import build_backend
    from specsplit.config import WorkerSettings
    from transformers import AutoModelForCausalLM

    from specsplit.models.attention import ACCEL_MAX_SCORES, GQA_ATTENTION, grouped
    from tests.conftest import tiny_config

    def tiny(kv_heads):
        cfg = tiny_config("llama")
        cfg.num_key_value_heads = kv_heads
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        model = tiny(kv_heads)
        assert model.config._attn_implementation == "sdpa"
        backend = build_backend("target", "cuda:0", WorkerSettings())
        assert backend.prepare(model) is model and model.config._attn_implementation == GQA_ATTENTION
        assert backend.describe()["attention"] == GQA_ATTENTION
        monkeypatch.setenv("SPECSPLIT_CUDA_GROUPED_ATTENTION", "0")
        model = tiny(kv_heads)
        build_backend("target", "cuda:0", WorkerSettings()).prepare(model)
        assert model.config._attn_implementation == "sdpa"
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)

    def query(m, heads=12, device="meta"):
        return torch.empty(1, heads, m, 128, device=device)

    assert grouped(query(1), 8192) and grouped(query(17), 65536) and grouped(query(64), 65536)
    assert not grouped(query(17), 8191)  # a short cache: sdpa's one kernel costs fewer launches
    assert not grouped(query(65), 65536)  # a prompt chunk: sdpa's kernel parallelizes over its queries
    assert not grouped(query(64, heads=64), ACCEL_MAX_SCORES // (64 * 64) + 1)  # scores too large
    assert grouped(query(16, device="cpu"), 65536) and not grouped(query(17, device="cpu"), 64)

    # on an accelerator (here: meta tensors, shapes only) both paths give [B, M, Hq, D]
    from specsplit.models.attention import gqa_attention

    layer = model.model.layers[0].self_attn
    for m, length in ((17, 100), (17, 8192), (1, 8192), (65, 8192)):
        q, kv = query(m, heads=4, device="meta")[..., :16], torch.empty(1, kv_heads, length, 16, device="meta")
        out, _ = gqa_attention(layer, q, kv, kv, torch.zeros(1, 1, m, length, device="meta"))
        assert out.shape == (1, m, 4, 16)


@pytest.mark.parametrize("length", [1023, 1024, 3000, 4096])
def test_values_weighted_in_chunks_equal_one_product(length):
    """``weighted_values`` with chunks (the accelerators' grouped attention) equals one matmul."""
    from specsplit.models.attention import weighted_values

    g = torch.Generator().manual_seed(length)
    probs = torch.rand(1, 2, 17, length, generator=g, dtype=torch.float64).softmax(-1)
    value = torch.randn(1, 2, length, 8, generator=g, dtype=torch.float64)
    want = torch.matmul(probs, value)
    for chunk in (0, 256, 1024, 5000):
        got = weighted_values(probs, value, chunk)
        assert got.shape == want.shape and got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
