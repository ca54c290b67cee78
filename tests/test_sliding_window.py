"""Targets with sliding-window attention (Mistral and Phi-3 slide in every layer; Qwen2 with
``use_sliding_window``, Gemma 2 and 3 and Cohere 2 in some, by ``config.layer_types``): the
engines' own masks carry the window, so speculation equals the model's plain greedy decoding past
the window too. Before, the engines' masks let every token see the whole context and the output
differed from the model's from the first token past the window. Also Gemma 2's attention logit
softcapping and gpt-oss's attention sinks in the engines' own attention functions, and a sweep of
other decoder families."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from schemas import SamplingSpec, SpecPVSpec, TreeSpec
from specsplit.engine.base import EngineLimits
from specsplit.engine.batch import Segment
from specsplit.engine.masks import FULL, SLIDING, SlidingWindows, sliding_windows
from specsplit.engine.target import TargetEngine
from specsplit.errors import ModelRefused
from specsplit.local import generate
from specsplit.models import blocked
from specsplit.models.int8 import quantize_int8
from tests.conftest import MARGIN_DEFAULT, greedy_reference, perturbed, randomized

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
# model type, its sliding-window settings: every layer slides (one mask), or some layers (a dict)
FAMILIES = {
    "mistral": dict(sliding_window=12),
    "qwen2": dict(use_sliding_window=True, sliding_window=12, max_window_layers=2),  # layers 2, 3 slide
    "gemma3_text": dict(sliding_window=12, head_dim=16, sliding_window_pattern=2),
    # every other layer slides; scores and logits softcapped (small caps, so that they bite)
    "gemma2": dict(sliding_window=12, head_dim=16, attn_logit_softcapping=5.0, final_logit_softcapping=10.0),
}
GRAPH_MODES = [pytest.param("static", id="static"),
               pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
                   not torch.cuda.is_available(), reason="no CUDA device here (CI and dev boxes are CPU-only)"))]
SINKS = {"gpt_oss": dict(sliding_window=12, num_local_experts=4, num_experts_per_tok=2, head_dim=16)}
TREES = (TreeSpec(max_nodes=1, max_depth=1, branch=1), TreeSpec(max_nodes=6, max_depth=5, branch=1),
         TreeSpec(max_nodes=12, max_depth=4, branch=3))


def windowed_model(model_type: str, seed: int = 0, scale: float = 0.3, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**COMMON, **{**FAMILIES, **SINKS}[model_type], **overrides})
    torch.manual_seed(seed)
    attn = "eager" if model_type in ("gemma2", "gpt_oss") else "sdpa"  # their softcapping / sinks: eager only
    return randomized(AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval(), seed, scale)


def test_the_windows_a_config_describes():
    from transformers import AutoConfig

    def of(model_type, max_positions=8192, **kw):
        return sliding_windows(AutoConfig.for_model(model_type, **{**COMMON, **kw}), max_positions)

    assert of("llama") is None and of("qwen2") is None  # no window; Qwen2.5's configs keep it off
    assert of("qwen2", sliding_window=4096, use_sliding_window=False) is None
    assert of("mistral", sliding_window=4096) == SlidingWindows(4096, per_layer=False)
    assert of("mistral", sliding_window=4096, max_positions=4096) is None  # a session never reaches past it
    assert of("phi3", sliding_window=2047) == SlidingWindows(2047, per_layer=False)
    assert of("qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=2) == SlidingWindows(64, True)
    cfg = AutoConfig.for_model("qwen2", **COMMON)
    cfg.layer_types = ["full_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(ModelRefused, match="chunked_attention"):
        sliding_windows(cfg, 8192)


def test_the_mask_hides_keys_a_window_behind_each_query():
    """Positions: 10 cached keys at 0..9, then a tree: its root at 10 and two children at 11."""
    visible = torch.ones(3, 13, dtype=torch.bool)
    visible[0, 11:] = False
    visible[1, 12] = visible[2, 11] = False  # siblings do not see each other
    pos = torch.tensor([10, 11, 11])
    both = SlidingWindows(4, per_layer=True).mask(visible, pos, 10, torch.float32)
    assert set(both) == {FULL, SLIDING}
    assert torch.equal(both[FULL][0, 0] == 0, visible)
    seen = both[SLIDING][0, 0] == 0
    assert seen[0].nonzero().view(-1).tolist() == [7, 8, 9, 10]
    assert seen[1].nonzero().view(-1).tolist() == [8, 9, 10, 11]
    assert seen[2].nonzero().view(-1).tolist() == [8, 9, 10, 12]
    assert torch.equal(SlidingWindows(4, per_layer=False).mask(visible, pos, 10, torch.float32), both[SLIDING])


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_speculation_past_the_window_equals_the_models_greedy_decoding(model_type):
    target = windowed_model(model_type, seed=3)
    drafts = {"often-agreeing": perturbed(target, seed=4, noise=0.01), "rarely-agreeing": windowed_model(model_type, 5)}
    rng = random.Random(6)
    for name, draft in drafts.items():
        for tree in TREES:
            prompt = [rng.randrange(3, 128) for _ in range(rng.randrange(5, 30))]
            prompt += prompt[:8]  # a repeat: prompt lookup proposes too
            want, _ = greedy_reference(target, prompt, 40)
            got = generate(draft, target, prompt, max_new_tokens=40, tree=tree, sampling=SamplingSpec(),
                           lookup_max_tokens=4, grow_budget_ms=5.0)
            assert got == want, (model_type, name, tree, len(prompt))


def test_a_long_prompt_and_specpv_past_the_window_stay_exact(monkeypatch):
    """A prompt longer than one linear chunk (prefilled chunk by chunk) and SpecPV requested past
    its threshold: a windowed target verifies fully (its partial view's slots are not positions)
    and the output is still the model's greedy decoding."""
    target = windowed_model("qwen2", seed=7)
    draft = perturbed(target, seed=8, noise=0.01)
    monkeypatch.setattr(TargetEngine, "linear_chunk", 32)
    prompt = [random.Random(9).randrange(3, 128) for _ in range(80)]
    spec = SpecPVSpec(block_size=16, sink_blocks=1, retrieval_blocks=2, window_blocks=1, buffer_tokens=32,
                      threshold=64, refresh_every=4)
    want, _ = greedy_reference(target, prompt, 30)
    assert generate(draft, target, prompt, max_new_tokens=30, tree=TREES[2], sampling=SamplingSpec(),
                    specpv=spec) == want


@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "gemma3_text", "gemma2"])
def test_graphs_of_a_windowed_target_equal_its_greedy_decoding(model_type, mode):
    """A windowed target on a KV pool replays its forwards through the graphs' bodies (CUDA
    graphs, or "static": the same bodies eagerly, as CPU runs them) under the windows' masks, one
    per layer type where the model has several: speculation past the window equals greedy
    decoding, and batched rounds through the graphs equal each session verified alone, eagerly."""
    from specsplit.engine.draft import DraftEngine
    from specsplit.orchestrator.state import SessionCursor
    from tests.conftest import on_device
    from tests.test_graphs import device_of, graphed
    from tests.test_kvpool import batched_rounds_equal_alone

    reference = windowed_model(model_type, seed=61)
    target, draft = (on_device(m, device_of(mode)) for m in (reference, perturbed(reference, seed=62, noise=0.01)))
    limits = EngineLimits(max_sessions=4, max_session_tokens=300, max_tree_nodes=16, max_tree_depth=8)
    engines = []

    def on_pool(model, lim):
        engines.append(TargetEngine(model, graphed(lim, model, 3, mode)))
        return engines[-1]

    rng = random.Random(63)
    for tree in TREES[1:]:
        prompt = [rng.randrange(3, 128) for _ in range(rng.randrange(10, 40))]
        want, gap = greedy_reference(reference, prompt, 30)
        got = generate(draft, target, prompt, max_new_tokens=30, tree=tree, sampling=SamplingSpec(),
                       make_target_engine=on_pool)
        assert got == want or (mode == "cuda" and gap < MARGIN_DEFAULT), (model_type, tree)  # a GPU's near-tie
    assert all(e.windows is not None and e.graphs.body == "transformers" and e.graphs.served > 0 for e in engines)
    batched = on_pool(target, limits)
    cursors = {f"s{i}": SessionCursor([rng.randrange(3, 128) for _ in range(rng.randrange(5, 40))]) for i in range(3)}
    served = batched.graphs.served
    assert batched_rounds_equal_alone(DraftEngine(draft, limits), TargetEngine(target, limits), batched, cursors,
                                      rounds=8) > 0
    assert batched.graphs.served > served
    roomy = TargetEngine(target, EngineLimits(max_session_tokens=12))  # no session reaches past the window
    assert roomy.windows is None


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "gemma3_text"])
def test_batched_verification_past_the_window_equals_each_session_alone(model_type, quantized):
    """Several sessions' trees in one forward (``verify_batch``), each segment under its own
    window masks (one per layer type where the model has several): replies and caches as
    verifying each session alone (the int8 target: bit-identical), rounds past the window."""
    from tests.test_batch_verify import GREEDY, SAMPLED, run_rounds

    target = windowed_model(model_type, seed=51)
    draft = perturbed(target, seed=52, noise=0.01)
    if quantized:
        target = quantize_int8(copy.deepcopy(target))
    for sampling, seed in ((GREEDY, 53), (SAMPLED, 54)):
        assert run_rounds(target, draft, sampling, exact=quantized, seed=seed, rounds=8) > 0


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_int8_target_past_a_window_of_far_blocks_equals_its_own_greedy_decoding(model_type, monkeypatch):
    """The CPU workers' int8 target (batch-invariant blocked attention): with a window longer than
    the rows that attention computes in float64 (``blocked.SHORT``, lowered here so the contexts
    stay small), a row's far keys start at its window's edge; trees still equal the quantized
    model's own plain greedy decoding (full re-forwards)."""
    monkeypatch.setattr(blocked, "SHORT", 64)
    fp32 = windowed_model(model_type, seed=11, sliding_window=300)  # > 2 blocks: far keys past the window's edge
    target = quantize_int8(copy.deepcopy(fp32))
    assert target.config._attn_implementation == blocked.BLOCKED_ATTENTION  # this machine passes its check
    draft = perturbed(fp32, seed=12, noise=0.01)
    prompt = [random.Random(13).randrange(3, 128) for _ in range(330)]
    want, _ = greedy_reference(target, prompt, 60)  # positions 330..389: windows from 31..90, far keys below 128
    for tree in TREES[1:]:
        assert generate(draft, target, prompt, max_new_tokens=60, tree=tree, sampling=SamplingSpec()) == want, tree


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_the_engines_attention_functions_cap_scores_and_keep_sinks(model_type):
    """The attention functions the workers install (the int8 target's blocked and float64 ones,
    a CUDA worker's grouped one) give what transformers' eager attention gives, Gemma 2's
    softcapping and gpt-oss's attention sinks included, on prompts past the window and past the
    rows blocked attention computes in float64."""
    from specsplit.models.attention import register_gqa_attention
    from specsplit.models.fp64 import use_fp64_attention

    def use_gqa_attention(m):  # what a CUDA worker runs (a CPU draft switches only sdpa models)
        m.set_attn_implementation(register_gqa_attention())

    model = windowed_model(model_type, seed=21, sliding_window=300)
    with torch.no_grad():
        for layer in model.model.layers:  # gpt-oss: sinks that bite
            if hasattr(layer.self_attn, "sinks"):
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * 3)
    ids = torch.randint(3, 128, (1, 1200), generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        want = model(ids).logits[0]
        for install in (blocked.use_invariant_attention, use_fp64_attention, use_gqa_attention):
            ours = copy.deepcopy(model)
            install(ours)
            assert ours.config._attn_implementation != "eager"
            # float32 noise through the layers (gpt-oss: its router too) reaches ~4e-4 on logits of ~10;
            # leaving the caps or the sinks out misses by more than 1 (tested)
            torch.testing.assert_close(ours(ids).logits[0], want, rtol=1e-3, atol=1e-3, msg=install.__name__)


OTHER_FAMILIES = {  # model type: settings beside COMMON (the windowed ones are above)
    "phi3": dict(sliding_window=12), "starcoder2": dict(sliding_window=12), "cohere2": dict(sliding_window=12),
    "gemma": dict(head_dim=16), "olmo2": {}, "granite": {}, "cohere": {}, "stablelm": {}, "phi": {},
    "gpt_neox": dict(rotary_pct=0.5), "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
    "smollm3": {}, "exaone4": dict(sliding_window=12), "olmo3": dict(sliding_window=12),
    **SINKS,
}


@pytest.mark.parametrize("model_type", sorted(OTHER_FAMILIES))
def test_other_decoder_families_speculate_their_own_greedy_decoding(model_type, monkeypatch):
    """``SPECSPLIT_TARGET_MODEL`` takes any Hugging Face causal LM directory: a sweep of decoder
    families (tiny random weights of each), windowed or not, trees and prompt lookup."""
    monkeypatch.setitem(FAMILIES, model_type, OTHER_FAMILIES[model_type])
    target = windowed_model(model_type, seed=31)
    draft = perturbed(target, seed=32, noise=0.01)
    prompt = [random.Random(33).randrange(3, 128) for _ in range(30)]
    prompt += prompt[:8]
    want, _ = greedy_reference(target, prompt, 32)
    assert generate(draft, target, prompt, max_new_tokens=32, tree=TREES[2], sampling=SamplingSpec(),
                    lookup_max_tokens=4) == want


def _engines(model):
    from specsplit.engine.draft import DraftEngine

    return TargetEngine(model, EngineLimits()), DraftEngine(model, EngineLimits())


@pytest.mark.parametrize("model_type", ["qwen2", "mistral", "gemma2", "gpt_oss"])
def test_a_workers_start_check_passes_the_models_the_engines_run(model_type):
    for engine in _engines(windowed_model(model_type, seed=41)):
        engine.check_runs()
        assert engine.check_diff < 1e-5, (model_type, engine.role, engine.check_diff)


def test_a_workers_start_check_refuses_the_models_the_engines_cannot_run():
    """MPT's ALiBi biases follow key slots, not positions: a tree's sibling gets another bias than
    in a decoding step (a float32 target's tree differs from its paths); BLOOM's ALiBi fails in
    the forward. Both are refused by their configs in either role, naming the model type; a model
    that runs but differs, by the comparison."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def build(model_type, **kw):
        torch.manual_seed(42)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=128, **kw)).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.3)
        return model

    mpt = build("mpt", d_model=64, n_heads=4, n_layers=2)
    for model in (mpt, build("bloom", hidden_size=64, n_head=4, n_layer=2)):
        for engine in _engines(model):
            with pytest.raises(ModelRefused, match=f"the {engine.role} engine cannot run this .* model: its ALiBi"):
                engine.check_runs()
    # the config no longer names ALiBi, the model still adds its biases: the comparison refuses it
    mpt.config.attn_config.alibi = False
    with pytest.raises(ModelRefused, match="cannot run this mpt model: a tree's logits differ"):
        TargetEngine(mpt, EngineLimits()).check_runs()


@pytest.mark.timeout(300)
def test_a_worker_of_a_model_the_engines_cannot_run_exits_2_naming_why(tmp_path):
    """``specsplit target`` on an ALiBi model (MPT, tiny random weights, the tiny preset's
    tokenizer): the worker logs ``model_refused`` with the reason and exits 2, which its
    supervisor does not restart."""
    import os
    import shutil
    import subprocess
    import sys

    from transformers import AutoConfig, AutoModelForCausalLM

    from specsplit.models import ModelSettings, resolve_model_paths

    AutoModelForCausalLM.from_config(AutoConfig.for_model("mpt", vocab_size=512, d_model=64, n_heads=4,
                                                          n_layers=2)).save_pretrained(tmp_path)
    tiny = resolve_model_paths(ModelSettings(preset="tiny")).target
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, tmp_path / name)
    env = {**os.environ, "SPECSPLIT_ENV_FILE": "", "SPECSPLIT_TARGET_MODEL": str(tmp_path),
           "SPECSPLIT_TARGET_QUANTIZE": "none", "SPECSPLIT_METRICS_PORT": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    run = subprocess.run([sys.executable, "-m", "specsplit", "target"], env=env, capture_output=True, text=True,
                         timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 2, out[-3000:]
    assert "model_refused" in out and "cannot run this mpt model: its ALiBi" in out, out[-3000:]
    assert "role_died" not in out  # not restarted


def test_a_device_failure_in_the_start_check_is_not_a_refusal(monkeypatch):
    """Out of memory while a worker starts is the device's state, not the model's: it propagates
    as itself (the supervisor restarts the worker), never as ``ModelRefused`` (exit 2, for good)."""
    engine = TargetEngine(windowed_model("qwen2"), EngineLimits())

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(engine, "forward", oom)
    with pytest.raises(torch.OutOfMemoryError):
        engine.check_runs()


def test_int8_target_with_a_long_prompt_past_the_window_equals_its_plain_decoding(monkeypatch):
    """A prompt longer than one linear chunk is prefilled on the int8 target's prompt attention
    (float32, ``prompt_attention_name``) under the window masks, the same way whether the target
    then verifies trees or decodes one token a round: the two runs give the same tokens."""
    monkeypatch.setattr(TargetEngine, "linear_chunk", 32)
    fp32 = windowed_model("qwen2", seed=71, sliding_window=40)
    target = quantize_int8(copy.deepcopy(fp32))
    draft = perturbed(fp32, seed=72, noise=0.01)
    prompt = [random.Random(73).randrange(3, 128) for _ in range(100)]
    plain = generate(draft, target, prompt, max_new_tokens=40, tree=TREES[0], sampling=SamplingSpec())
    for tree in TREES[1:]:
        assert generate(draft, target, prompt, max_new_tokens=40, tree=tree, sampling=SamplingSpec()) == plain, tree


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "gemma3_text"])
def test_a_windowed_draft_proposes_its_models_greedy_continuation(model_type):
    """A draft whose model slides its attention drafts under the window too: a chain drafted past
    the window is the model's own greedy continuation (a chain's cache slots are its positions)."""
    from schemas import CacheSync, DraftRequest

    from specsplit.engine.draft import DraftEngine

    model = windowed_model(model_type, seed=81)
    prompt = [random.Random(82).randrange(3, 128) for _ in range(40)]
    want, _ = greedy_reference(model, prompt, 8)
    engine = DraftEngine(model, EngineLimits())
    assert engine.windows is not None
    reply = engine.handle(DraftRequest(session_id="s", round=0, root=prompt[-1], sampling=SamplingSpec(),
                                       sync=CacheSync(base_len=0, append_token_ids=prompt[:-1]),
                                       tree=TreeSpec(max_nodes=9, max_depth=8, branch=1)))
    assert reply.tree.token_ids[1:] == want


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 32}


def test_a_target_whose_rotary_follows_the_forward_verifies_each_session_alone(monkeypatch):
    """LongRoPE (Phi-3 and Phi-4 mini; dynamic NTK likewise): transformers picks a forward's
    frequencies from its largest position, so one forward over sessions on both sides of the
    switch gave the shorter ones the longer one's (verify_batch differed from verifying each
    alone). Such a target's sessions never share a forward, eager or graphed."""
    from tests.test_batch_verify import GREEDY, run_rounds
    from tests.test_graphs import graphed

    monkeypatch.setitem(FAMILIES, "phi3", {"rope_parameters": LONGROPE, "original_max_position_embeddings": 32,
                                           "max_position_embeddings": 256})
    target = windowed_model("phi3", seed=5)
    engine = TargetEngine(target, graphed(EngineLimits(max_session_tokens=256), target, 2, "static"))
    assert engine.dynamic_rope == "longrope" and not engine.batched_forward_supported()
    kv = [engine.store.get_or_create(f"s{i}").kv for i in range(2)]
    items = [Segment(k, [1], torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool), keep=1) for k in kv]
    assert engine.graphs.bucket(items) is None and engine.graphs.bucket(items[:1]) is not None
    # prompts of 1-39 tokens: sessions on both sides of the 32-token switch
    assert run_rounds(target, perturbed(target, 6, 0.01), GREEDY, seed=7, rounds=8, batched_forwards=False) > 0
