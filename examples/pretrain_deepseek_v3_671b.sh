#!/usr/bin/env bash
# DeepSeek-V3 671B (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv 2412.19437; section 4.2 and its
# appendix): 61 layers, hidden 7168, 128 heads of multi-latent attention (query latent 1536, key-value latent 512,
# qk 128 + rotary 64, value 128), the first 3 layers dense (FFN 18432), the other 58 MoE: 256 routed experts of
# FFN 2048 and 1 shared, top-8 by sigmoid scores limited to 4 of 8 expert groups, weights normalised and scaled
# by 2.5, auxiliary-loss-free balancing (bias update 0.001) with a sequence-wise balance loss of 1e-4; one
# multi-token prediction module (weight 0.3 for the first 10T tokens, 0.1 after); RMSNorm (eps 1e-6), SwiGLU,
# RoPE (theta 10000; YaRN comes with the later context extension), no biases, untied embeddings, init std 0.006,
# a 128K byte-level BPE vocabulary (129,280 entries), sequence 4096. 14.8T tokens; AdamW 0.9/0.95, weight decay
# 0.1, clip 1.0; batch ramped from 3072 to 15360 sequences over the first 469B tokens; learning rate warmed up to
# 2.2e-4 over 2K steps, held to 10T tokens, then cosine to 2.2e-5 over 4.3T (then 2.2e-5 and 7.3e-6 for the last
# 500B). Here the hold and the two last steps are not expressible (no WSD schedule): cosine from the warm-up to
# 2.2e-5 at 14.3T tokens instead. The ramp starts at 4096 sequences, not 3072: DualPipeV needs 2 x PP = 32
# micro-batches per data-parallel rank (3072 over DP 128 makes 24). DeepSeek trained in FP8; this script in bf16,
# with full recompute to fit 80 GB (DeepSeek recomputed the norms and MLA's up-projections only).
# Layout as published: 2,048 H800 GPUs, PP 16 under DualPipe (here DualPipeV, its V form: 32 model stages, rank r
# holding stages r and 31 - r), EP 64 over 8 nodes, ZeRO-1 data parallelism (DP 128), no TP. 61 layers do not split
# evenly into 32 stages: Megatron-LM's --pipeline-model-parallel-layout gives rank 0's first stage the embedding and
# 1 layer, every other stage 2, and rank 0's second (the V's last) the MTP module and the head.
#
#   sbatch examples/pretrain_deepseek_v3_671b.sh                        # SLURM: 256 nodes x 8 GPUs (srun)
#   HOSTFILE=hosts NODES=256 bash examples/pretrain_deepseek_v3_671b.sh # deepspeed --hostfile
#   PLAN=1 bash examples/pretrain_deepseek_v3_671b.sh                   # tools/plan.py on these flags, no GPU
#   DRY_RUN=1 bash examples/pretrain_deepseek_v3_671b.sh [--step]       # tools/dry_run.py: each stage's start-up
#
#SBATCH --job-name=deepseek-v3-671b
#SBATCH --nodes=256
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
NAME=deepseek_v3_671b
REPO=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$REPO"
source examples/common.sh

NODES=${NODES:-256}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
DEVICE=${DEVICE:-h800}
VOCAB_SIZE=129280           # DeepSeek-V3's tokenizer (a multiple of 128: no padding)
TOKENIZER_ARGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:-tokenizer.json}")

MODEL_ARGS=(
    --num-layers 61
    --hidden-size 7168
    --ffn-hidden-size 18432
    --num-attention-heads 128
    --multi-latent-attention
    --q-lora-rank 1536
    --kv-lora-rank 512
    --qk-head-dim 128
    --qk-pos-emb-head-dim 64
    --v-head-dim 128
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --position-embedding-type rope
    --rotary-base 10000
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --seq-length 4096
    --max-position-embeddings 4096
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --init-method-std 0.006
    --num-experts 256
    --moe-layer-freq "[0]*3+[1]*58"
    --moe-ffn-hidden-size 2048
    --moe-shared-expert-intermediate-size 2048
    --moe-router-topk 8
    --moe-router-score-function sigmoid
    --moe-router-topk-scaling-factor 2.5
    --moe-router-num-groups 8
    --moe-router-group-topk 4
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.3
    --mtp-loss-scaling-factor-by-tokens 10000000000000=0.1
    --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 16
    --pipeline-schedule dualpipev
    --pipeline-model-parallel-layout "Et|(tt|)*30,mL"
    --expert-model-parallel-size 64
    --zero-stage 1
    --recompute-granularity full
    --recompute-method uniform
    --recompute-num-layers 1
)
BATCH_ARGS=(
    --micro-batch-size 1
    --global-batch-size 15360
)
TRAIN_ARGS=(
    --rampup-batch-size 4096 1408 114501953
    --train-samples 3613281250
    --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-samples 6144000
    --lr-decay-samples 3491210938
    --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0
    --seed 1234 --distributed-backend nccl
)
DS_ARGS=(--deepspeed --deepspeed_config ds_configs/deepseek_v3_671b.json)

launch "$@"
