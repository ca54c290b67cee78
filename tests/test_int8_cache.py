"""The int8 target's codes kept beside its model (``specsplit.models.int8_cache``): a start that
reads them runs the very model a start that quantizes runs, and a file that does not belong to
the weights beside it, or cannot be written, never changes what runs."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

from specsplit.models import int8_cache
from specsplit.models.int8 import KERNELS, RowInt8Linear, int8_supported, onednn_int8_supported, quantize_int8
from tests.conftest import tiny_model
from tests.test_int8 import kernel_or_skip

pytestmark = pytest.mark.skipif(not int8_supported(), reason="torch's fbgemm int8 kernels need an x86 CPU build")


@pytest.fixture
def saved(tmp_path):
    """A tiny qwen2 target saved as a model directory (safetensors, config), and the model."""
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    return tmp_path, model


def _quantized(model, kernel, cache_dir=None):
    report: dict = {}
    q = quantize_int8(copy.deepcopy(model), kernel=kernel, cache_dir=cache_dir, report=report)
    return q, report.get("int8_cache")


def _same_model(a, b) -> None:
    """Every int8 layer's output on the same rows, and the logits of a forward, bit for bit."""
    la = {n: m for n, m in a.named_modules() if isinstance(m, RowInt8Linear)}
    lb = {n: m for n, m in b.named_modules() if isinstance(m, RowInt8Linear)}
    assert la.keys() == lb.keys() and la
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, layer in la.items():
            x = torch.randn(5, layer.in_features, generator=g)
            assert torch.equal(layer(x), lb[name](x)), name
        ids = torch.randint(3, a.config.vocab_size, (1, 9), generator=g)
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.parametrize("kernel", KERNELS)
def test_codes_read_back_run_the_same_model(saved, kernel):
    kernel_or_skip(kernel)
    model_dir, model = saved
    plain, status = _quantized(model, kernel)
    assert status is None  # no directory: no cache
    first, status = _quantized(model, kernel, model_dir)
    assert status == "written" and int8_cache.cache_path(model_dir, kernel, torch.float32).is_file()
    second, status = _quantized(model, kernel, model_dir)
    assert status == "hit"
    _same_model(plain, first)
    _same_model(plain, second)
    assert not list(model_dir.glob(".*tmp-*"))  # no temporary left behind


def test_codes_of_other_weights_are_not_used(saved):
    """Weights that changed (here: another model saved over the first) make the file stale: the
    layers are quantized from the weights, and the file is written anew for them."""
    model_dir, _ = saved
    _quantized(tiny_model("qwen2"), None, model_dir)
    other = tiny_model("qwen2", seed=7)
    stat = (model_dir / "model.safetensors").stat()
    other.save_pretrained(model_dir)
    # as a copy that keeps the first file's size and modification time would
    os.utime(model_dir / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    q, status = _quantized(other, None, model_dir)
    assert status == "written"  # found stale, rewritten
    _same_model(_quantized(other, None)[0], q)
    assert _quantized(other, None, model_dir)[1] == "hit"


def test_a_damaged_file_is_rewritten_and_never_read(saved):
    model_dir, model = saved
    _quantized(model, None, model_dir)
    (path,) = model_dir.glob("int8-*.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated: as if a disk filled
    q, status = _quantized(model, None, model_dir)
    assert status == "written"
    _same_model(_quantized(model, None)[0], q)


def test_no_room_to_write_changes_nothing_but_the_time(saved, monkeypatch):
    model_dir, model = saved
    usage = shutil.disk_usage(model_dir)
    monkeypatch.setattr(int8_cache.shutil, "disk_usage", lambda p: usage._replace(free=0))
    q, status = _quantized(model, None, model_dir)
    assert status == "unwritable" and not list(model_dir.glob("int8-*")) and not list(model_dir.glob(".*tmp-*"))
    _same_model(_quantized(model, None)[0], q)


def test_a_draft_keeps_no_codes(saved):
    """A draft runs torch.ao's dynamic int8 (batch_invariant off): nothing is kept or read."""
    model_dir, model = saved
    report: dict = {}
    quantize_int8(copy.deepcopy(model), batch_invariant=False, cache_dir=model_dir, report=report)
    assert report == {} and not list(model_dir.glob("int8-*"))


@pytest.mark.parametrize("kernel", KERNELS)
def test_quantizing_on_more_threads_packs_the_same_weights(saved, kernel):
    """A worker quantizes on every core at start (``CpuBackend.prepare``) and serves on its own
    share: the packed weights must not depend on the threads that packed them."""
    kernel_or_skip(kernel)
    _, model = saved
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _quantized(model, kernel)[0]
        torch.set_num_threads(max(2, os.cpu_count() or 2))
        many = _quantized(model, kernel)[0]
        torch.set_num_threads(1)
        _same_model(one, many)
    finally:
        torch.set_num_threads(n)


def test_codes_written_ahead_are_what_a_start_reads(saved):
    """``specsplit models pull --int8-codes`` (``keep_codes``) writes both kernels' codes, as a
    first start would: a start then reads them (a model volume mounted read-only)."""
    from specsplit.models.int8 import keep_codes

    model_dir, model = saved
    assert keep_codes(model_dir, "float32") == {k: "written" for k in KERNELS}  # the tiny target's dtype
    assert keep_codes(model_dir, "float32") == {k: "hit" for k in KERNELS}
    for kernel in KERNELS:
        if kernel == "onednn" and not onednn_int8_supported():
            continue
        q, status = _quantized(model, kernel, model_dir)
        assert status == "hit"
        _same_model(_quantized(model, kernel)[0], q)


def test_models_pull_writes_the_int8_codes(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "specsplit", "models", "pull", "--preset", "tiny", "--no-progress",
                          "--int8-codes", "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SPECSPLIT_ENV_FILE": ""})
    assert run.returncode == 0, run.stderr[-2000:]
    (target,) = {p.parent for p in tmp_path.glob("models/*/target/int8-*.safetensors")}
    names = sorted(p.name for p in target.glob("int8-*"))
    assert names == [f"int8-{k}-float32-v1.safetensors" for k in sorted(KERNELS)]  # the tiny target's dtype
    # and the tokenizers' fingerprints a worker's start reads (the tiny pair shares one tokenizer)
    from transformers import AutoTokenizer

    from specsplit.models.loading import tokenizer_fingerprint

    (memo,) = (tmp_path / "tokenizer-fingerprints").iterdir()
    assert memo.read_text().strip() == tokenizer_fingerprint(AutoTokenizer.from_pretrained(target))


def test_codes_of_the_weights_in_another_dtype_are_kept_apart(saved):
    """A float32 checkpoint loaded in bf16 quantizes other values: its codes live in their own
    file, and neither start reads the other's."""
    model_dir, model = saved
    assert _quantized(model, None, model_dir)[1] == "written"
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    q, status = _quantized(bf16, None, model_dir)
    assert status == "written" and len(list(model_dir.glob("int8-*"))) == 2
    _same_model(_quantized(bf16, None)[0], q)
    assert _quantized(model, None, model_dir)[1] == _quantized(bf16, None, model_dir)[1] == "hit"
