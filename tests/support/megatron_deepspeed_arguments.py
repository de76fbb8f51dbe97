"""Megatron-DeepSpeed's flags: every flag of its megatron/arguments.py with how it takes a value
(megatron_deepspeed_arguments.json), the small model they are parsed with, and its spellings of a LLaMA's
flags with the layout they are compared at."""
import json
from pathlib import Path

FLAGS = {flag: kind for flag, kind in
         json.loads(Path(__file__).with_name("megatron_deepspeed_arguments.json").read_text()).items()
         if not flag.startswith("_")}
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--mock-data", "--train-iters", "2"]


MEGATRON_DEEPSPEED_LLAMA = [
    "--normalization", "rmsnorm",                            # lower case
    "--use-rotary-position-embeddings", "--rotary-position-embeddings-theta", "10000",  # --rotary-base
    "--use-flash-attn-v2",                                   # our fused attention (SDPA), the default
    "--no-query-key-layer-scaling",                          # fp16-only rescaling; we scale by 1/sqrt(d) once
    "--no-async-tensor-model-parallel-allreduce",            # an overlap switch of Megatron's
    "--data-impl", "mmap", "--optimizer", "adam",            # the only data format; AdamW
    "--num-workers", "0",                                    # the reference reads with the default 2 workers
    "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-key-value-heads", "2"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "128"]
