#!/usr/bin/env bash
# Rehearse bench/gpu.sh on this CPU, so that an import, a flag, an API of the GPU machines' torch or the script's
# plumbing (timeouts, tee, pipefail, file sizes) fails here and not there: an environment built like those machines'
# (CPython 3.12 where this host has it, torch 2.11 and the rest of bench/gpu_image.txt; kept in .venv-gpu-image),
# the wheels of bench/gpu_wheels.sh installed the way bench/gpu.sh installs them (--target, PYTHONPATH), a stand-in
# nvidia-smi, and GPU_REHEARSAL=1 (tiny shapes). Fails when any step of bench/gpu.sh fails or a result file is over
# 16 MiB or there are more than 8 of them. scripts/test.sh runs it after the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GPU_IMAGE_VENV:-.venv-gpu-image}"
OUT="${OUT:-bench-gpu-rehearsal}"
began=$SECONDS

python_312() {  # the GPU machines' Python where this host has it (pyenv keeps versions off PATH), else python3
  local candidate
  for candidate in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
  echo "gpu_rehearsal: no CPython 3.12 here; rehearsing with $(python3 --version)" >&2
  echo python3
}

image_torch() {
  sed -nE 's/^torch==([0-9.]+)$/\1/p' bench/gpu_image.txt
}

free_gib() {  # on the filesystem that will hold the environment
  df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }'
}

NEEDED_GIB=9  # ~5 GiB installed (torch's CUDA libraries) + ~3 GiB of wheels pip holds in its temporary folder until done
if ! "$VENV/bin/python" -c "import torch, transformers, triton; assert torch.__version__.startswith('$(image_torch)')" \
    2>/dev/null; then
  rm -rf "$VENV"
  if [ "$(free_gib)" -lt "$NEEDED_GIB" ]; then
    echo "gpu_rehearsal: NOT RUN: $(free_gib) GiB free under $PWD; building $VENV (torch $(image_torch)," \
      "the CUDA build) needs about $NEEDED_GIB GiB" >&2
    exit 0
  fi
  "$(python_312)" -m venv "$VENV"
  "$VENV/bin/pip" install -q --no-cache-dir --upgrade pip
  # PyPI's torch for Linux is the CUDA build; it runs on a CPU (and is the build the GPU machines have)
  "$VENV/bin/pip" install -q --no-cache-dir -r bench/gpu_image.txt  # no second copy in the cache
fi
PYTHON="$VENV/bin/python" bash bench/gpu_wheels.sh

stand_in=$(mktemp -d)
trap 'rm -rf "$stand_in"' EXIT
cat > "$stand_in/nvidia-smi" <<'SCRIPT'
#!/usr/bin/env bash
# bench/gpu_rehearsal.sh's stand-in: no GPU listed
case "$*" in
  *--list-gpus*) ;;
  *noheader*) echo "CPU rehearsal (no GPU)" ;;
  *) printf 'name, memory.total [MiB], clocks.max.sm [MHz]\nCPU rehearsal (no GPU), 0 MiB, 0 MHz\n' ;;
esac
SCRIPT
chmod +x "$stand_in/nvidia-smi"

status=0
PATH="$stand_in:$PATH" GPU_REHEARSAL=1 PYTHON="$VENV/bin/python" OUT="$OUT" SITE="$stand_in/site" \
  bash bench/gpu.sh || status=$?
files=$(find "$OUT" -type f | wc -l)
large=$(find "$OUT" -type f -size +16M)
if [ "$files" -gt 8 ] || [ -n "$large" ]; then
  echo "gpu_rehearsal: $files result files (at most 8 come back), over 16 MiB: ${large:-none}" >&2
  status=1
fi
echo "gpu_rehearsal: bench/gpu.sh exit $status, $files result files in $OUT, $((SECONDS - began)) s in all"
exit "$status"
