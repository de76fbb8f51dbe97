"""Step time (forward + backward) of a GPT layer stack with no recompute, selective and full recompute,
as ratios measured in one run (the paper: selective costs a few percent, full about a third).

    python bench/recompute_overhead.py [--hidden-size 512 --seq-length 512 --num-layers 4 --repeats 5]
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")

from megatron_ds.core import parallel_state  # noqa: E402
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer  # noqa: E402
from megatron_ds.glue.runtime import device, free_port  # noqa: E402

MODES = {"none": None, "selective": "selective", "full": "full"}


def step_seconds(args, granularity):
    config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                               num_attention_heads=args.num_attention_heads, hidden_dropout=0.1,
                               attention_dropout=0.1, attention_backend="local", params_dtype=torch.bfloat16,
                               recompute_granularity=granularity)
    layers = torch.nn.Sequential(*(TransformerLayer(config, n + 1) for n in range(args.num_layers))).to(device())
    hidden = torch.randn(args.seq_length, args.micro_batch_size, args.hidden_size, dtype=torch.bfloat16,
                         device=device(), requires_grad=True)
    times = []
    for repeat in range(args.repeats + 1):
        start = time.perf_counter()
        layers(hidden).float().sum().backward()
        if device().type == "cuda":
            torch.cuda.synchronize()
        if repeat:  # the first is warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    seconds = {mode: step_seconds(args, granularity) for mode, granularity in MODES.items()}
    print(f"{args.num_layers} layers, h={args.hidden_size}, a={args.num_attention_heads}, s={args.seq_length}, "
          f"b={args.micro_batch_size}, bf16, local attention, {device().type}; median of {args.repeats} steps")
    for mode, value in seconds.items():
        print(f"  {mode:<10} {value * 1000:9.1f} ms   x{value / seconds['none']:.3f} of no recompute")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
