#!/usr/bin/env bash
# Create .venv (if needed) and install SpecSplit. Idempotent.
#   ./ops/setup.sh             # the serving system only (what ./ops/demo.sh needs)
#   ./ops/setup.sh test,bench  # plus the test and benchmark extras (what ./ops/test.sh needs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${EXTRAS:+[$EXTRAS]}"
