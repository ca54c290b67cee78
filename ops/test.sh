#!/usr/bin/env bash
# Set up (ops/setup.sh) and run the whole test suite. Usage: ./ops/test.sh [pytest args, e.g. -n 0]
set -euo pipefail
cd "$(dirname "$0")/.."
# tests/test_kubernetes.py runs the manifests with podman (runc; mmdebstrap makes its base image);
# without them it is skipped, so a failed install only warns. apt downloads while setup compiles.
apt_pid=""
if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v mmdebstrap >/dev/null; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap; } >/dev/null &
    apt_pid=$!
  fi
fi
./ops/setup.sh test,bench,gguf
if [ -n "$apt_pid" ] && ! wait "$apt_pid"; then
  echo "ops/test.sh: podman not installed; tests/test_kubernetes.py will be skipped" >&2
fi
. .venv/bin/activate
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
set +e
# two pytest workers, a test file each at a time (its module fixtures, fleets included, start once):
# many tests wait on processes they started, so one worker leaves a core idle; `-n 0` runs serially
# --no-loadscope-reorder: files in collection order (tests/conftest.py puts the longest first)
python -m pytest -q -ra --durations=25 -n 2 --dist loadfile --no-loadscope-reorder "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "ops/test.sh: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$rc"
