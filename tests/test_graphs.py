"""Forwards at static shapes over the KV pool (issue 45, ``specsplit.engine.graphs``): on CUDA
replayed as captured graphs, on CPU the same bodies run eagerly ("static"). Either way they give
plain greedy decoding, tree logits equal to the eager forward's, batched verification equal to
each session alone on slots that held other sessions' K/V (a graph's buffers reused), and a
sampled run equal to the same run on eager forwards (fp32, tiny random models)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from specsplit.engine import kernels
from specsplit.engine.base import EngineLimits
from specsplit.engine.batch import Segment
from specsplit.engine.draft import DraftEngine
from specsplit.engine.graphs import TOKEN_BUCKETS, key_buckets, smallest
from specsplit.engine.kvpool import GB, pool_shape
from specsplit.engine.masks import TreeInputs, positions
from specsplit.engine.target import TargetEngine
from specsplit.orchestrator.state import SessionCursor
from specsplit.tree import validate_tree
from tests.conftest import FAMILIES, fp32_tolerance, on_device
from tests.test_kvpool import batched_rounds_equal_alone, generate_equals_greedy
from tests.test_tree_forward import random_parents

LIMITS = EngineLimits(max_sessions=8, max_session_tokens=600, max_tree_nodes=40, max_tree_depth=8)
MODES = [pytest.param("static", id="static"),
         pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
             not torch.cuda.is_available(), reason="no CUDA device here (CI and dev boxes are CPU-only)"))]


def graphed(limits: EngineLimits, model, slots: int, mode: str, body: str = "fused") -> EngineLimits:
    """``limits`` with a pool of ``slots`` session slots (+ the scratch slot) and graphs ``mode``
    replaying ``body``."""
    shape = pool_shape(model, limits.max_session_tokens, next(model.parameters()).dtype)
    return replace(limits, kv_pool_gb=(slots + 1) * shape.slot_bytes / GB, graphs=mode, graph_body=body)


def device_of(mode: str) -> torch.device:
    return torch.device("cuda" if mode == "cuda" else "cpu")


def test_buckets():
    assert [smallest(n, TOKEN_BUCKETS) for n in (1, 3, 16, 17, 64, 65)] == [1, 4, 16, 32, 64, None]
    assert key_buckets(600) == (256, 512, 600) and key_buckets(160) == (160,) and key_buckets(512) == (256, 512)


@pytest.mark.parametrize("body", ["triton_gemm", "triton", "fused", "transformers"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_logits_through_graphs_equal_eager(models, family, mode, body):
    """Linear tokens then trees, 1 to 40 new tokens, on caches crossing the key buckets: the
    graph body's logits and caches equal the eager forward's, whether the forward passes its
    visibility as a tensor or describes it on the host (``TreeInputs``: the compact inputs), and
    a padded bucket wrote nothing a session reads; for the fused body (the default), its Triton
    kernels and the model's own modules."""
    dev = device_of(mode)
    target = on_device(models[family][0], dev)
    eager = TargetEngine(target, replace(LIMITS, kv_pool_gb=graphed(LIMITS, target, 2, "off").kv_pool_gb))
    fast = TargetEngine(target, replace(graphed(LIMITS, target, 2, mode), graph_body=body))
    assert fast.graphs is not None and eager.graphs is None
    runs = body if not body.startswith("triton") or kernels.available(dev) is None else "fused"  # CUDA or interpreter
    assert fast.graphs.body == runs and (fast.graphs.fused is None) == (body == "transformers")
    rng = random.Random(3)
    tolerance = fp32_tolerance(dev)
    if runs == "triton_gemm":  # its GEMMs sum in their own order, the norm's scale applied after the product
        tolerance = {"rtol": tolerance["rtol"], "atol": 5 * tolerance["atol"]}
    for i, (linear, nodes, cached) in enumerate(((0, 1, 5), (2, 3, 200), (0, 9, 250), (5, 11, 300), (1, 32, 500),
                                                 (0, 40, 540), (3, 1, 7), (0, 16, 260))):
        prompt = [rng.randrange(128) for _ in range(cached)]
        parents = random_parents(nodes, rng)
        tokens = [rng.randrange(128) for _ in range(linear + nodes)]
        layout = validate_tree_layout(tokens[linear:], parents)
        tree = TreeInputs(cached, linear, layout.parents, layout.depths)
        out = []
        for engine in (eager, fast):
            kv = engine.store.get_or_create(f"s{i}").kv
            engine.forward_linear(kv, prompt)
            if engine is fast and i % 2:
                logits = engine.forward(kv, tokens, None, None, keep=linear + nodes, tree=tree)
            else:
                visible, pos = tree.on_device(dev)
                logits = engine.forward(kv, tokens, pos, visible, keep=linear + nodes)
            out.append((logits, kv))
        (want, kv_a), (got, kv_b) = out
        assert got.shape == want.shape == (linear + nodes, 128)
        torch.testing.assert_close(got, want, **tolerance)
        assert kv_a.length == kv_b.length == cached + linear + nodes
        for la, lb in zip(kv_a.layers, kv_b.layers):
            torch.testing.assert_close(lb.keys, la.keys, **tolerance)
            torch.testing.assert_close(lb.values, la.values, **tolerance)
    assert fast.graphs.served >= 8 and fast.graphs.describe()["failed"] == 0
    assert {key[3] for key in fast.graphs._graphs} == ({True, False} if mode == "cuda" else set())


