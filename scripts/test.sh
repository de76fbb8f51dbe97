#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU, then rehearse bench/gpu.sh in an environment built like the
# lent GPU machines' (torch 2.11, bench/gpu_rehearsal.sh; SKIP_GPU_REHEARSAL=1 leaves it out). The suite runs on the
# newest torch the project supports (2.13), the rehearsal on the oldest (2.11).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
bash scripts/setup.sh
# JIT-built ops in a cache of this environment's own (another checkout's sources rebuild them in the shared one),
# built before any test can kill a build halfway (tests/support/build_ops.py)
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/$VENV/torch_extensions}"
timeout 1200 "$VENV/bin/python" -m tests.support.build_ops
status=0
OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q "$@" || status=$?
if [ "${SKIP_GPU_REHEARSAL:-0}" != 1 ]; then
  timeout 1200 bash bench/gpu_rehearsal.sh || status=$((status ? status : 1))
fi
exit "$status"
