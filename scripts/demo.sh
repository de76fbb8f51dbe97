#!/usr/bin/env bash
# The demo: a GPT trained with TP 2 x PP 2 on 4 ranks (CPU processes without a GPU) on the built-in
# synthetic token stream, through the deepspeed launcher and a DeepSpeed JSON. Extra flags are appended
# (later flags win), e.g. `scripts/demo.sh --train-iters 20`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
bash scripts/setup.sh
export PATH="$VENV/bin:$PATH"
exec deepspeed --num_gpus 4 pretrain.py \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 8 --seq-length 128 \
  --micro-batch-size 4 --global-batch-size 16 --train-iters 200 \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 512 \
  --log-interval 10 --eval-interval 100 --eval-iters 2 --tensorboard-dir runs/demo \
  --deepspeed --deepspeed_config ds_configs/cpu_demo.json "$@"