def test_tree_inputs_match_the_device_masks():
    """The host's description of linear tokens + a tree gives the same positions and visibility
    as the device tensors an eager forward takes."""
    rng = random.Random(2)
    for linear, nodes, first in ((0, 1, 0), (3, 1, 5), (0, 12, 9), (4, 20, 31)):
        parents = random_parents(nodes, rng)
        layout = validate_tree_layout([1] * nodes, parents)
        tree = TreeInputs(first, linear, layout.parents, layout.depths)
        visible, pos = tree.on_device(torch.device("cpu"))
        assert tree.positions() == pos.tolist() and tree.tokens == linear + nodes
        assert visible[:, :first].all() and (tree.new_visibility() == visible[:, first:].numpy()).all()


def validate_tree_layout(tokens, parents):
    from schemas import FlatTree

    return validate_tree(FlatTree(token_ids=tokens, parents=parents), vocab_size=128, max_nodes=64, max_depth=64)


BODIES = ["triton_gemm", "triton", "fused"]  # the Triton kernels (their GEMMs too) and the fused body's torch ops


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("family", "body"), [*((f, "fused") for f in FAMILIES), ("qwen3", "triton"),
                                             ("qwen2", "triton_gemm")])
def test_generate_through_graphs_equals_plain_greedy(models, family, mode, body):
    """Draft and target engines on pools with graphs give the target's greedy decoding; a sampled
    run equals the same run on eager forwards. Through the Triton kernels for qwen3 (the family
    with the most of them: per-head norms) and with their GEMMs for qwen2 (q/k/v biases), as the
    interpreter runs them ~100x slower."""
    engines = []

    def on_pool(cls, model, limits):
        engines.append(cls(model, graphed(replace(limits, max_session_tokens=600), model, 1, mode, body)))
        return engines[-1]

    generate_equals_greedy(models, family, on_pool, device_of(mode), prompts=5)
    assert all(e.graphs.served > 0 for e in engines)


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_verify_through_graphs_equals_each_session_alone(models, family, mode, body):
    """Rounds of three sessions verified one at a time eagerly on growing caches and batched
    through graphs on slots that held other sessions' K/V: the same replies; the batches pad to
    four sessions (the scratch slot) and to the trees' token bucket."""
    dev = device_of(mode)
    target, draft_model = (on_device(m, dev) for m in models[family][:2])
    rng = random.Random(5)
    alone = TargetEngine(target, LIMITS)
    batched = TargetEngine(target, graphed(LIMITS, target, 3, mode, body))
    for i in range(3):  # every slot holds another session's K/V, then is freed
        kv = batched.store.get_or_create(f"old{i}").kv
        batched.forward_linear(kv, [rng.randrange(128) for _ in range(300)])
        batched.forward(kv, [1, 2, 3], torch.arange(300, 303, device=dev),
                        torch.ones(3, 303, dtype=torch.bool, device=dev).tril(300), keep=1)
        batched.store.end_session(f"old{i}")
    assert batched.kv_pool.free_slots == 3
    draft = DraftEngine(draft_model, LIMITS)
    cursors = {f"s{i}": SessionCursor([rng.randrange(128) for _ in range(rng.randrange(1, 40))]) for i in range(3)}
    served = batched.graphs.served
    accepted = batched_rounds_equal_alone(draft, alone, batched, cursors)
    assert accepted > 0 and batched.graphs.served >= served + 4  # round 0 prefills alone, then batches


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("mode", MODES)
def test_logits_outlive_the_next_forward_through_the_same_bucket(models, mode, body):
    """A forward's logits are the caller's: another forward through the same bucket (the same
    static buffers) leaves them as they were, in float32 too, for one session and for several."""
    dev = device_of(mode)
    target = on_device(models["llama"][0], dev)
    fast = TargetEngine(target, graphed(LIMITS, target, 4, mode, body))
    kvs = [fast.store.get_or_create(f"s{i}").kv for i in range(4)]
    for i, kv in enumerate(kvs):
        fast.forward_linear(kv, [(7 * i + j) % 128 for j in range(10)])

    def step(kv, token):
        tree = TreeInputs(kv.length, 1, [-1], [0])
        return Segment(kv, [token, token + 1], None, None, 2, tree)

    first = fast.forward_one(step(kvs[0], 3))
    kept = first.clone()
    fast.forward_one(step(kvs[1], 90))
    torch.testing.assert_close(first, kept, rtol=0, atol=0)
    pair = fast.forward_segments([step(kvs[2], 5), step(kvs[3], 60)])
    kept = [x.clone() for x in pair]
    fast.forward_segments([step(kvs[0], 17), step(kvs[1], 33)])
    for got, want in zip(pair, kept):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert fast.graphs.served >= 4


