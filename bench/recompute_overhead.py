"""Step time (forward + backward) of a GPT layer stack with no recompute, selective and full recompute,
as ratios measured in one run (the paper: selective costs a few percent, full about a third).

    python bench/recompute_overhead.py [--hidden-size 512 --seq-length 512 --num-layers 4 --rounds 5]

Method (bench/turns.py's alternate): the three stacks are built once and take turns step by step, the ratio to no
recompute taken within each rotation; a round's is the median of its rotations', and the median of the rounds
prints with their range, or "unstable" when they lie more than --max-spread apart.
"""
import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")

from bench.turns import (  # noqa: E402
    Ratio,
    add_arguments,
    alternate,
    keep_freed_memory,
    method_words,
    rounds_of,
    sequential,
    total_rotations,
)
from megatron_ds.core import parallel_state  # noqa: E402
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer  # noqa: E402
from megatron_ds.launch.runtime import device, free_port  # noqa: E402

MODES = {"none": None, "selective": "selective", "full": "full"}
WARM_UP = 1  # rotations left out: the first step pays one-off costs


def step_function(args, granularity):
    """One forward and backward of a fresh layer stack at the recompute granularity."""
    config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                               num_attention_heads=args.num_attention_heads, hidden_dropout=0.1,
                               attention_dropout=0.1, attention_backend="local", params_dtype=torch.bfloat16,
                               recompute_granularity=granularity)
    layers = torch.nn.Sequential(*(TransformerLayer(config, n + 1) for n in range(args.num_layers))).to(device())
    hidden = torch.randn(args.seq_length, args.micro_batch_size, args.hidden_size, dtype=torch.bfloat16,
                         device=device(), requires_grad=True)
    return lambda: layers(hidden).float().sum().backward()


def _synchronize():
    if device().type == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=4)
    add_arguments(parser, rotations_per_round=8)
    args = parser.parse_args(argv)
    keep_freed_memory(args)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    steps = {mode: step_function(args, granularity) for mode, granularity in MODES.items()}
    seconds = alternate(steps, total_rotations(args, WARM_UP), _synchronize, sequential(args))
    print(f"{args.num_layers} layers, h={args.hidden_size}, a={args.num_attention_heads}, s={args.seq_length}, "
          f"b={args.micro_batch_size}, bf16, local attention, {device().type}; the stacks {method_words(args)}: "
          f"{WARM_UP} warm-up rotations, then {rounds_of(args.rounds, args.rotations_per_round)}")
    for mode, turns in seconds.items():
        ratio = Ratio.of(turns, seconds["none"], args.rounds, WARM_UP).text(args.max_spread)
        print(f"  {mode:<10} {statistics.median(turns[WARM_UP:]) * 1000:9.1f} ms   vs no recompute: {ratio}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
