#!/usr/bin/env bash
# Create .venv (if needed) and install SpecSplit. Idempotent.
#   ./ops/setup.sh                  # the serving system only (what ./ops/demo.sh needs)
#   ./ops/setup.sh gguf             # plus llama.cpp's kernels for the GGUF engines (compiles, ~3 min)
#   ./ops/setup.sh test,bench,gguf  # plus the test and benchmark extras (what ./ops/test.sh needs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# The llama-cpp-python wheel, if asked for and not installed: built in the background (the CPU)
# while pip downloads and installs the rest (the network), installed once both are done.
# llama-cpp-python ships as an sdist: build only what its Python bindings load (libllama, libggml),
# for this machine's CPU (the GGUF engines' kernels); skipped when it is installed already. Left
# out: llama.cpp's programs, its multimodal library (LLAVA_BUILD; imported only by the multimodal
# chat handlers) and its `common` library (ops/llama-cpp-bindings-only.cmake): ~60 % of the
# compile. Without AMX: on Sapphire Rapids-class CPUs (amx_int8) the vendored ggml's AMX matmul
# segfaults on the first batched decode (the 2-core Xeon box, both GGUFs of the pair and SmolLM2);
# -mno-amx-* overrides what -march=native turns on, so every other native ISA (AVX512, VNNI)
# stays. The wheel is kept under ~/.cache/specsplit/wheels, keyed by the build flags and this
# CPU's flags (pip's own wheel cache keys on neither), so a fresh clone or venv on the same
# machine installs it in seconds instead of compiling again.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA=llama-cpp-python==0.3.36
ONLY="$PWD/ops/llama-cpp-bindings-only.cmake"
wheels="" build_pid=""
if [[ ",$EXTRAS," == *",gguf,"* ]] && ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON '-DCMAKE_C_FLAGS=$NO_AMX' '-DCMAKE_CXX_FLAGS=$NO_AMX' -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF '-DCMAKE_PROJECT_llama.cpp_INCLUDE=$ONLY'}"
  # keyed by the include file's text, not its path: every clone of the repository shares the wheel
  key=$( (echo "$LLAMA ${CMAKE_ARGS//$ONLY/}"; cat "$ONLY"; grep -m1 '^flags' /proc/cpuinfo 2>/dev/null; cc --version 2>/dev/null | head -1) | sha256sum | cut -c1-16)
  wheels="${SPECSPLIT_CACHE_DIR:-$HOME/.cache/specsplit}/wheels/llama-cpp-$key"
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "setup: building llama-cpp-python for this CPU (once per machine, ~3 min on 2 cores)" >&2
    rm -rf "$wheels.tmp" && mkdir -p "$wheels.tmp"
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" .venv/bin/python -m pip wheel -q --no-deps --no-cache-dir \
      --disable-pip-version-check -w "$wheels.tmp" "$LLAMA" &
    build_pid=$!
    trap 'kill "$build_pid" 2>/dev/null || true' EXIT  # a failed setup leaves no compile running
  fi
fi
# One run installs everything (each run costs its own start and resolve). uv installs what pip
# would, from the sources and constraints pip is configured with (ops/pip_sources.py) and with
# pip's choice among indexes (the best match over all), in a fraction of pip's time
# (docs/results.md, "The test suite"); pip installs where uv cannot be had or fails. Neither
# compiles: specsplit.precompile below compiles what the fleet imports instead of every file of
# torch, transformers, openai...
UV=uv==0.13.9
install() {
  local found sources=()
  if { [ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q --disable-pip-version-check "$UV" >/dev/null 2>&1; } &&
     found=$(.venv/bin/python ops/pip_sources.py); then
    [ -z "$found" ] || mapfile -t sources <<< "$found"
    if .venv/bin/uv pip install -q --python .venv/bin/python --index-strategy unsafe-best-match "${sources[@]}" "$@"; then
      return 0
    fi
    echo "setup: uv could not install; pip installs instead" >&2
  fi
  .venv/bin/python -m pip install -q --no-compile --disable-pip-version-check "$@"
}
if [ -n "$build_pid" ]; then
  # everything but the gguf extra while the wheel builds (the extra now would build the sdist
  # again), then the wheel
  rest=$(echo ",$EXTRAS," | sed 's/,gguf,/,/g; s/^,*//; s/,*$//')
  install -e ".${rest:+[$rest]}"
  wait "$build_pid"
  trap - EXIT
  rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"
  install "$wheels"/llama_cpp_python-*.whl
else
  llama=()  # the kept llama.cpp wheel, where the gguf extra is asked for and not installed yet
  [ -n "$wheels" ] && llama=("$wheels"/llama_cpp_python-*.whl)
  install -e ".${EXTRAS:+[$EXTRAS]}" "${llama[@]}"
fi
# .pyc for what the fleet's processes import (--no-compile above; PYTHONDONTWRITEBYTECODE would
# leave every process compiling torch and transformers again): ~18 s, again only when what is
# installed changed (the stamp: site-packages' listing but the project's entries and .pyc, taken
# after compiling, which changes a package folder's time when it adds its __pycache__)
stamp() { ls -l --time-style=+%s .venv/lib/python3*/site-packages | grep -Eiv "specsplit|__pycache__" | sha256sum | cut -c1-16; }
if [ "$(cat .venv/.specsplit-precompiled 2>/dev/null)" != "$(stamp)" ]; then
  .venv/bin/python -m specsplit.precompile && stamp > .venv/.specsplit-precompiled
fi
