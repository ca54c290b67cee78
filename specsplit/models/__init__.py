"""Model provisioning and loading: presets, pulling real weights, the tiny test pair.

Importing this package is cheap (no torch, no transformers); the heavy imports happen inside the
functions that need them.
"""

from specsplit.models.cli import models_main
from specsplit.models.errors import (
    ConversionError,
    DownloadError,
    HashMismatchError,
    InsufficientDiskError,
    InsufficientMemoryError,
    LockTimeoutError,
    ModelDirError,
    PartLayoutError,
    ProvisionError,
    SizeMismatchError,
    UnknownPresetError,
)
from specsplit.models.loading import load_model, resolve_model_paths, tokenizer_fingerprint
from specsplit.models.presets import PRESETS, ModelPaths, Preset, get_preset
from specsplit.models.pull import pull
from specsplit.models.settings import ModelSettings
from specsplit.models.tiny import build_tiny_pair

__all__ = [
    "PRESETS", "ConversionError", "DownloadError", "HashMismatchError", "InsufficientDiskError",
    "InsufficientMemoryError", "LockTimeoutError", "ModelDirError", "ModelPaths", "ModelSettings",
    "PartLayoutError", "Preset", "ProvisionError", "SizeMismatchError", "UnknownPresetError",
    "build_tiny_pair", "get_preset", "load_model", "models_main", "pull", "resolve_model_paths",
    "tokenizer_fingerprint",
]
