#!/usr/bin/env bash
# Set up a virtualenv (if needed) and run the whole test suite. Usage: ./ops/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check "torch==2.13.0"
python -m pip install -q --disable-pip-version-check -e ".[test]"
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
set +e
python -m pytest -q -ra "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "ops/test.sh: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$rc"
