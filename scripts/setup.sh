#!/usr/bin/env bash
# Create the virtual environment (default .venv, or $VENV) with torch (CPU build on CPU-only hosts),
# DeepSpeed and the project; quick no-op when it is already complete.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if [ -x "$VENV/bin/ruff" ] && "$VENV/bin/python" -c "import torch, deepspeed, megatron_ds, tensorboard, pytest, pytest_timeout, transformers, safetensors, wandb" 2>/dev/null; then
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1; then
  "$VENV/bin/pip" install -q torch
else
  "$VENV/bin/pip" install -q torch==2.13.0
fi
"$VENV/bin/pip" install -q -r requirements.txt
"$VENV/bin/pip" install -q -e .
if command -v mpicc >/dev/null 2>&1; then  # mpirun across hosts finds rank 0's address through mpi4py
  "$VENV/bin/pip" install -q mpi4py
fi
