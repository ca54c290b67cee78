"""Byte-compile what SpecSplit's roles import from its dependencies, in the image's dependency
layer (Containerfile), before the project is installed.

specsplit.precompile (run in the project's layer) compiles what the roles import; run alone, it
compiled torch's and transformers' modules into the project's layer, so every code change
rebuilt and shipped their bytecode again (~65 MB). This script, which needs no SpecSplit, imports
the same third-party stacks and loads a tiny random model of each family the presets use the way
a worker does, so their bytecode lives with the dependencies; specsplit.precompile then finds
them current and compiles only the rest.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import py_compile
import sys
import tempfile

sys.dont_write_bytecode = False  # this process writes what it compiles, whatever the environment says
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")

MODULES = (
    "torch", "numpy", "zmq", "msgpack", "pydantic", "pydantic_settings", "structlog", "prometheus_client",
    "starlette.applications", "uvicorn", "tokenizers", "safetensors.torch", "honcho.command",
    "pip._internal.cli.main", "transformers", "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen2.tokenization_qwen2",
)


def main() -> int:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - compiling is an optimization: never fail the build over it
            print(f"precompile-deps: {name} not imported ({type(e).__name__})", file=sys.stderr)
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    small = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1}
    for config in (LlamaConfig(**small), Qwen2Config(**small), Qwen3Config(head_dim=8, **small)):
        with tempfile.TemporaryDirectory() as tmp:
            AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
            AutoModelForCausalLM.from_pretrained(tmp).eval()
    for mod in list(sys.modules.values()):  # what the interpreter imported before this file ran
        src = getattr(mod, "__file__", None) or ""
        if src.endswith(".py") and not os.path.isfile(importlib.util.cache_from_source(src)):
            try:
                py_compile.compile(src, doraise=True)
            except (OSError, py_compile.PyCompileError):
                pass
    print(f"precompile-deps: {len(sys.modules)} modules compiled or current", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
