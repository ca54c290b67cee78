#!/usr/bin/env bash
# The GPU checks of a session lent a device machine, as one prepared call (device time is scarce:
# 15 minutes a session, each start ~1 minute).
#
#   ./ops/gpu_check.sh prepare     here: the pure-Python deps and our pinned transformers as wheels
#                                  for the device's Python 3.12 (the device reaches no network),
#                                  and the pulled models' config.json (real weights cannot travel:
#                                  64 MiB), under .whl/ (git-ignored)
#   ./ops/gpu_check.sh run         there (the device tool's `run` with carry [".whl"]): installs the
#                                  wheels, runs the CUDA-parametrized oracles, one layer's attention
#                                  (ops/gpu_attention.py), SpecPV's verify cost at long contexts
#                                  (ops/gpu_longctx.py) with each attention in ATTENTION (default
#                                  "grouped sdpa"; grouped:N sets the values' chunk) and, with
#                                  COST_S > 0, the forward costs (specsplit bench gpu), on random weights
#                                  of the real configs; logs and JSON under $OUT. TESTS_S / ATTN_S /
#                                  LONGCTX_S / COST_S bound each part; CONTEXTS, MODES the sweeps.
#
# A stop-37 run of the same steps (H200): 29 oracles in ~95 s, the four-context SpecPV sweep in
# ~150 s (ops/results/gpu-longctx-h200-*); it found the cuDNN attention planning cost
# (specsplit.backends.CudaBackend). Stop 38 (two H200 hosts, one ~25 % slower): 31-34 oracles in
# 117-130 s, the per-layer probe ~40 s, a full+approx sweep over 4 contexts ~110-150 s per
# attention; the defaults (oracles, probe, the sweep with grouped and sdpa attention, no forward
# costs) fit one 600 s call with ~1 minute to spare.
set -uo pipefail
cd "$(dirname "$0")/.."
# the device's image lacks these or holds other versions; each is pinned to this checkout's venv
WHEELS=(transformers pyzmq structlog pydantic pydantic_core pydantic-settings python-dotenv annotated-types
        typing-inspection typing_extensions pytest pytest-asyncio honcho regex msgpack prometheus_client)

case "${1:-}" in
prepare)
  set -e
  mkdir -p .whl/cfg/target .whl/cfg/draft
  . .venv/bin/activate
  for name in "${WHEELS[@]}"; do
    w="$name==$(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$w"
  done
  python - <<'EOF'
import shutil
from specsplit.models import ModelSettings, resolve_model_paths
paths = resolve_model_paths(ModelSettings())
for role in ("target", "draft"):
    shutil.copy(getattr(paths, role) / "config.json", f".whl/cfg/{role}/config.json")
EOF
  du -sh .whl
  ;;
run)
  : "${OUT:?run this on the device machine (its \$OUT collects the results)}"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  timeout "${TESTS_S:-180}" python3 -m pytest -q -ra -p no:cacheprovider -k "cuda or cudnn" ${TESTS:-tests/test_graphs.py \
    tests/test_device.py tests/test_tree_forward.py tests/test_specpv.py tests/test_greedy_equivalence.py} \
    2>&1 | tee "$OUT/tests-cuda.log" | tail -8
  # forward costs: CUDA graphs over the KV pool (the default) against eager forwards, in one call
  if [ "${COST_S:-0}" -gt 0 ]; then
    timeout "$((COST_S / 4))" python3 -m specsplit bench gpu --device cuda --target-config .whl/cfg/target \
      --draft-config .whl/cfg/draft --roles target --tokens 1,4,16 --batch 1,16 --no-cuda-graphs \
      --max-seconds $((COST_S / 5)) --json "$OUT/gpu-cost-eager.json" 2>&1 | grep -v '^target {' | tail -16
    timeout "$((COST_S * 3 / 4))" python3 -m specsplit bench gpu --device cuda --target-config .whl/cfg/target \
      --draft-config .whl/cfg/draft --max-seconds $((COST_S * 3 / 5)) --json "$OUT/gpu-cost.json" 2>&1 \
      | tee "$OUT/gpu-cost.log" | grep -v '^target {\|^draft {' | tail -40
  fi
  # the real pair's recorded rounds replayed on the device, with graphs (pool) and eager
  if [ "${REPLAY_S:-0}" -gt 0 ]; then
    for pool in ${REPLAY_POOLS:-8 0}; do
      SPECSPLIT_TARGET_KV_POOL_GB=$pool timeout "$((REPLAY_S / 2))" python3 -m specsplit bench replay --device cuda \
        --target-config .whl/cfg/target --trace tests/data/traces/humaneval0-9-qwen-coder-cpu2-quiet.jsonl.gz \
        --max-rounds "${REPLAY_ROUNDS:-400}" --json "$OUT/gpu-replay-pool$pool.json" 2>&1 | tail -14
    done
  fi
  [ -n "${SKIP_LONGCTX:-}" ] && exit 0
  cd ops
  timeout "${ATTN_S:-60}" python3 gpu_attention.py cuda "$OUT/gpu-attention.json" 2>&1 | tee "$OUT/gpu-attention.log" | tail -18
  # SpecPV's sweep with each attention the workers can run (ATTENTION="grouped sdpa grouped:0": an A/B
  # in one call; grouped:N sets the values' chunk, gpu_longctx.py --value-chunk)
  for spec in ${ATTENTION:-grouped sdpa}; do
    attn=${spec%%:*} chunk=${spec#*:}
    [ "$chunk" = "$spec" ] && chunk=""
    timeout "${LONGCTX_S:-150}" python3 gpu_longctx.py --device cuda --attention "$attn" ${chunk:+--value-chunk "$chunk"} \
      --target-config ../.whl/cfg/target --draft-config ../.whl/cfg/draft --contexts "${CONTEXTS:-4096,16384,32768,65536}" \
      --modes "${MODES:-full,approx}" --max-new-tokens 64 --tree 16,3,4 --json "$OUT/gpu-longctx-${spec/:/-}.json" \
      2>&1 | grep -v "^context" | tee "$OUT/gpu-longctx-${spec/:/-}.log" | tail -18
  done
  true
  ;;
*)
  echo "usage: $0 prepare|run" >&2
  exit 2
  ;;
esac
