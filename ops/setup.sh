#!/usr/bin/env bash
# Create .venv (if needed) and install SpecSplit. Idempotent.
#   ./ops/setup.sh                  # the serving system only (what ./ops/demo.sh needs)
#   ./ops/setup.sh gguf             # plus llama.cpp's kernels for the GGUF engines (compiles, ~8 min)
#   ./ops/setup.sh test,bench,gguf  # plus the test and benchmark extras (what ./ops/test.sh needs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
# llama-cpp-python ships as an sdist: build only the library, for this machine's CPU (the GGUF
# engines' kernels); skipped when it is installed already. Without AMX: on Sapphire Rapids-class
# CPUs (amx_int8) the vendored ggml's AMX matmul segfaults on the first batched decode (measured on
# the 2-core Xeon box with both GGUFs of the pair and SmolLM2); -mno-amx-* overrides what
# -march=native turns on, so every other native ISA (AVX512, VNNI) stays. --no-cache-dir: pip's
# wheel cache does not key on CMAKE_ARGS, so a cached build with other flags would come back.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [[ ",$EXTRAS," == *",gguf,"* ]] && ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  echo "setup: building llama-cpp-python for this CPU (once, ~8 min on 2 cores)" >&2
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON '-DCMAKE_C_FLAGS=$NO_AMX' '-DCMAKE_CXX_FLAGS=$NO_AMX' -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF}" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    .venv/bin/python -m pip install -q --no-cache-dir --disable-pip-version-check "llama-cpp-python==0.3.36"
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${EXTRAS:+[$EXTRAS]}"
