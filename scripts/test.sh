#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
bash scripts/setup.sh
OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q "$@"
