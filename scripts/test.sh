#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
bash scripts/setup.sh
# JIT-built ops in a cache of this environment's own (another checkout's sources rebuild them in the shared one),
# built before any test can kill a build halfway (tests/build_ops.py)
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/$VENV/torch_extensions}"
timeout 1200 "$VENV/bin/python" -m tests.build_ops
OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q "$@"
