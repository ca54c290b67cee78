#!/usr/bin/env bash
# Set up (ops/setup.sh) and run the whole test suite. Usage: ./ops/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
./ops/setup.sh test,bench,gguf
. .venv/bin/activate
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
set +e
python -m pytest -q -ra "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "ops/test.sh: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$rc"
