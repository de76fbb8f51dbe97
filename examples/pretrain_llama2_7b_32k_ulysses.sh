#!/usr/bin/env bash
# A long-context LLaMA-2 7B (Touvron et al. 2023: 32 layers, hidden 4096, 32 heads, SwiGLU FFN 11008, RMSNorm,
# RoPE, no biases, untied embeddings, 32000-token SentencePiece vocabulary) at sequence 32,768, RoPE base
# 500,000 as LLaMA-2-Long (Xiong et al. 2023) extends it; global batch 64 sequences (2M tokens), lr 2e-5 ->
# 2e-6 cosine after 200 warm-up iterations, Adam 0.9/0.95 eps 1e-5, weight decay 0.1, clip 1.0, no dropout.
# The batch and schedule are this example's, not a published run's. DeepSpeed-Ulysses splits each sequence
# over 4 ranks (its all-to-alls inside a node, beside TP 2); layout on 32 A100-80GB (4 nodes x 8):
# TP 2 x Ulysses 4 x PP 2 x DP 2, Megatron SP, no recompute (tools/plan.py: 33.6 GiB on stage 0).
#
#   sbatch examples/pretrain_llama2_7b_32k_ulysses.sh                         # SLURM: 4 nodes x 8 GPUs (srun)
#   HOSTFILE=hosts NODES=4 bash examples/pretrain_llama2_7b_32k_ulysses.sh    # deepspeed --hostfile
#   PLAN=1 bash examples/pretrain_llama2_7b_32k_ulysses.sh [--search]         # tools/plan.py on these flags
#   DRY_RUN=1 bash examples/pretrain_llama2_7b_32k_ulysses.sh [--ranks all]   # tools/dry_run.py, fake ranks
#
#SBATCH --job-name=llama2-7b-32k-ulysses
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
NAME=llama2_7b_32k_ulysses
REPO=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$REPO"
source examples/common.sh

NODES=${NODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DEVICE=${DEVICE:-a100-80gb}
VOCAB_SIZE=32000            # LLaMA's SentencePiece tokenizer.model
TOKENIZER_ARGS=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "${TOKENIZER_MODEL:-tokenizer.model}")

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --num-attention-heads 32
    --ffn-hidden-size 11008
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --use-rotary-position-embeddings
    --rotary-base 500000
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --make-vocab-size-divisible-by 32
    --seq-length 32768
    --max-position-embeddings 32768
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --init-method-std 0.02
    --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --ds-sequence-parallel-size 4
    --pipeline-model-parallel-size 2
    --zero-stage 1
    --sequence-parallel
)
BATCH_ARGS=(
    --micro-batch-size 1
    --global-batch-size 64
)
TRAIN_ARGS=(
    --train-iters 10000
    --lr 2e-5 --min-lr 2e-6 --lr-decay-style cosine --lr-warmup-iters 200 --lr-decay-iters 10000
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --weight-decay 0.1 --clip-grad 1.0
    --seed 1234 --distributed-backend nccl
)
DS_ARGS=(--deepspeed --deepspeed_config ds_configs/llama2_7b_32k_ulysses.json)

launch "$@"
