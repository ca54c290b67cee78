"""Small filesystem helpers for provisioning: locks, hashes, manifests, resource checks."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specsplit.models.errors import (
    InsufficientDiskError,
    InsufficientMemoryError,
    LockTimeoutError,
)

MANIFEST_NAME = "specsplit-manifest.json"
CHUNK_BYTES = 8 << 20
DISK_MARGIN_BYTES = 256 << 20


@contextmanager
def file_lock(path: Path, *, timeout_s: float = 3600.0, what: str = "") -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``path`` (created if missing) for the block.

    Several processes started together (honcho) provision the same model: one converts, the others
    wait here and then find the finished manifest. The lock dies with its process.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockTimeoutError(
                        f"gave up after {timeout_s:.0f} s waiting for {path} ({what}); "
                        "another process is still provisioning"
                    ) from None
                if not announced:
                    print(f"specsplit: waiting for another process to finish {what or path}",
                          file=sys.stderr)
                    announced = True
                time.sleep(0.25)
        yield
    finally:
        os.close(fd)


def sha256_file(path: Path, progress: object | None = None) -> str:
    """Streamed sha256 of a file; ``progress`` (a tqdm bar) is advanced by the bytes read."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()


def read_manifest(model_dir: Path) -> dict | None:
    """The manifest of a finished model directory, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((model_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary name and an atomic rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a finished ``tmp_dir`` to ``final_dir`` (same filesystem), replacing a stale one.

    Files become world-readable first (some writers create 0600 files), so other users and
    outside checkers can load the same weights.
    """
    for path in tmp_dir.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.rename(tmp_dir, final_dir)


def temp_sibling(path: Path, tag: str = "tmp") -> Path:
    """A per-process temporary name next to ``path`` (so a rename onto ``path`` is atomic)."""
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}")


def remove_stale_temps(path: Path) -> None:
    """Remove temporaries that killed runs left next to ``path``. Call only while holding its lock."""
    for stale in path.parent.glob(f".{path.name}.*-*"):
        if not stale.name.endswith(".lock"):
            remove_quietly(stale)


def remove_quietly(path: Path) -> None:
    """Remove a file or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def check_disk(path: Path, need_bytes: int) -> None:
    """Raise ``InsufficientDiskError`` when the filesystem holding ``path`` has too little space."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need_bytes + DISK_MARGIN_BYTES:
        raise InsufficientDiskError(path, need_bytes + DISK_MARGIN_BYTES, free)


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(what: str, need_bytes: int) -> None:
    """Raise ``InsufficientMemoryError`` when MemAvailable is below ``need_bytes``."""
    available = mem_available_bytes()
    if available is not None and available < need_bytes:
        raise InsufficientMemoryError(what, need_bytes, available)
