#!/usr/bin/env bash
# Build the SpecSplit image (Containerfile): wheels of the project and every dependency on this
# host, with pip's own configuration (index, find-links), then a build with no network inside.
# A rebuild after a code change reuses the dependencies' layer and builds the project's.
#   deploy/container/build.sh [TAG]          # default localhost/specsplit:latest
# Environment: BASE (the base image, default python:3.11-slim; any base with Python 3.11),
# ENGINE (podman or docker, default podman), PYTHON (a Python 3.11 with pip: default .venv's).
# Which torch goes in is whichever wheel pip picks here: PyPI's default is the CUDA build (the GPU
# image); for a CPU image point pip at the CPU wheels (PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL).
set -euo pipefail
cd "$(dirname "$0")/../.."
TAG=${1:-localhost/specsplit:latest}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
rm -rf build/wheels build/project
"$PYTHON" -m pip wheel -q --disable-pip-version-check --wheel-dir build/wheels . pip
# the project's wheel apart from its dependencies' (two layers), and each folder's digest, which
# the Containerfile COPYs before the step that mounts the folder
mkdir build/project && mv build/wheels/specsplit-*.whl build/project/
for dir in build/wheels build/project; do (cd "$dir" && sha256sum -- *.whl > SHA256SUMS); done
start=$(date +%s)
"${ENGINE:-podman}" build --build-arg "BASE=${BASE:-python:3.11-slim}" -f Containerfile -t "$TAG" .
echo "build.sh: $TAG built in $(( $(date +%s) - start ))s" >&2
