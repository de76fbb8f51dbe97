#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels bench/gpu.sh installs on a lent GPU machine, which reaches no package
# registry: those of bench/gpu_wheels.txt for CPython 3.12 on manylinux x86_64, deepspeed's built here from its source
# release (PyPI has no deepspeed wheel; it is pure Python, its ops built just in time). Run on a machine that reaches
# PyPI, from any environment whose python has torch (deepspeed's setup.py imports it):
#     bash bench/gpu_wheels.sh            # PYTHON=.venv/bin/python by default
# The working tree travels to the machine with at most 64 MiB in all; this script refuses to leave more in .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
WHEELS="${WHEELS:-.whl}"
LIMIT_MIB=16  # of the tree's 64 MiB, leaving the rest to the sources
TARGET=(--python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any)

mkdir -p "$WHEELS"
rm -f "$WHEELS"/*.whl
mapfile -t requirements < <(grep -vE '^\s*(#|$)' bench/gpu_wheels.txt)
binary=()
for requirement in "${requirements[@]}"; do
  case "$requirement" in
    deepspeed==*) "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation "$requirement" -w "$WHEELS" ;;
    *) binary+=("$requirement") ;;
  esac
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${TARGET[@]}" -d "$WHEELS" "${binary[@]}"

count=$(ls "$WHEELS"/*.whl | wc -l)
if [ "$count" -ne "${#requirements[@]}" ]; then
  echo "bench/gpu_wheels.sh: $count wheels in $WHEELS for ${#requirements[@]} requirements of bench/gpu_wheels.txt" >&2
  exit 1
fi
size_kib=$(du -sk "$WHEELS" | cut -f1)
if [ "$size_kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "bench/gpu_wheels.sh: $WHEELS holds $((size_kib / 1024)) MiB, more than the $LIMIT_MIB MiB it may take of the" \
    "64 MiB the working tree travels in" >&2
  exit 1
fi
ls -1 "$WHEELS"
echo "$count wheels, $((size_kib / 1024)) MiB in $WHEELS"
