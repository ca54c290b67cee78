"""Shared fixtures: tiny random models of several families, built in-process (fp32, CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the processes the tests start (fleets included) read their fleet secret from here, not ~/.cache
os.environ.setdefault("SPECSPLIT_FLEET_SECRET_FILE",
                      os.path.join(__import__("tempfile").mkdtemp(prefix="specsplit-test-"), "fleet.secret"))

import pytest
import torch

torch.set_num_threads(1)

if not torch.cuda.is_available():  # Triton's kernels (specsplit.engine.kernels) run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")


FAMILIES = ("llama", "qwen2", "qwen3")


def _device_param(name: str):
    if name == "cuda":
        marks = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI and dev boxes are CPU-only)")
    elif name == "mps":
        marks = pytest.mark.skipif(not torch.backends.mps.is_available(), reason="no MPS device here")
    else:
        marks = ()
    return pytest.param(name, marks=marks, id=name)


DEVICE_PARAMS = [_device_param(d) for d in ("cpu", "cuda", "mps")]


def wait_until(pred, timeout_s: float = 20.0, what: str = "condition", poll_s: float = 0.05):
    """pred()'s first truthy value within ``timeout_s``, or TimeoutError naming ``what``."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    raise TimeoutError(what)


async def async_wait_until(pred, timeout_s: float = 20.0, what: str = "condition", poll_s: float = 0.005):
    """wait_until for a coroutine: yields to the event loop between tries (``timeout_s`` is a
    hang guard, never the thing tested)."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        await asyncio.sleep(poll_s)
    raise TimeoutError(what)


class KillAfterTokens:
    """A stream callback (``on_tokens``) for fault injection on an event: once ``after`` tokens
    have arrived it calls ``kill()`` (from inside the stream, so the run is certainly under way
    whatever the machine's speed) and sets ``done``; ``streamed`` counts every token."""

    def __init__(self, kill, after: int) -> None:
        import asyncio

        self.kill, self.after, self.streamed = kill, after, 0
        self.done = asyncio.Event()

    def __call__(self, tokens: list[int]) -> None:
        self.streamed += len(tokens)
        if self.streamed >= self.after and not self.done.is_set():
            self.kill()
            self.done.set()


def fp32_tolerance(device) -> dict:
    """assert_close tolerances for fp32 logits of two forwards of different shapes: CPU's kernels
    agree within 2e-5; CUDA's SDPA picks different fp32 kernels for a masked tree and a causal
    sequence (an H200 differed by 2.3e-5 on one of 512 logits of a tiny model)."""
    return dict(atol=2e-5, rtol=1e-4) if torch.device(device).type == "cpu" else dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(params=DEVICE_PARAMS)
def device(request) -> torch.device:
    """The device the engine oracles run on: CPU everywhere, CUDA / MPS where present."""
    return torch.device(request.param)


def on_device(model, device):
    """``model`` itself on CPU, a copy of it on another device (fixtures stay on CPU) as that
    device's worker prepares it (CUDA: decode steps and trees through grouped matmuls)."""
    import copy

    device = torch.device(device)
    if device.type == "cpu":
        return model
    moved = copy.deepcopy(model).to(device)
    if device.type == "cuda":
        from specsplit.backends import CudaBackend

        moved = CudaBackend(device).prepare(moved)
    return moved


def tiny_config(family: str, vocab: int = 128, hidden: int = 64, layers: int = 2):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(head_dim=hidden // 4, **common)
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, scale: float = 0.3, attn: str = "sdpa", **kw):
    """A random causal LM whose matrices are drawn with std ``scale`` (large enough that greedy
    logits are rarely near-ties)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **kw)
    cfg._attn_implementation = attn
    return randomized(AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval(), seed, scale)


def randomized(model, seed: int, scale: float):
    """``model`` with every matrix drawn with std ``scale`` from a generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def perturbed(model, seed: int, noise: float):
    """A copy of ``model`` with Gaussian noise on every matrix: a draft that agrees often."""
    import copy

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=g) * noise)
    return out


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int, margin: float = 1e-3):
    """Plain greedy decoding with full re-forwards (no cache). Returns (tokens, min top1-top2 gap)."""
    ids = list(prompt)
    out, gap = [], float("inf")
    device = next(model.parameters()).device
    for _ in range(n):
        logits = model(torch.tensor([ids], device=device)).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        gap = min(gap, float(top[0] - top[1]))
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
    return out, gap


MARGIN_DEFAULT = 1e-3  # a greedy step whose top-2 logits are closer than this is a near-tie


@torch.no_grad()
def greedy_cached(model, prompt: list[int], n: int, chunk: int = 1024):
    """Plain greedy decoding of ``model`` with its own KV cache (transformers' DynamicCache; the
    prompt prefilled in chunks), for long prompts. Returns (tokens, min top1-top2 gap)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache, ids = DynamicCache(), torch.tensor([prompt], device=device)
    for a in range(0, len(prompt), chunk):
        logits = model(input_ids=ids[:, a:a + chunk], past_key_values=cache, use_cache=True).logits[0, -1].float()
    out, gap = [], float("inf")
    for _ in range(n):
        top = torch.topk(logits, 2).values
        gap = min(gap, float(top[0] - top[1]))
        out.append(int(logits.argmax()))
        logits = model(input_ids=torch.tensor([[out[-1]]], device=device), past_key_values=cache,
                       use_cache=True).logits[0, -1].float()
    return out, gap


@pytest.fixture(scope="session")
def models():
    """{family: (target, often-agreeing draft, rarely-agreeing draft)}"""
    out = {}
    for i, fam in enumerate(FAMILIES):
        target = tiny_model(fam, seed=10 + i)
        out[fam] = (target, perturbed(target, seed=100 + i, noise=0.004), tiny_model(fam, seed=200 + i))
    return out


# The files that take minutes (the image build and the manifests' fleet; the honcho kill tests)
# are collected first, so under ops/test.sh's xdist workers they start at once and the run does not
# end on one worker finishing them alone; the rest keep their order.
FIRST = ("test_kubernetes.py", "test_crash_only.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: each file keeps its order