@pytest.mark.parametrize("mode", MODES)
def test_forwards_that_fit_no_bucket_run_eagerly(models, mode):
    """More new tokens than the largest bucket, attention kwargs, a cache past the last key
    bucket's room, scores past the runner's bound: eager forwards, the same logits as an engine
    without graphs."""
    dev = device_of(mode)
    target = on_device(models["qwen2"][0], dev)
    fast = TargetEngine(target, graphed(LIMITS, target, 1, mode))
    eager = TargetEngine(target, replace(LIMITS, kv_pool_gb=graphed(LIMITS, target, 1, "off").kv_pool_gb))
    rng = random.Random(1)
    prompt = [rng.randrange(128) for _ in range(max(TOKEN_BUCKETS) + 6)]  # one forward of 70 tokens
    tail = [rng.randrange(128) for _ in range(LIMITS.max_session_tokens - len(prompt) - 2)]
    out = []
    for engine in (eager, fast):
        kv = engine.store.get_or_create("s").kv
        first = engine.forward_linear(kv, prompt)
        engine.forward_linear(kv, tail, chunk=64)  # 64-token forwards: the last ones leave no room for 64
        last = engine.forward(kv, [5, 6], positions([0, 1], kv.length, dev),
                              torch.ones(2, kv.length + 2, dtype=torch.bool, device=dev).tril(kv.length), keep=2)
        out.append((first, last, kv.length))
    assert out[0][2] == out[1][2] == LIMITS.max_session_tokens
    for a, b in zip(out[0][:2], out[1][:2]):
        torch.testing.assert_close(b, a, **fp32_tolerance(dev))
    assert fast.graphs.served > 0  # the 64-token chunks that fit went through the buckets
    served, fast.graphs.max_scores = fast.graphs.served, 4 * 2 * 256 - 1  # heads x 2 tokens x 256 keys, less one
    got = []
    for engine in (eager, fast):  # scores past the bound: eagerly
        engine.store.end_session("s")
        kv = engine.store.get_or_create("s2").kv
        got.append(engine.forward(kv, [5, 6], positions([0, 1], 0, dev),
                                  torch.ones(2, 2, dtype=torch.bool, device=dev).tril(), keep=2))
    torch.testing.assert_close(got[1], got[0], **fp32_tolerance(dev))
    assert fast.graphs.served == served


