#!/usr/bin/env bash
# The prepared run for a lent GPU machine: one NVIDIA H100 80 GB (~78 GiB usable; an H200's ~139 GiB holds it too),
# bare and offline: python3 (3.12) with torch 2.11 and the packages of bench/gpu_image.txt, nothing else. Prepare the
# wheels it lacks here, then run it there as one command, carrying .whl (git-ignored):
#     bash bench/gpu_wheels.sh       # here: .whl/ (deepspeed, pydantic, ...: bench/gpu_wheels.txt), ~4 MiB
#     bash bench/gpu.sh              # there: results in $OUT (default bench-gpu-results/), at most 8 files < 16 MiB
# bench/gpu_rehearsal.sh rehearses it on a CPU (GPU_REHEARSAL=1: tiny shapes, a stand-in nvidia-smi) in an
# environment built like that machine's, with only the carried wheels added; scripts/test.sh runs the rehearsal.
#
# No step can end the script: each has its own timeout, a failure prints why and the next step runs; the summary at
# the end says what ran, what failed and each headline figure; the exit status counts the failed steps.
# Steps, the most valuable first; times and memory for one H100 80 GB (989 TFLOP/s bf16 dense):
#  0. install .whl/ (pip --no-index --no-deps --target), import everything the steps use       ~15 s, timeout 45
#  1. pretrain.py's own MFU against the card's peak: a 1.3B LLaMA-style model (24 layers, h 2048, 16 heads / 8 KV,
#     FFN 5632, s 2048, V 32000: 1.26e9 parameters), micro batch 4, global batch 16, bf16, 20 iterations, iterations
#     18-19 profiled (the costliest kernels' table in pretrain.txt; the trace gzipped beside it when under 16 MiB).
#     Time: 2.75e14 model FLOPs per iteration, 0.62 s at the goal of 45% MFU: 20 iterations ~13 s, + start-up
#     (imports, NCCL, 1.26e9 parameters initialised, Triton JIT) ~60 s.                            ~80 s, timeout 130
#     Memory: 18 B per parameter (bf16 weights and gradients 2 + 2, fp32 gradient accumulation 4, fp32 master and
#     Adam's m and v 12 with ZeRO-1 at DP 1) = 21.2 GiB; activations of one micro batch of 8,192 tokens 24 x 0.56 +
#     logits = 15.3 GiB; the planner's 40.8 GiB with 2 GiB of runtime overhead (tools/plan.py, same flags).
#  2. the same model in turns with the Hugging Face loop and a GEMM rate (bench/train_throughput.py --baseline hf
#     --no-plain-loop), micro batch 2. Memory: pretrain.py 33.3 GiB (tools/plan.py: 7.7 of it activations); the HF loop
#     fp32 weights, gradients, AdamW m and v 16 B x 1.26e9 = 18.8 GiB, autocast's bf16 weight copies 2.3, activations
#     ~8-10, logits in fp32 ~1.5 = ~32 GiB; the GEMM side two 8192^2 bf16 matrices, 0.25 GiB: ~66 GiB together
#     (the plain loop would add another ~30: left out). Time: a rotation is ~0.3 s + ~0.5 s + 20 GEMMs of 8192^3 at
#     ~790 TFLOP/s 0.03 s; 3 warm-up + 3 rounds of 4 rotations ~12 s, + three start-ups side by side ~90 s.
#                                                                                                  ~100 s, timeout 130
#  3. the fused ops on Triton against their references, and flash attention against torch's SDPA (bench/ops.py
#     --size large: s 2048, b 4, h 4096, 32 heads, FFN 11008, V 128256; no torch.compile, whose cold compiles of ~16
#     graphs alone overran). Time: ~20 Triton kernels JIT-compiled, ~2 s each; 9 ops x <= 3 backends x 15 calls of
#     <= 30 ms. Memory: the largest case is cross entropy's logits, 4 x 2048 x 128256 bf16 = 2 GiB, and the fp32
#     reference's temporaries ~8 GiB. Then fp8_linear: fc1's GEMM (8192 x 4096 -> 11008) forward and both backward
#     GEMMs in each FP8 recipe against bf16 F.linear, and their errors against fp32 (blockwise: one _scaled_mm per
#     128 of K, ~180 per call; untimed on a GPU so far).                                          ~60 s, timeout 85
#  4. memory: step 1's max allocated against the planner's prediction, both read from its log (no GPU time).
#  5. with 2 GPUs or more, every pipeline schedule at PP 2; with one, a line saying why not: NCCL refuses two ranks
#     of one communicator on one device.
#  6. FP8 against bf16: the model of step 1 in turns, pretrain.py in bf16 beside pretrain.py with --fp8-format e4m3
#     --fp8-recipe tensorwise (bench/train_throughput.py --baseline none --fp8-recipes tensorwise), micro batch 2
#     (the FP8 issue's goal: >= 1.3x bf16's tokens/s). Memory: two pretrain.py at 33.3 GiB (the FP8 side keeps FP8
#     copies for backward, no more) + the GEMM side: ~67 GiB. Time: as step 2 with one side fewer.  ~90 s, timeout 130
# At worst 45 + 130 + 130 + 85 + 30 + 130 = 550 s (9 min; a command may take 10); expected ~6 min, so that a rerun
# fits in the 15 a task gets.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-bench-gpu-results}"
PYTHON="${PYTHON:-python3}"
SITE="${SITE:-/tmp/megatron_ds_site}"
REHEARSAL="${GPU_REHEARSAL:-0}"
MAX_FILE_BYTES=$((16 * 1024 * 1024))
FILES=(gpu.txt pretrain.txt trace.json.gz train_throughput.txt ops.txt memory.txt pipeline_schedules.txt summary.txt)
FP8_FILE=train_throughput.txt  # step 6 appends to step 2's file: at most 8 files come back
mkdir -p "$OUT"
(cd "$OUT" && rm -f "${FILES[@]}")

