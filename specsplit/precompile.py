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
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = False  # this process writes what it compiles, whatever the environment says

# every role's stack (specsplit/cli.py imports them lazily), the model families the presets use,
# and the test and bench extras where they are installed. Those that import no torch compile in a
# second process beside this one (setup's time is the longer of the two: ~5 s less).
WITHOUT_TORCH = (
    "specsplit.cli", "brokers.__main__", "specsplit.api.run", "specsplit.api.server", "specsplit.produce",
    "specsplit.client", "specsplit.supervise", "specsplit.models.cli", "specsplit.configdoc", "specsplit.metrics",
    "specsplit.models.pull", "pip._internal.cli.main", "specsplit.bench.load", "specsplit.bench.soak",
    "specsplit.bench.api", "honcho.command", "llama_cpp", "openai", "pytest", "xdist", "hypothesis",
)
WITH_TORCH = (
    "specsplit.workers", "specsplit.engine.target", "specsplit.engine.draft", "specsplit.engine.target_batch",
    "specsplit.engine.draft_batch", "specsplit.orchestrator.server", "specsplit.models.int8",
    "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen2.tokenization_qwen2",
)
LIGHT = "--without-torch"  # argv of the second process


def _import_all(names) -> list[str]:
    """Imports ``names`` (compiling what they import); the ones that failed, and why."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:  # an extra that is not installed
            missing.append(name)
        except Exception as e:  # noqa: BLE001 - compiling is an optimization: never fail setup over it
            missing.append(f"{name} ({type(e).__name__})")
    return missing


def _compile_loaded() -> None:
    """Compiles what the interpreter imported before this file ran (site's .pth hooks)."""
    for mod in list(sys.modules.values()):
        src = getattr(mod, "__file__", None) or ""
        if src.endswith(".py") and not os.path.isfile(importlib.util.cache_from_source(src)):
            try:
                py_compile.compile(src, doraise=True)
            except (OSError, py_compile.PyCompileError):
                pass  # a read-only or odd file: it compiles at import, as before


def main() -> int:
    if sys.argv[1:] == [LIGHT]:  # the second process: its module count, then what failed, a line each
        missing = _import_all(WITHOUT_TORCH)
        _compile_loaded()
        print("\n".join([str(len(sys.modules)), *missing]))
        return 0
    t0 = time.monotonic()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    light = subprocess.Popen([sys.executable, "-m", "specsplit.precompile", LIGHT], stdout=subprocess.PIPE,
                             text=True)
    missing = _import_all(WITH_TORCH)
    from specsplit.logs import configure_logging
    from specsplit.models.loading import load_model
    from specsplit.models.tiny import build_tiny_pair

    configure_logging("WARNING")
    with tempfile.TemporaryDirectory(prefix="specsplit-precompile-") as tmp:
        paths = build_tiny_pair(tmp)
        load_model(paths.target)
    _compile_loaded()
    modules = len(sys.modules)
    try:
        out, _ = light.communicate(timeout=600)
        count, *failed = out.splitlines() or ["0"]
        modules += int(count) if count.isdigit() else 0
        missing += failed
    except subprocess.TimeoutExpired:
        light.kill()
        light.communicate()
        missing.append("the modules without torch (timed out)")
    note = f" (not installed: {', '.join(missing)})" if missing else ""
    print(f"precompile: {modules} modules (two processes) compiled or current in {time.monotonic() - t0:.0f}s{note}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
