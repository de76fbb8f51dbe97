"""Command lines shared by tests: the smallest model pretrain.py accepts with mock data."""
TINY_MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 1 --mock-data "
              "--vocab-size 128").split()
