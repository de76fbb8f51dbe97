#!/usr/bin/env bash
# The 1T-parameter GPT of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
# Clusters Using Megatron-LM", arXiv 2104.04473, Table 1): 128 layers, hidden 25600, 160 heads, sequence
# 2048; TP 8 x PP 64 = 512 GPUs per replica x DP 6 = 3072 GPUs, global batch 3072. That paper measured
# throughput (with its interleaved schedule, which DeepSpeed's pipeline does not have: 1F1B here) and
# published no training recipe; the optimizer values below are GPT-3-style, 300B tokens = 47,684 iterations.
# Sequence parallelism and selective recompute (Korthikanti et al. 2022) keep activations small.
#
#   sbatch examples/pretrain_gpt_1t.sh                             # SLURM: 384 nodes x 8 GPUs (srun)
#   HOSTFILE=hosts NODES=384 bash examples/pretrain_gpt_1t.sh      # deepspeed --hostfile
#   PLAN=1 bash examples/pretrain_gpt_1t.sh [--search]             # tools/plan.py on these flags, no GPU
#   DRY_RUN=1 bash examples/pretrain_gpt_1t.sh [--ranks all]       # tools/dry_run.py: each stage's start-up, fake ranks
#
#SBATCH --job-name=gpt-1t
#SBATCH --nodes=384
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
NAME=gpt_1t
REPO=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$REPO"
source examples/common.sh

NODES=${NODES:-384}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DEVICE=${DEVICE:-a100-80gb}
VOCAB_SIZE=50257            # GPT-2 BPE (padded to 51200 for TP 8)
TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB_FILE:-gpt2-vocab.json}"
                --merge-file "${MERGE_FILE:-gpt2-merges.txt}")

MODEL_ARGS=(
    --num-layers 128
    --hidden-size 25600
    --num-attention-heads 160
    --seq-length 2048
    --max-position-embeddings 2048
    --init-method-std 0.005
    --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 64
    --zero-stage 1
    --sequence-parallel
    --recompute-activations
)
BATCH_ARGS=(
    --micro-batch-size 1
    --global-batch-size 3072
)
TRAIN_ARGS=(
    --train-iters 47684
    --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine --lr-warmup-iters 500 --lr-decay-iters 47684
    --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0
    --seed 1234 --distributed-backend nccl
)
DS_ARGS=(--deepspeed --deepspeed_config ds_configs/gpt_1t.json)

launch "$@"
