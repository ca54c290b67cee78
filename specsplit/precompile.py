"""Byte-compile what SpecSplit's processes import, once, at install: ``python -m specsplit.precompile``
(ops/setup.sh and the Containerfile run it after a pip install with --no-compile).

Compiling every file of torch, transformers, openai and the rest (13.7k files in the test venv)
costs ~70 CPU-s. Python compiles a module when a process first imports it and keeps the .pyc,
unless PYTHONDONTWRITEBYTECODE is set (it is on this project's machines and in the image); then
every process compiled torch, sympy and transformers again, and a tiny worker's start cost ~3x
the CPU (docs/results.md, "The test suite"). This process imports each role's stack with bytecode
writing on and loads a tiny model the way a worker does, so what the fleet imports (~3.7k
modules) is compiled once.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import py_compile
import sys
import tempfile
import time

sys.dont_write_bytecode = False  # this process writes what it compiles, whatever the environment says

# every role's stack (specsplit/cli.py imports them lazily), the model families the presets use,
# and the test and bench extras where they are installed
MODULES = (
    "specsplit.cli", "brokers.__main__", "specsplit.workers", "specsplit.engine.target", "specsplit.engine.draft",
    "specsplit.engine.target_batch", "specsplit.engine.draft_batch", "specsplit.orchestrator.server",
    "specsplit.api.run", "specsplit.api.server", "specsplit.produce", "specsplit.client", "specsplit.supervise",
    "specsplit.models.cli", "specsplit.models.int8", "specsplit.configdoc", "specsplit.metrics",
    "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen2.tokenization_qwen2",
    "specsplit.models.pull", "pip._internal.cli.main",
    "specsplit.bench.load", "specsplit.bench.soak", "specsplit.bench.api", "honcho.command",
    "llama_cpp", "openai", "pytest", "xdist", "hypothesis",
)


def main() -> int:
    t0 = time.monotonic()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    missing = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # an extra that is not installed
            missing.append(name)
        except Exception as e:  # noqa: BLE001 - compiling is an optimization: never fail setup over it
            missing.append(f"{name} ({type(e).__name__})")
    from specsplit.logs import configure_logging
    from specsplit.models.loading import load_model
    from specsplit.models.tiny import build_tiny_pair

    configure_logging("WARNING")
    with tempfile.TemporaryDirectory(prefix="specsplit-precompile-") as tmp:
        paths = build_tiny_pair(tmp)
        load_model(paths.target)
    # what the interpreter imported before this file ran (site's .pth hooks): compiled explicitly
    for mod in list(sys.modules.values()):
        src = getattr(mod, "__file__", None) or ""
        if src.endswith(".py") and not os.path.isfile(importlib.util.cache_from_source(src)):
            try:
                py_compile.compile(src, doraise=True)
            except (OSError, py_compile.PyCompileError):
                pass  # a read-only or odd file: it compiles at import, as before
    note = f" (not installed: {', '.join(missing)})" if missing else ""
    print(f"precompile: {len(sys.modules)} modules compiled or current in {time.monotonic() - t0:.0f}s{note}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
