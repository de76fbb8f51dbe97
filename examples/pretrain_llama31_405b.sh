#!/usr/bin/env bash
# LLaMA-3.1 405B (Llama Team, Meta 2024, "The Llama 3 Herd of Models", arXiv 2407.21783; tables 3 and 4, section
# 3.4): 126 layers, hidden 16384, 128 heads with 8 key/value heads (GQA), SwiGLU FFN 53248, RMSNorm (eps 1e-5),
# RoPE theta 500,000, no biases, untied embeddings, a 128K vocabulary (128,256 entries, padded to 129,024 for
# TP 8), sequence 8192 (the pretraining's; LLaMA-3.1's RoPE scaling comes with the long-context stage). AdamW
# 0.9/0.95, weight decay 0.1, clip 1.0; peak learning rate 8e-5, 8,000 warm-up steps, cosine to 8e-7 over
# 1,200,000 steps; batch 16M tokens (2048 sequences), reached from 4M and 8M tokens (here a linear ramp from 512
# sequences in steps of 512 over the first 2.87T tokens, 350,341,797 samples); 15.6T tokens. The init std is not
# published (0.02 here).
# Layout as published for 8K pretraining (table 4): 16,384 H100 GPUs, TP 8, PP 16, DP 128, no context parallelism;
# Meta gave the first and the last stage one layer less (for the embedding and the loss): Megatron-LM's
# --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split, 7 + 14 x 8 + 7 layers. Meta ran
# an interleaved schedule; pretrain.py's interleaved engine needs 2 x PP = 32 micro-batches per data-parallel rank
# and the 16M-token batch gives 16, so this script runs 1F1B (the planner: bubble 48%; with 2 virtual stages it
# plans 32%). To fit 80 GB (the planner: 62 GiB at the fullest stage) the first 4 layers of each stage are
# recomputed whole (--recompute-method block).
#
#   sbatch examples/pretrain_llama31_405b.sh                         # SLURM: 2048 nodes x 8 GPUs (srun)
#   HOSTFILE=hosts NODES=2048 bash examples/pretrain_llama31_405b.sh # deepspeed --hostfile
#   PLAN=1 bash examples/pretrain_llama31_405b.sh                    # tools/plan.py on these flags, no GPU
#   DRY_RUN=1 bash examples/pretrain_llama31_405b.sh [--step]        # tools/dry_run.py: each stage's start-up
#
#SBATCH --job-name=llama31-405b
#SBATCH --nodes=2048
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
NAME=llama31_405b
REPO=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$REPO"
source examples/common.sh

NODES=${NODES:-2048}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DEVICE=${DEVICE:-h100-80gb}
VOCAB_SIZE=128256           # LLaMA-3's tokenizer
TOKENIZER_ARGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:-tokenizer.json}")

MODEL_ARGS=(
    --num-layers 126
    --hidden-size 16384
    --ffn-hidden-size 53248
    --num-attention-heads 128
    --num-key-value-heads 8
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --use-rotary-position-embeddings
    --rotary-base 500000
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --seq-length 8192
    --max-position-embeddings 8192
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --init-method-std 0.02
    --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --sequence-parallel
    --pipeline-model-parallel-size 16
    --account-for-embedding-in-pipeline-split
    --account-for-loss-in-pipeline-split
    --zero-stage 1
    --recompute-granularity full
    --recompute-method block
    --recompute-num-layers 4
)
BATCH_ARGS=(
    --micro-batch-size 1
    --global-batch-size 2048
)
TRAIN_ARGS=(
    --rampup-batch-size 512 512 350341797
    --train-iters 1200000 --train-tokens 15600000000000
    --lr 8e-5 --min-lr 8e-7 --lr-decay-style cosine --lr-warmup-iters 8000 --lr-decay-iters 1200000
    --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0
    --seed 1234 --distributed-backend nccl
)
DS_ARGS=(--deepspeed --deepspeed_config ds_configs/llama31_405b.json)

launch "$@"
