#!/usr/bin/env bash
# DeepSpeed-MoE's 1.3B+MoE-128 (Rajbhandari et al. 2022; Megatron-DeepSpeed's
# examples_deepspeed/MoE/ds_pretrain_gpt_1.3B_MoE128.sh): the GPT-3 XL base (24 layers, hidden 2048, 16 heads,
# sequence 2048, GPT-2 BPE vocabulary) with 128 experts in every second layer (12 MoE layers, 52B parameters),
# top-1 routing, capacity factor 1.0 (min 4), load-balancing loss coefficient 0.01; global batch 512 sequences
# (1M tokens), 300B tokens, lr 1.2e-4 -> 1e-6 cosine over 300B tokens after 375M warm-up tokens, Adam
# 0.9/0.95, weight decay 0.1, clip 1.0, init std 0.014, activation checkpointing.
# Layout: 128 A100-80GB (16 nodes x 8), EP 128 (one expert of each MoE layer per GPU) x DP 128, ZeRO-1, bf16.
#
#   sbatch examples/pretrain_gpt_1.3b_moe128.sh                          # SLURM: 16 nodes x 8 GPUs (srun)
#   HOSTFILE=hosts NODES=16 bash examples/pretrain_gpt_1.3b_moe128.sh    # deepspeed --hostfile
#   PLAN=1 bash examples/pretrain_gpt_1.3b_moe128.sh [--search]          # tools/plan.py on these flags, no GPU
#   DRY_RUN=1 bash examples/pretrain_gpt_1.3b_moe128.sh [--ranks all]    # tools/dry_run.py: start-up, fake ranks
#
#SBATCH --job-name=gpt-1.3b-moe128
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
NAME=gpt_1.3b_moe128
REPO=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$REPO"
source examples/common.sh

NODES=${NODES:-16}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DEVICE=${DEVICE:-a100-80gb}
VOCAB_SIZE=50257            # GPT-2 BPE (padded to 50304)
TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB_FILE:-gpt2-vocab.json}"
                --merge-file "${MERGE_FILE:-gpt2-merges.txt}")

MODEL_ARGS=(
    --num-layers 24
    --hidden-size 2048
    --num-attention-heads 16
    --seq-length 2048
    --max-position-embeddings 2048
    --num-experts 128
    --expert-interval 2
    --topk 1
    --moe-train-capacity-factor 1.0
    --moe-eval-capacity-factor 1.0
    --moe-min-capacity 4
    --moe-loss-coeff 0.01
    --init-method-std 0.014
    --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --moe-expert-parallel-size 128
    --zero-stage 1
    --checkpoint-activations
)
BATCH_ARGS=(
    --micro-batch-size 4
    --global-batch-size 512
)
TRAIN_ARGS=(
    --train-tokens 300000000000 --train-iters 286103
    --lr 1.2e-4 --min-lr 1.0e-6 --lr-decay-style cosine --lr-warmup-tokens 375000000
    --lr-decay-tokens 300000000000
    --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0
    --create-moe-param-group --seed 1234 --distributed-backend nccl
)
DS_ARGS=(--deepspeed --deepspeed_config ds_configs/gpt_1.3b_moe128.json)

launch "$@"
