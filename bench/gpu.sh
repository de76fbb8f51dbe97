#!/usr/bin/env bash
# One prepared run for a machine with one NVIDIA H200 (bf16 dense peak ~990 TFLOP/s; ~790 measured on a
# large GEMM). Finishes within ~10 minutes on one GPU:
#   1. the fused-op benchmarks with the Triton backend against the references (bench/ops.py);
#   2. training MFU of a 1.3B LLaMA-style model on one GPU, beside a plain PyTorch loop and the Hugging Face
#      model of the same shapes (bench/train_throughput.py: the four processes - GEMM, pretrain.py, both loops -
#      share the GPU, taking turns iteration by iteration; micro batch 2 so that all fit), then the same model
#      through pretrain.py with the datasheet peak (--peak-tflops 989), profiling iterations 18-19 (the table of
#      costliest kernels is in pretrain_llama_1b3.txt, the trace beside it);
#   3. on a machine with 2 GPUs or more, every pipeline schedule at PP 2 (bench/pipeline_schedules.py, ~4 more
#      minutes); with one GPU this step says why it is skipped: NCCL (2.5 and later) refuses two ranks of one
#      communicator on one device, so PP 2 needs two.
# Output goes to stdout and to $OUT (default bench-gpu-results/).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench-gpu-results}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"

timeout 150 "$PYTHON" bench/ops.py 2>&1 | tee "$OUT/ops.txt"

LLAMA_1B3=(--family llama --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --num-key-value-heads 8
           --ffn-hidden-size 5632 --seq-length 2048 --micro-batch-size 2 --vocab-size 32000 --rounds 2
           --rotations-per-round 4 --fusion-backend triton --baseline hf)
timeout 300 "$PYTHON" bench/train_throughput.py "${LLAMA_1B3[@]}" 2>&1 | tee "$OUT/train_throughput.txt"

timeout 150 torchrun --nproc_per_node 1 pretrain.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
  --num-key-value-heads 8 --ffn-hidden-size 5632 --normalization RMSNorm --swiglu --use-rotary-position-embeddings \
  --disable-bias-linear --untie-embeddings-and-output-weights --seq-length 2048 --micro-batch-size 4 \
  --global-batch-size 16 --train-iters 20 --bf16 --hidden-dropout 0 --attention-dropout 0 --mock-data \
  --vocab-size 32000 --log-interval 5 --eval-interval 0 --fusion-backend triton --peak-tflops 989 \
  --profile --use-pytorch-profiler --profile-step-start 18 --profile-step-end 20 --profile-dir "$OUT" \
  2>&1 | tee "$OUT/pretrain_llama_1b3.txt" | grep -E "iteration|fused ops|error"

GPUS=$(nvidia-smi --list-gpus | wc -l)
if [ "$GPUS" -ge 2 ]; then
  timeout 300 "$PYTHON" bench/pipeline_schedules.py --micro-batches 8 --hidden-size 512 --num-layers 8 \
    --seq-length 512 --rounds 3 --rotations-per-round 6 2>&1 | tee "$OUT/pipeline_schedules.txt"
else
  echo "pipeline schedules: skipped, PP 2 needs 2 GPUs and this machine has $GPUS (NCCL refuses two ranks on one" \
    "device)" | tee "$OUT/pipeline_schedules.txt"
fi
