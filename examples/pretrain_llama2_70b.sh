#!/usr/bin/env bash
# A LLaMA-2-style 70B (Touvron et al. 2023): 80 layers, hidden 8192, 64 heads with 8 key/value heads
# (GQA), SwiGLU FFN 28672, RMSNorm (eps 1e-5), RoPE, no biases, untied embeddings, 32000-token
# SentencePiece vocabulary (not padded: 32000 is a multiple of 32 x TP 8), sequence 4096, global batch
# 1024 sequences (4M tokens), 2T tokens = 476,837 iterations, lr 1.5e-4 -> 1.5e-5 cosine after 2000
# warm-up iterations, Adam 0.9/0.95 eps 1e-5, weight decay 0.1, clip 1.0, no dropout.
# Layout from tools/plan.py --search on 1024 A100-80GB: TP 8 x PP 8 x DP 16, SP + selective recompute.
#
#   sbatch examples/pretrain_llama2_70b.sh                         # SLURM: 128 nodes x 8 GPUs (srun)
#   HOSTFILE=hosts NODES=128 bash examples/pretrain_llama2_70b.sh  # deepspeed --hostfile
#   PLAN=1 bash examples/pretrain_llama2_70b.sh [--search]         # tools/plan.py on these flags, no GPU
#   DRY_RUN=1 bash examples/pretrain_llama2_70b.sh [--ranks all]   # tools/dry_run.py: each stage's start-up, fake ranks
#
#SBATCH --job-name=llama2-70b
#SBATCH --nodes=128
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
NAME=llama2_70b
REPO=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$REPO"
source examples/common.sh

NODES=${NODES:-128}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DEVICE=${DEVICE:-a100-80gb}
VOCAB_SIZE=32000            # LLaMA's SentencePiece tokenizer.model
TOKENIZER_ARGS=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "${TOKENIZER_MODEL:-tokenizer.model}")

MODEL_ARGS=(
    --num-layers 80
    --hidden-size 8192
    --num-attention-heads 64
    --num-key-value-heads 8
    --ffn-hidden-size 28672
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --use-rotary-position-embeddings
    --rotary-base 10000
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --make-vocab-size-divisible-by 32
    --seq-length 4096
    --max-position-embeddings 4096
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --init-method-std 0.02
    --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 8
    --zero-stage 1
    --sequence-parallel
    --recompute-activations
)
BATCH_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1024
)
TRAIN_ARGS=(
    --train-iters 476837
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --lr-decay-iters 476837
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --weight-decay 0.1 --clip-grad 1.0
    --seed 1234 --distributed-backend nccl
)
DS_ARGS=(--deepspeed --deepspeed_config ds_configs/llama2_70b.json)

launch "$@"
