#!/usr/bin/env bash
# The demo, end to end on a fresh machine with no download:
#   1. a JSONL corpus of real English text from the Python standard library's own docstrings and docs,
#   2. a SentencePiece tokenizer trained on it,
#   3. the corpus preprocessed into a Megatron indexed dataset,
#   4. a GPT trained on it with TP 2 x PP 2 on 4 ranks (CPU processes without a GPU) through the
#      deepspeed launcher and a DeepSpeed JSON; the loss goes down.
# Steps 1-3 and the sample indices are cached under data/, so a second run starts training at once.
# Extra flags are appended (later flags win), e.g. `scripts/demo.sh --train-iters 20`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
bash scripts/setup.sh
export PATH="$VENV/bin:$PATH"
DATA=data
python tools/make_demo_corpus.py --output "$DATA/demo_corpus.jsonl"
if [ ! -f "$DATA/demo_sp.model" ]; then
  python tools/train_tokenizer.py --input "$DATA/demo_corpus.jsonl" --output-prefix "$DATA/demo_sp" \
    --model-type bpe --vocab-size 4096 --byte-fallback
fi
if [ ! -f "$DATA/demo_text_document.idx" ]; then
  python tools/preprocess_data.py --input "$DATA/demo_corpus.jsonl" --output-prefix "$DATA/demo" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/demo_sp.model" --append-eod --workers 2
fi
exec deepspeed --num_gpus 4 pretrain.py \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 8 --seq-length 128 \
  --micro-batch-size 4 --global-batch-size 16 --train-iters 200 \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --data-path "$DATA/demo_text_document" --split 98,2,0 --data-cache-path "$DATA/cache" \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/demo_sp.model" \
  --log-interval 10 --eval-interval 100 --eval-iters 2 --tensorboard-dir runs/demo \
  --deepspeed --deepspeed_config ds_configs/cpu_demo.json "$@"
