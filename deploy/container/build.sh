#!/usr/bin/env bash
# Build the SpecSplit image (Containerfile): wheels of the project and every dependency on this
# host, with pip's own configuration (index, find-links), then a build with no network inside.
#   deploy/container/build.sh [TAG]          # default localhost/specsplit:latest
# Environment: BASE (the base image, default python:3.11-slim; any base with Python 3.11),
# ENGINE (podman or docker, default podman), PYTHON (a Python 3.11 with pip: default .venv's).
# Which torch goes in is whichever wheel pip picks here: PyPI's default is the CUDA build (the GPU
# image); for a CPU image point pip at the CPU wheels (PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL).
set -euo pipefail
cd "$(dirname "$0")/../.."
TAG=${1:-localhost/specsplit:latest}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
rm -rf build/wheels
"$PYTHON" -m pip wheel -q --disable-pip-version-check --wheel-dir build/wheels . pip
start=$(date +%s)
"${ENGINE:-podman}" build --build-arg "BASE=${BASE:-python:3.11-slim}" -f Containerfile -t "$TAG" .
echo "build.sh: $TAG built in $(( $(date +%s) - start ))s" >&2
