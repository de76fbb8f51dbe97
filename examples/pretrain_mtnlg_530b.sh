#!/usr/bin/env bash
# Megatron-Turing NLG 530B (Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG
# 530B", arXiv 2201.11990): 105 layers, hidden 20480, 128 heads, sequence 2048, GPT-2 BPE vocabulary;
# TP 8 x PP 35 = 280 GPUs per replica, ZeRO-1, bf16, full activation recompute; global batch 1920, ramped
# up from 32 in steps of 32 over the first 12B tokens (5,859,375 samples); 270B training tokens.
# The paper's throughput runs used 280, 350 and 420 DGX A100 nodes (DP 8, 10, 12).
# Optimizer values (lr 5e-5 -> 5e-6 cosine over 340B tokens, warm-up over 1B tokens, Adam 0.9/0.95,
# weight decay 0.1, clip 1.0, init std 0.004) are as we recall the paper; they were not verified against
# its text here. Iteration counts follow Megatron's ramp (+32 every 99,311 samples): 80,087 iterations =
# 270B tokens, warm-up 7,036, decay 97,889.
#
#   sbatch examples/pretrain_mtnlg_530b.sh                        # SLURM: 280 nodes x 8 GPUs (srun)
#   HOSTFILE=hosts NODES=280 bash examples/pretrain_mtnlg_530b.sh # deepspeed --hostfile
#   PLAN=1 bash examples/pretrain_mtnlg_530b.sh [--search]        # tools/plan.py on these flags, no GPU
#   DRY_RUN=1 bash examples/pretrain_mtnlg_530b.sh [--step]       # tools/dry_run.py: each stage's start-up, fake ranks
#
#SBATCH --job-name=mtnlg-530b
#SBATCH --nodes=280
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
NAME=mtnlg_530b
REPO=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$REPO"
source examples/common.sh

NODES=${NODES:-280}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DEVICE=${DEVICE:-a100-80gb}
VOCAB_SIZE=50257            # GPT-2 BPE (padded to 51200 for TP 8)
TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB_FILE:-gpt2-vocab.json}"
                --merge-file "${MERGE_FILE:-gpt2-merges.txt}")

MODEL_ARGS=(
    --num-layers 105
    --hidden-size 20480
    --num-attention-heads 128
    --seq-length 2048
    --max-position-embeddings 2048
    --init-method-std 0.004
    --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 35
    --zero-stage 1
    --recompute-granularity full
    --recompute-method uniform
    --recompute-num-layers 1
)
BATCH_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1920
)
TRAIN_ARGS=(
    --rampup-batch-size 32 32 5859375
    --train-iters 80087
    --lr 5.0e-5 --min-lr 5.0e-6 --lr-decay-style cosine --lr-warmup-iters 7036 --lr-decay-iters 97889
    --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0
    --seed 1234 --distributed-backend nccl
)
DS_ARGS=(--deepspeed --deepspeed_config ds_configs/mtnlg_530b.json)

launch "$@"
