#!/usr/bin/env bash
# The main job on a fresh machine: set up, provision the real draft/target pair, start the fleet
# with honcho (routers, one draft, one target, the orchestrator), push a few prompts, print the
# answers with speed figures, and stop the fleet cleanly.
#   ./ops/demo.sh                 # default preset qwen-coder (Qwen2.5-Coder 0.5B -> 1.5B)
#   SPECSPLIT_PRESET=smollm2 ./ops/demo.sh   # a fast real-weights smoke run
set -euo pipefail
cd "$(dirname "$0")/.."
./ops/setup.sh
. .venv/bin/activate
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
mkdir -p runs
specsplit models pull            # idempotent: downloads, checks sha256, converts once (llama.cpp engines: --keep)
honcho start > runs/fleet.log 2>&1 &
fleet=$!
stop_fleet() { kill -TERM "$fleet" 2>/dev/null || true; wait "$fleet" 2>/dev/null || true; }
trap stop_fleet EXIT
echo "fleet starting (log: runs/fleet.log); waiting for it to answer..." >&2
specsplit produce --max-new-tokens "${MAX_NEW_TOKENS:-512}" --wait-s 900 \
  "Write a Python function that returns True when a number is prime." \
  "Explain in two sentences what a KV cache does in a transformer." \
  "def fibonacci(n):"