if [ "$REHEARSAL" = 1 ]; then  # the same steps on a CPU, tiny
  MODEL=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-key-value-heads 2 --ffn-hidden-size 128
         --seq-length 64 --vocab-size 256)
  PRETRAIN_BATCHES=(--micro-batch-size 2 --global-batch-size 4 --train-iters 6 --log-interval 2
                    --profile-step-start 4 --profile-step-end 6)
  TURNS=(--micro-batch-size 2 --rounds 1 --rotations-per-round 2)
  OPS=(--size tiny --rounds 1 --rotations-per-round 2)
  FP8_TURNS=(--micro-batch-size 2 --rounds 1 --rotations-per-round 2)
else
  MODEL=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --num-key-value-heads 8 --ffn-hidden-size 5632
         --seq-length 2048 --vocab-size 32000)
  PRETRAIN_BATCHES=(--micro-batch-size 4 --global-batch-size 16 --train-iters 20 --log-interval 5
                    --profile-step-start 18 --profile-step-end 20)
  TURNS=(--micro-batch-size 2 --rounds 3 --rotations-per-round 4)
  OPS=(--size large --rounds 3 --rotations-per-round 4)
  FP8_TURNS=(--micro-batch-size 2 --rounds 3 --rotations-per-round 4)
fi
LLAMA=(--normalization RMSNorm --swiglu --use-rotary-position-embeddings --disable-bias-linear
       --untie-embeddings-and-output-weights)

SUMMARY=()
FAILED=0
run_step() {  # run_step NAME SECONDS FILE COMMAND...: the command's output to stdout and $OUT/FILE
  local name=$1 seconds=$2 file=$3 began=$SECONDS status outcome
  shift 3
  echo "=== $name (timeout ${seconds} s) -> $OUT/$file"
  timeout --kill-after 10 "$seconds" bash -c '"$@"' "$name" "$@" 2>&1 | tee -a "$OUT/$file"  # functions too
  status=${PIPESTATUS[0]}
  case "$status" in
    0) outcome="ok" ;;
    124|137) outcome="TIMED OUT after ${seconds} s" ;;
    *) outcome="FAILED (exit $status)" ;;
  esac
  [ "$status" = 0 ] || FAILED=$((FAILED + 1))
  SUMMARY+=("$(printf '%-22s %-26s %5s s' "$name" "$outcome" "$((SECONDS - began))")")
  echo "=== $name: $outcome"
}

install_and_check() {
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || echo "nvidia-smi failed"
  mkdir -p "$SITE"
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" --upgrade .whl/*.whl || return 1
  else
    echo "no .whl/: nothing installed (bash bench/gpu_wheels.sh makes it; the run must carry .whl)"
  fi
  "$PYTHON" - <<'PYTHON'
import importlib
import sys

MODULES = ("torch triton deepspeed transformers sentencepiece tokenizers safetensors tensorboard pydantic hjson einops "
           "megatron_ds.training bench.train_throughput bench.ops").split()
PRIVATE = {"torch.distributed.pipelining._backward": ("stage_backward_input", "stage_backward_weight")}  # ZB-H1's
missing = []
for name in MODULES + list(PRIVATE):
    try:
        module = importlib.import_module(name)
        for attribute in PRIVATE.get(name, ()):
            getattr(module, attribute)
        print(f"import {name}: {getattr(module, '__version__', 'ok')}")
    except Exception as error:  # any import failure is a finding of this step
        missing.append(f"{name} ({type(error).__name__}: {error})")
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none (CPU)'}")
if missing:
    print("missing: " + "; ".join(missing))
    sys.exit(1)
PYTHON
}