@pytest.mark.parametrize("mode", MODES)
def test_reported_forward_times_leave_graph_captures_out(models, mode, monkeypatch):
    """A request whose forward captured its bucket's graph reports what its forwards cost, less
    the capture (a one-time cost, ~65 ms on the H200 against a replay of a few): the orchestrator's
    cost model prices each forward size from these times. On CPU, where nothing is captured, a
    slow capture that fails stands in (the forward then runs eagerly, as after any failed one)."""
    import time

    from tests.test_kvpool import first_request

    dev = device_of(mode)
    target = on_device(models["qwen2"][0], dev)
    engine = TargetEngine(target, graphed(LIMITS, target, 1, mode))
    runner = engine.graphs
    if mode == "static":
        runner.mode = "cuda"  # forwards now look for a captured graph, as on a GPU

        def slow_failed_capture(shape, inp):  # returns None: the capture failed
            time.sleep(0.25)

        monkeypatch.setattr(runner, "_capture", slow_failed_capture)
    t0 = time.perf_counter()
    reply = engine.handle(first_request("s", list(range(3, 23))))  # a 20-token forward: a new bucket
    wall_ms = (time.perf_counter() - t0) * 1e3
    assert runner.captures >= 1 and runner.capture_ms >= (250 if mode == "static" else 1)
    assert reply.verify_ms <= wall_ms - runner.capture_ms + 1.0, (reply.verify_ms, wall_ms, runner.capture_ms)
    assert reply.verify_ms > 0 and runner.capture_ms_since(t0) == runner.capture_ms
    assert runner.capture_ms_since(time.perf_counter()) == 0  # none since: the next request reports it all


@pytest.mark.parametrize("mode", MODES)
def test_warm_graphs_serve_the_first_forwards_without_a_capture(models, mode):
    """``GraphRunner.warm`` (a worker's start): one session's graphs up to a cache bucket are
    captured before any request (on CUDA; a CPU's static bodies have nothing to capture), and
    the first tree verified then captures nothing and equals the eager forward."""
    dev = device_of(mode)
    target = on_device(models["qwen2"][0], dev)
    fast = TargetEngine(target, graphed(LIMITS, target, 1, mode))
    warmed = fast.graphs.warm(compact=True, max_keys=512)
    assert warmed == (len(TOKEN_BUCKETS) * 2 if mode == "cuda" else 0) == fast.graphs.captures
    eager = TargetEngine(target, replace(LIMITS, kv_pool_gb=graphed(LIMITS, target, 1, "off").kv_pool_gb))
    tree = TreeInputs(100, 0, [-1, 0, 0, 1], [0, 1, 1, 2])
    out = []
    for engine in (eager, fast):
        kv = engine.store.get_or_create("s").kv
        engine.forward_linear(kv, list(range(100)), chunk=256)  # one eager forward: past every token bucket
        if engine is fast:
            out.append(engine.forward(kv, [5, 6, 7, 8], None, None, keep=4, tree=tree))
        else:
            visible, pos = tree.on_device(dev)
            out.append(engine.forward(kv, [5, 6, 7, 8], pos, visible, keep=4))
    torch.testing.assert_close(out[1], out[0], **fp32_tolerance(dev))
    assert fast.graphs.captures == warmed and fast.graphs.served == 1
