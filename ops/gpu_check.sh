#!/usr/bin/env bash
# The GPU checks of a session lent a device machine, as one prepared call (device time is scarce:
# 15 minutes a session, each start ~40-60 s).
#
#   ./ops/gpu_check.sh prepare     here: the pure-Python deps and our pinned transformers as wheels
#                                  for the device's Python 3.12 (the device reaches no network),
#                                  and the pulled models' config.json (real weights cannot travel:
#                                  64 MiB), under .whl/ (git-ignored)
#   ./ops/gpu_check.sh run         there (the device tool's `run` with carry [".whl"]), on random
#                                  weights of the real configs, logs and JSON under $OUT:
#     1. the CUDA oracles of TESTS (default: the graphs', the fused body's, the Triton kernels' and
#        GEMMs', the KV pool's, an automatic one included, greedy equivalence, and a pair's two
#        engines on their own threads and streams serving two sessions at once), TESTS_S;
#     2. COST_S > 0: `specsplit bench gpu` eager and on CUDA graphs of the fused body in torch
#        operations (the target), then on graphs of the fused body through the Triton kernels,
#        with torch's GEMMs and with Triton's (both roles: the issue's three bars);
#     2b. LONG_S > 0: the target's 1- and 16-token forwards at LONG_CONTEXT cached tokens (65536)
#        on graphs of each body: the full verification SpecPV's bar compares against, with the
#        Triton body's attention reading the slot in place against the torch body's gather;
#     3. REPLAY_S > 0: the HumanEval trace replayed, draft too, per REPLAY_RUNS "POOL_GB:BODY ..."
#        (default "8:triton_gemm": graphs of that body; a pool of 0 runs eagerly; REPLAY_TRACE
#        default the fleet with growth's spare siblings, humaneval0-9-qwen-coder-spares-cpu2-amx;
#        the earlier H200 replays ran humaneval0-9-qwen-coder-cpu2-quiet), then the
#        prompt-lookup trace on the triton_gemm body (no draft: its verify-only figure is the fleet's),
#        LOOKUP_S, and the rounds `specsplit bench growth --record-trace` gives a draft with 3 growth
#        forwards a verify (GROWN_TRACE, draft too; GROWN_ROUNDS of it, 150: within GROWN_S eagerly too), GROWN_S;
#        then $OUT/summary.md (ops/gpu_summary.py), in case the call's limit ends what follows;
#     4. ops/fleet_cpu.py (FLEETCPU_S): the host's CPU ms a round per fleet process and the round
#        trips (the tiny fleet, on this machine's CPUs); the orchestrator's work is what step 4b
#        leaves out;
#     4b. FLEET_S > 0: the HumanEval trace through the fleet's processes (`bench replay --fleet`: a
#        router and a worker per role, both workers on the device, the growth beside each verify):
#        the fleet's round trips and contention measured, not modelled (~30 s of it starting);
#        then PAIR_S > 0: the same through one worker process hosting both roles (`--fleet --pair`:
#        `specsplit pair`, Procfile.gpu's worker, a thread and CUDA stream per role) against two
#        processes whose kernels take turns on the card; then OVERLAP_S > 0: both engines in the
#        replaying process itself (`--overlap`: the pair's figure without its sockets);
#     4c. PROBE_S > 0: ops/gpu_probe.py per graph body in BODIES (default "triton_gemm fused"):
#        request / runner / replay / kernels per shape (diagnostics, last);
#     then ops/gpu_summary.py: every bar of the run in one table ($OUT/summary.md);
#     5. LONGCTX=1: one layer's attention (ops/gpu_attention.py, ATTN_S) and SpecPV's verify cost
#        at long contexts (ops/gpu_longctx.py, LONGCTX_S) with each attention in ATTENTION
#        (default "grouped sdpa"; grouped:N sets the values' chunk); CONTEXTS, MODES the sweep.
#
# Stop 51 (H200): steps 1-4 took ~20 + ~60 + ~25 + ~45 s at their defaults, model loads
# included; the long-context sweep took ~110-150 s per attention (stops 37-38). Since the fused
# body's A/B (a third cost run, a second probe, a replay per body) and the lookup trace's replay,
# expect ~20 + ~90 + ~50 + ~130 s, and Triton compiling its kernels on first use (~0.5-1 s per
# variant, ~20 variants per process; the GEMMs ~10 more) and step 2b (~90 s), and since the
# triton_gemm body a fourth cost run and a third probe (~+70 s), and since its GEMM tiles are
# tuned at first use a few seconds per process (4 tiles x 5 kinds of product per model, each
# compiled once), and since the fleet replay, the overlap replay and fleet_cpu (~+150 s; one probe
# and the fused body's replay fewer, ~-70 s): give the defaults one 590 s call
# (each step stops at its own timeout; the replays start no round 10 s before theirs, so they
# still write their figures); if it ran out, a second call with the finished steps'
# *_S=0 measures the rest. Add LONGCTX=1 only with LONGCTX_S, COST_S or REPLAY_S trimmed.
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
  # every step's budget set here: under set -u, arithmetic on an unset one ends the whole run
  # (with the defaults, the cost step's $((COST_S / 3)) did, and nothing after the tests ran)
  : "${TESTS_S:=150}" "${COST_S:=100}" "${LONG_S:=90}" "${PROBE_S:=40}" "${REPLAY_S:=60}" "${LOOKUP_S:=40}"
  : "${GROWN_S:=40}" "${FLEETCPU_S:=40}" "${FLEET_S:=75}" "${PAIR_S:=75}" "${OVERLAP_S:=45}" "${ATTN_S:=60}"
  : "${LONGCTX_S:=150}"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  # test_kernels, test_matmul: every test runs the compiled kernels on the device (their ahead-of-time
  # compile checks ran here)
  timeout "${TESTS_S:-150}" python3 -m pytest -q -ra -p no:cacheprovider \
    -k "(cuda or cudnn or kernels or matmul) and not compiles" \
    ${TESTS:-tests/test_kernels.py tests/test_matmul.py tests/test_graphs.py tests/test_fused.py tests/test_kvpool.py \
      tests/test_kvpool_size.py tests/test_greedy_equivalence.py tests/test_pair_engines.py \
      tests/test_sliding_window.py} 2>&1 \
    | tee "$OUT/tests-cuda.log" | tail -8
  cfg="--target-config .whl/cfg/target"
  if [ "${COST_S:-100}" -gt 0 ]; then  # eager and graphed forwards in one call
    timeout "$((COST_S / 3))" python3 -m specsplit bench gpu --device cuda $cfg --roles target --tokens 1,4,16 \
      --batch 1,16 --no-cuda-graphs --max-seconds $((COST_S / 4)) --json "$OUT/gpu-cost-eager.json" 2>&1 \
      | grep -v '^target {' | tail -14
    timeout "$((COST_S / 3))" python3 -m specsplit bench gpu --device cuda $cfg --roles target --tokens 1,4,16 \
      --batch 1,16 --graph-body fused --max-seconds $((COST_S / 4)) --json "$OUT/gpu-cost-fused.json" 2>&1 \
      | grep -v '^target {' | tail -14
    for body in triton triton_gemm; do  # both roles: the issue's three bars, with torch's GEMMs and with Triton's
      timeout "$((COST_S * 2 / 3))" python3 -m specsplit bench gpu --device cuda $cfg --draft-config .whl/cfg/draft \
        --tokens 1,4,16,64 --graph-body $body --max-seconds $((COST_S / 2)) --json "$OUT/gpu-cost-$body.json" 2>&1 \
        | tee "$OUT/gpu-cost-$body.log" | grep -v '^target {\|^draft {' | tail -34
    done
  fi
  if [ "${LONG_S:-90}" -gt 0 ]; then  # full verification at a long context, per body
    for body in triton fused; do
      timeout "$((LONG_S / 2))" python3 -m specsplit bench gpu --device cuda $cfg --roles target --tokens 1,16 \
        --batch 1 --context "${LONG_CONTEXT:-65536}" --graph-body "$body" --max-seconds $((LONG_S / 3)) \
        --json "$OUT/gpu-cost-long-$body.json" 2>&1 | grep -v '^target {' | tail -6
    done
  fi
  if [ "${REPLAY_S:-60}" -gt 0 ]; then  # the real pair's recorded rounds, per POOL_GB:BODY (0: eager)
    runs=(${REPLAY_RUNS:-8:triton_gemm})
    for run in "${runs[@]}"; do
      pool=${run%%:*} body=${run#*:}
      SPECSPLIT_TARGET_KV_POOL_GB=$pool SPECSPLIT_DRAFT_KV_POOL_GB=$pool SPECSPLIT_CUDA_GRAPH_BODY=$body \
        timeout "$((REPLAY_S / ${#runs[@]}))" \
        python3 -m specsplit bench replay --device cuda $cfg --draft-config .whl/cfg/draft \
        --trace "${REPLAY_TRACE:-tests/data/traces/humaneval0-9-qwen-coder-spares-cpu2-amx.jsonl.gz}" \
        --max-rounds "${REPLAY_ROUNDS:-300}" --max-seconds "$((REPLAY_S / ${#runs[@]} - 10))" \
        --json "$OUT/gpu-replay-pool$pool-$body.json" 2>&1 | grep -v "^replay: session" | head -4
    done
    # prompt lookup alone (no draft worker): the verify-only figure is the fleet's
    SPECSPLIT_TARGET_KV_POOL_GB=8 SPECSPLIT_CUDA_GRAPH_BODY=triton_gemm timeout "${LOOKUP_S:-40}" \
      python3 -m specsplit bench replay --device cuda $cfg \
      --trace tests/data/traces/humaneval0-9-qwen-coder-lookup-cpu2-amx.jsonl.gz --max-rounds "${LOOKUP_ROUNDS:-1000}" \
      --max-seconds "$((${LOOKUP_S:-40} - 10))" \
      --json "$OUT/gpu-replay-lookup.json" 2>&1 | grep -v "^replay: session" | head -4
    # the rounds a draft on its own device gives (3 growth forwards a verify, told the lookup
    # chains: `specsplit bench growth --record-trace`), the 2-core fleet's trace gets 1-2
    SPECSPLIT_TARGET_KV_POOL_GB=8 SPECSPLIT_DRAFT_KV_POOL_GB=8 SPECSPLIT_CUDA_GRAPH_BODY=triton_gemm \
      timeout "${GROWN_S:-40}" python3 -m specsplit bench replay --device cuda $cfg --draft-config .whl/cfg/draft \
      --trace "${GROWN_TRACE:-ops/results/trace-growth-humaneval0-9-grown3-chains-cpu2-amx.jsonl.gz}" \
      --max-rounds "${GROWN_ROUNDS:-150}" --max-seconds "$((${GROWN_S:-40} - 10))" \
      --json "$OUT/gpu-replay-grown.json" 2>&1 | grep -v "^replay: session" | head -4
  fi
  python3 ops/gpu_summary.py "$OUT" > "$OUT/summary.md"  # in case the call's own limit ends what follows
  # the host's CPU ms a round per fleet process (the tiny fleet, on this machine's CPUs): the
  # orchestrator's is what the fleet replay below leaves out
  if [ "${FLEETCPU_S:-40}" -gt 0 ]; then
    timeout "${FLEETCPU_S:-40}" python3 ops/fleet_cpu.py --prompts 4 --json "$OUT/fleet-cpu.json" 2>&1 | tail -16
  fi
  if [ "${FLEET_S:-75}" -gt 0 ]; then  # the same trace through the fleet's processes: two workers on one device
    SPECSPLIT_TARGET_KV_POOL_GB=8 SPECSPLIT_DRAFT_KV_POOL_GB=8 SPECSPLIT_CUDA_GRAPH_BODY=triton_gemm \
      timeout "${FLEET_S:-75}" python3 -m specsplit bench replay --fleet --device cuda $cfg --draft-config .whl/cfg/draft \
      --trace "${REPLAY_TRACE:-tests/data/traces/humaneval0-9-qwen-coder-spares-cpu2-amx.jsonl.gz}" \
      --max-rounds "${REPLAY_ROUNDS:-300}" --max-seconds "$((${FLEET_S:-75} - 10))" \
      --json "$OUT/gpu-replay-fleet.json" 2>&1 | grep -v "^replay: session" | head -4
  fi
  if [ "${PAIR_S:-75}" -gt 0 ]; then  # the same through one `specsplit pair` process: a thread and stream per role
    SPECSPLIT_TARGET_KV_POOL_GB=8 SPECSPLIT_DRAFT_KV_POOL_GB=8 SPECSPLIT_CUDA_GRAPH_BODY=triton_gemm \
      timeout "${PAIR_S:-75}" python3 -m specsplit bench replay --fleet --pair --device cuda $cfg \
      --draft-config .whl/cfg/draft --trace "${REPLAY_TRACE:-tests/data/traces/humaneval0-9-qwen-coder-spares-cpu2-amx.jsonl.gz}" \
      --max-rounds "${REPLAY_ROUNDS:-300}" --max-seconds "$((${PAIR_S:-75} - 10))" \
      --json "$OUT/gpu-replay-pair.json" 2>&1 | grep -v "^replay: session" | head -4
  fi
  if [ "${OVERLAP_S:-45}" -gt 0 ]; then  # the same with both engines in one process, each on its own stream
    SPECSPLIT_TARGET_KV_POOL_GB=8 SPECSPLIT_DRAFT_KV_POOL_GB=8 SPECSPLIT_CUDA_GRAPH_BODY=triton_gemm \
      timeout "${OVERLAP_S:-45}" python3 -m specsplit bench replay --overlap --device cuda $cfg \
      --draft-config .whl/cfg/draft --trace "${REPLAY_TRACE:-tests/data/traces/humaneval0-9-qwen-coder-spares-cpu2-amx.jsonl.gz}" \
      --max-rounds "${REPLAY_ROUNDS:-300}" --max-seconds "$((${OVERLAP_S:-45} - 10))" \
      --json "$OUT/gpu-replay-overlap.json" 2>&1 | grep -v "^replay: session" | head -4
  fi
  # diagnostics last: where one graphed forward's time goes, per body
  if [ "${PROBE_S:-40}" -gt 0 ]; then
    for body in ${BODIES:-triton_gemm fused}; do
      timeout "$PROBE_S" python3 ops/gpu_probe.py $cfg --body "$body" --compile-shapes "${COMPILE:-}" \
        --json "$OUT/gpu-probe-$body.json" 2>&1 | grep '^|\|top kernels\|host top' | tail -9
    done
  fi
  python3 ops/gpu_summary.py "$OUT" | tee "$OUT/summary.md"  # every bar of this run in one table
  [ "${LONGCTX:-0}" = 1 ] || exit 0
  cd ops
  timeout "${ATTN_S:-60}" python3 gpu_attention.py cuda "$OUT/gpu-attention.json" 2>&1 | tee "$OUT/gpu-attention.log" | tail -18
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
