#!/usr/bin/env bash
# GPT-3 175B (Brown et al. 2020): 96 layers, hidden 12288, 96 heads, sequence 2048, GPT-2 BPE vocabulary;
# global batch 1536 (3.2M tokens), 300B tokens. Layout TP 8 x PP 16 (128 GPUs per replica) x DP 8 on
# 128 nodes of 8 GPUs, with sequence parallelism and selective recompute (Korthikanti et al. 2022).
# Optimizer and ramp as Megatron-LM's GPT-3 175B example (lr 6e-5 -> 6e-6 cosine, Adam 0.9/0.95, weight
# decay 0.1, init std 0.006, batch ramp 16 -> 1536 over 5,859,375 samples), converted from samples to
# iterations with Megatron's ramp: 111,355 iterations = 300B tokens, warm-up 7,028, decay 98,640.
#
#   sbatch examples/pretrain_gpt3_175b.sh                          # SLURM: 128 nodes x 8 GPUs (srun)
#   HOSTFILE=hosts NODES=128 bash examples/pretrain_gpt3_175b.sh   # deepspeed --hostfile
#   PLAN=1 bash examples/pretrain_gpt3_175b.sh [--search]          # tools/plan.py on these flags, no GPU
#   DRY_RUN=1 bash examples/pretrain_gpt3_175b.sh [--ranks all]    # tools/dry_run.py: each stage's start-up, fake ranks
#
#SBATCH --job-name=gpt3-175b
#SBATCH --nodes=128
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
NAME=gpt3_175b
REPO=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$REPO"
source examples/common.sh

NODES=${NODES:-128}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DEVICE=${DEVICE:-a100-80gb}
VOCAB_SIZE=50257            # GPT-2 BPE (padded to 51200 for TP 8)
TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB_FILE:-gpt2-vocab.json}"
                --merge-file "${MERGE_FILE:-gpt2-merges.txt}")

MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --init-method-std 0.006
    --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
    --zero-stage 1
    --sequence-parallel
    --recompute-activations
)
BATCH_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
)
TRAIN_ARGS=(
    --rampup-batch-size 16 16 5859375
    --train-iters 111355
    --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine --lr-warmup-iters 7028 --lr-decay-iters 98640
    --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0
    --seed 1234 --distributed-backend nccl
)
DS_ARGS=(--deepspeed --deepspeed_config ds_configs/gpt3_175b.json)

launch "$@"