pretrain_mfu() {  # pretrain_mfu MODEL_AND_BATCH_FLAGS...
  local profiles="${TMPDIR:-/tmp}/megatron_ds_profile"
  rm -rf "$profiles"
  "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 pretrain.py "$@" --bf16 --hidden-dropout 0 \
    --attention-dropout 0 --mock-data --eval-interval 0 --profile --use-pytorch-profiler --profile-dir "$profiles" \
    || return
  keep_trace "$profiles"
}

keep_trace() {  # the rank 0 trace, gzipped, when it fits what comes back
  local trace
  trace=$(ls "$1"/profile_rank0_*.json 2>/dev/null | head -1)
  [ -n "$trace" ] || { echo "no profiler trace in $1"; return 1; }
  gzip -c "$trace" > "$OUT/trace.json.gz"
  if [ "$(stat -c %s "$OUT/trace.json.gz")" -ge "$MAX_FILE_BYTES" ]; then
    echo "trace: $(stat -c %s "$OUT/trace.json.gz") bytes gzipped, over 16 MiB: left out (the table above stays)"
    rm "$OUT/trace.json.gz"
  fi
}

pipeline_schedules() {
  local gpus
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
  if [ "$gpus" -lt 2 ]; then
    echo "pipeline schedules: skipped, PP 2 needs 2 GPUs and this machine has $gpus (NCCL refuses two ranks of one" \
      "communicator on one device)"
    return 0
  fi
  "$PYTHON" bench/pipeline_schedules.py --micro-batches 8 --hidden-size 512 --num-layers 8 --seq-length 512 \
    --rounds 3 --rotations-per-round 6
}

export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHON SITE OUT MAX_FILE_BYTES
export -f install_and_check pretrain_mfu keep_trace pipeline_schedules  # for run_step's timeout
run_step "0 install, imports" 45 gpu.txt install_and_check
run_step "1 pretrain.py MFU" 130 pretrain.txt pretrain_mfu "${MODEL[@]}" "${LLAMA[@]}" "${PRETRAIN_BATCHES[@]}"
run_step "2 turns with HF loop" 130 train_throughput.txt "$PYTHON" bench/train_throughput.py --family llama \
  "${MODEL[@]}" "${TURNS[@]}" --baseline hf --no-plain-loop
run_step "3 fused ops" 85 ops.txt "$PYTHON" bench/ops.py "${OPS[@]}" --backends reference triton sdpa
MEASURED=(--expect-measured)
[ "$REHEARSAL" = 1 ] && MEASURED=()
run_step "4 memory vs planner" 30 memory.txt "$PYTHON" bench/memory_vs_plan.py "$OUT/pretrain.txt" "${MEASURED[@]}"
run_step "5 pipeline schedules" 300 pipeline_schedules.txt pipeline_schedules
run_step "6 FP8 vs bf16" 130 "$FP8_FILE" "$PYTHON" bench/train_throughput.py --family llama "${MODEL[@]}" \
  "${FP8_TURNS[@]}" --baseline none --fp8-recipes tensorwise

LAST_LINE_FIGURES="elapsed time per iteration \(ms\): [0-9.]+|TFLOP/s per device: [0-9.]+|MFU: [0-9.]+%"
headlines() {
  grep -h "MFU peak per device" "$OUT/pretrain.txt" | tail -1
  grep -h " iteration .* MFU" "$OUT/pretrain.txt" | tail -1 | grep -oE "$LAST_LINE_FIGURES" | paste -sd ';' -
  grep -hE "MFU vs GEMM|pretrain.py / HF loop|bf16 GEMM" "$OUT/train_throughput.txt" |
    sed -E 's/^.*(bf16 GEMM[^;]*);.*/\1/'
  grep -hE "^[a-z_]+ +(triton|sdpa|compile|apex) " "$OUT/ops.txt" | cut -c1-160
  grep -hE "^fp8_linear +(tensorwise|rowwise|blockwise) " "$OUT/ops.txt" | cut -c1-160
  grep -h "^memory" "$OUT/memory.txt"
  grep -hE "pretrain.py FP8 [a-z]+ / bf16 tokens/s" "$OUT/$FP8_FILE"
}
{
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  echo "=== summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $gpu)"
  printf '%s\n' "${SUMMARY[@]}"
  echo "--- headline figures"
  headlines 2>/dev/null
  echo "--- files in $OUT"
  ls -l "$OUT" | tail -n +2 | awk '{print $5, $9}'
} | tee "$OUT/summary.txt"
exit "$FAILED"
