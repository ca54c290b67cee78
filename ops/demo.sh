#!/usr/bin/env bash
# The main job on a fresh machine: set up, provision the real draft/target pair, start the fleet
# with honcho (routers, one draft, one target, the orchestrator, the HTTP API), push a few prompts
# with the producer, ask one more through the OpenAI-compatible API with curl, print the answers
# with speed figures, and stop the fleet cleanly.
#   ./ops/demo.sh                 # default preset qwen-coder (Qwen2.5-Coder 0.5B -> 1.5B)
#   SPECSPLIT_PRESET=smollm2 ./ops/demo.sh   # a fast real-weights smoke run
set -euo pipefail
cd "$(dirname "$0")/.."
./ops/setup.sh
. .venv/bin/activate
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
mkdir -p runs
specsplit models pull            # idempotent: downloads, checks sha256, converts once
: > runs/fleet.log
honcho start > runs/fleet.log 2>&1 &
fleet=$!
stop_fleet() { kill -TERM "$fleet" 2>/dev/null || true; wait "$fleet" 2>/dev/null || true; }
trap stop_fleet EXIT
api=$(specsplit config api | python -c "import json, sys; print(json.load(sys.stdin)['effective']['url'])")

# progress while the fleet loads; a fleet that dies stops the demo at once, with its log's end
echo "fleet starting (log: runs/fleet.log)..." >&2
t0=$SECONDS
until curl -sf "${api%/v1}/health" > /dev/null; do
  if ! kill -0 "$fleet" 2>/dev/null; then
    echo "the fleet stopped; the end of runs/fleet.log:" >&2
    tail -n 30 runs/fleet.log >&2
    exit 1
  fi
  if (( SECONDS - t0 > 900 )); then
    echo "the fleet did not serve within 900 s; the end of runs/fleet.log:" >&2
    tail -n 30 runs/fleet.log >&2
    exit 1
  fi
  loaded=$(grep -c "worker_admitted.*live=" runs/fleet.log || true)
  printf '\r  %3ds: %s worker(s) admitted, waiting for the first answer...' $((SECONDS - t0)) "$loaded" >&2
  sleep 2
done
printf '\r  fleet serving after %ds%40s\n' $((SECONDS - t0)) "" >&2

specsplit produce --max-new-tokens "${MAX_NEW_TOKENS:-256}" --wait-s 120 \
  "Write a Python function that returns True when a number is prime." \
  "Explain in two sentences what a KV cache does in a transformer." \
  "def fibonacci(n):"

model=$(curl -sf "$api/models" | python -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
echo >&2
echo "=== the same fleet over HTTP: POST $api/chat/completions (model $model)" >&2
curl -sf "$api/chat/completions" -H "Content-Type: application/json" -d "{
  \"model\": \"$model\", \"temperature\": 0, \"max_tokens\": 128,
  \"messages\": [{\"role\": \"user\", \"content\": \"Write a Python one-liner that reverses a string.\"}]}" |
  python -c "
import json, sys
r = json.load(sys.stdin)
c = r['choices'][0]
print(c['message']['content'])
s, u = c['speculative'], r['usage']
print(f\"[api] {u['completion_tokens']} tokens, {s['rounds']} rounds, mean accepted {s['mean_accepted_length']:.2f}/round, \"
      f\"first token after {s['time_to_first_token_s']:.2f}s, finish={c['finish_reason']}\", file=sys.stderr)"
