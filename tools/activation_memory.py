"""Measure the bytes one transformer layer saves for backward, per parallelism scheme, beside the paper.

    python tools/activation_memory.py --hidden-size 256 --num-attention-heads 8 --seq-length 256 \\
        --micro-batch-size 2 --tensor-model-parallel-size 2

Each scheme runs a real TransformerLayer on real TP or Ulysses ranks (gloo processes started here) in 16-bit
activations; every tensor saved for backward is seen by torch.autograd.graph.saved_tensors_hooks, each
storage counted once, parameters excluded; a scheme's figure is its busiest rank's. Formulas (Korthikanti et
al. 2022, arXiv 2205.05198), s b h bytes: no parallelism 34 + 5as/h; TP 10 + 24/t + 5as/(ht); TP+SP
(34 + 5as/h)/t; TP+SP+selective 34/t; full recompute 2 (the layer input); DeepSpeed's checkpoint
(--deepspeed-activation-checkpointing) the same 2, and 2/t with --partition-activations (each TP rank keeps
1/t of the input). DeepSpeed-Ulysses SP U (TP 1; U ranks each holding s/U tokens of the layer's input,
DeepSpeed's DistributedAttention in between, parallel_state's sequence-parallel group): (34 + 5as/h) / U,
the no-parallelism row over U. Outside attention every tensor holds s/U tokens; after the all-to-all a rank's
q, k, v cover the whole sequence for a/U heads (as many elements as s/U tokens of all heads) and its scores,
softmax and dropout are a/U heads x s x s (5as/h x s b h / U). The all-to-alls save nothing for backward
(DeepSpeed's _SeqAllToAll keeps only its group and dimensions; its backward is the reverse all-to-all). What
they change is which tensors hold q, k, v: attention saves the all-to-alls' outputs instead of views of the
QKV output, which nothing keeps then, so the count stays the paper's 6 s b h / U for q, k, v. The sdpa backend
keeps no s x s tensor: its formula drops the 5as/h term. Attention dropout is 0 for sdpa rows: on CPU only the
math kernel implements dropout, and it stores the s x s probabilities (GPU flash kernels regenerate the
mask instead). DeepSpeed's checkpoint keeps its inputs on the autograd node, not through
save_for_backward: those are counted from the graph (on each rank). --num-experts E measures an MoE layer
(DeepSpeed's MOELayer with our MLP as its experts, EP 1) on one rank, beside the planner's count for it.
"""
import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")

import deepspeed  # noqa: E402 (after DS_ACCELERATOR)

from megatron_ds.core import deepspeed_internals, parallel_state  # noqa: E402
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron_ds.core.tensor_parallel.random import use_deepspeed_checkpointing  # noqa: E402
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer  # noqa: E402
from megatron_ds.engine.mpu import ModelParallelUnit  # noqa: E402
from megatron_ds.launch.runtime import free_port, init_distributed  # noqa: E402
from megatron_ds.planning.memory import layer_activation_bytes  # noqa: E402
from megatron_ds.planning.model import Layout, ModelSpec  # noqa: E402


@dataclass(frozen=True)
class Scheme:
    name: str
    tp: bool = False
    sequence_parallel: bool = False
    recompute: str = None
    backend: str = "local"
    deepspeed: bool = False  # full recompute by DeepSpeed's activation checkpointing
    partition: bool = False  # ... with partition_activations
    ulysses: int = 1         # DeepSpeed-Ulysses ranks (TP 1)


ULYSSES_SIZES = (2, 4)
MOE_LAYER_NUMBER = 2  # the measured layer: with --num-experts, the first MoE one (every second layer is)
SCHEMES = [Scheme("no parallelism"), Scheme("TP", tp=True), Scheme("TP + SP", tp=True, sequence_parallel=True),
           Scheme("TP + SP + selective", tp=True, sequence_parallel=True, recompute="selective"),
           Scheme("full recompute", tp=True, recompute="full"),
           Scheme("DeepSpeed recompute", tp=True, recompute="full", deepspeed=True),
           Scheme("DeepSpeed + partition", tp=True, recompute="full", deepspeed=True, partition=True),
           *(Scheme(f"Ulysses SP {size}", ulysses=size) for size in ULYSSES_SIZES),
           Scheme("no parallelism", backend="sdpa"), Scheme("TP", tp=True, backend="sdpa"),
           Scheme("TP + SP", tp=True, sequence_parallel=True, backend="sdpa")]


def paper_bytes(scheme, s, b, h, a, t, with_attention_scores=True):
    """The paper's bytes per layer for this scheme (16-bit activations, 1-byte dropout masks); Ulysses divides
    every term by U."""
    t = t if scheme.tp else 1
    scores = 5 * a * s / h if with_attention_scores else 0.0
    if scheme.recompute == "full":
        per_sbh = 2.0 / t if scheme.partition else 2.0
    elif scheme.recompute == "selective":
        per_sbh = 34.0 / t
    elif scheme.sequence_parallel:
        per_sbh = (34.0 + scores) / t
    else:
        per_sbh = 10.0 + 24.0 / t + scores / t if t > 1 else 34.0 + scores
    return s * b * h * per_sbh / scheme.ulysses


def _storage_key(tensor):
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def measure_saved_bytes(layer, hidden_states):
    """Bytes of the distinct storages saved for backward by one forward of `layer`, parameters excluded."""
    parameter_storages = {_storage_key(p) for p in layer.parameters()}
    saved = {}

    def pack(tensor):
        key = _storage_key(tensor)
        if key not in parameter_storages:
            saved[key] = key[1]
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = layer(hidden_states)
    for tensor in _deepspeed_checkpoint_inputs(output.grad_fn):
        key = _storage_key(tensor)
        if key not in parameter_storages:
            saved[key] = key[1]
    output.float().sum().backward()  # the layer really trains with what it saved
    return sum(saved.values())


def _deepspeed_checkpoint_inputs(grad_fn):
    """What DeepSpeed's checkpoint nodes in the graph keep for backward: a partitioned input keeps only its
    `saved_data` (its own storage is emptied until backward), plus the full size as a small tensor."""
    seen, stack, kept = set(), [grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kept += deepspeed_internals.checkpoint_saved_inputs(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return kept


def layer_config(args, scheme):
    """The TransformerConfig of the layer a scheme measures: the flags' shape, bf16, its parallelism choices.
    Attention dropout only on the local path (on CPU only sdpa's math kernel draws dropout, and it keeps the
    s x s probabilities that a GPU's flash kernels do not)."""
    positions = "rope" if args.use_rotary_position_embeddings else "learned_absolute"
    return TransformerConfig(num_layers=MOE_LAYER_NUMBER, hidden_size=args.hidden_size,
                             num_attention_heads=args.num_attention_heads,
                             num_query_groups=args.num_key_value_heads, ffn_hidden_size=args.ffn_hidden_size,
                             gated_linear_unit=args.swiglu, normalization=args.normalization,
                             position_embedding_type=positions,
                             bias=not args.disable_bias_linear, hidden_dropout=args.hidden_dropout,
                             attention_dropout=args.attention_dropout if scheme.backend == "local" else 0.0,
                             params_dtype=torch.bfloat16, attention_backend=scheme.backend,
                             sequence_parallel=scheme.sequence_parallel, recompute_granularity=scheme.recompute,
                             num_experts=(args.num_experts,), moe_router_topk=args.topk,
                             moe_train_capacity_factor=args.moe_train_capacity_factor)


def planner_bytes(args, scheme):
    """What the planner (planning/memory.py) counts for the scheme's layer on its busiest rank."""
    model = ModelSpec(layer_config(args, scheme), vocab_size=1024, make_vocab_size_divisible_by=1,
                      max_position_embeddings=args.seq_length, seq_length=args.seq_length, tied_embeddings=True)
    tp = args.tensor_model_parallel_size if scheme.tp else 1
    layout = Layout(tp, 1, 1, args.micro_batch_size, args.micro_batch_size, sequence_parallel=scheme.sequence_parallel,
                    recompute=scheme.recompute, distribute_saved_activations=scheme.partition, ulysses=scheme.ulysses)
    return layer_activation_bytes(model, layout, scheme.recompute, experts=args.num_experts, device="cpu")


def _layer_bytes(args, scheme):
    tp = parallel_state.get_tensor_model_parallel_world_size()
    layer = TransformerLayer(layer_config(args, scheme), layer_number=MOE_LAYER_NUMBER)
    seq = args.seq_length // scheme.ulysses // (tp if scheme.sequence_parallel else 1)
    hidden_states = torch.randn(seq, args.micro_batch_size, args.hidden_size, dtype=torch.bfloat16,
                                requires_grad=True)
    return measure_saved_bytes(layer, hidden_states)


def _rank_main(rank, world_size, port, args, scheme, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    tensor = args.tensor_model_parallel_size if scheme.tp else 1
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor, sequence_parallel_size=scheme.ulysses)
    if scheme.deepspeed or scheme.ulysses > 1:  # DeepSpeed's checkpointing and all-to-alls run on deepspeed.comm
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        init_distributed("gloo")  # deepspeed.comm on the process group above
    if scheme.deepspeed:
        deepspeed.checkpointing.configure(ModelParallelUnit(), partition_activations=scheme.partition)
        use_deepspeed_checkpointing()
    model_parallel_cuda_manual_seed(1234)
    results.put(_layer_bytes(args, scheme))
    dist.barrier()
    dist.destroy_process_group()


def scheme_ranks(args, scheme):
    """Processes a scheme runs on: its TP ranks, or its Ulysses ranks (1 for neither)."""
    return args.tensor_model_parallel_size if scheme.tp else scheme.ulysses


def _split_errors(args, schemes):
    """The sequence and the heads must split over each scheme's ranks."""
    s, a = args.seq_length, args.num_attention_heads
    splits = {(f"--tensor-model-parallel-size {args.tensor_model_parallel_size}" if scheme.tp else
               f"{scheme.ulysses} ({scheme.name})"): scheme_ranks(args, scheme) for scheme in schemes}
    return [f"--seq-length {s} and --num-attention-heads {a} must be divisible by {name}"
            for name, ranks in splits.items() if s % ranks or a % ranks]


def run_scheme(args, scheme):
    """The bytes the busiest rank of the scheme saves."""
    world = scheme_ranks(args, scheme)
    context = mp.get_context("fork")
    results = context.Queue()
    mp.start_processes(_rank_main, args=(world, free_port(), args, scheme, results), nprocs=world,
                       start_method="fork")
    return max(results.get(timeout=10) for _ in range(world))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=2)
    parser.add_argument("--scheme", action="append", choices=sorted({scheme.name for scheme in SCHEMES}),
                        help="measure only these schemes (repeatable; default: all)")
    parser.add_argument("--num-key-value-heads", type=int, default=None, help="GQA (default: one per head)")
    parser.add_argument("--ffn-hidden-size", type=int, default=None)
    parser.add_argument("--swiglu", action="store_true")
    parser.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    parser.add_argument("--use-rotary-position-embeddings", action="store_true")
    parser.add_argument("--disable-bias-linear", action="store_true")
    parser.add_argument("--hidden-dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.1, help="local rows only")
    parser.add_argument("--num-experts", type=int, default=1, help="an MoE layer (DeepSpeed's MOELayer, EP 1): "
                        "the schemes without TP or Ulysses")
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--moe-train-capacity-factor", type=float, default=1.0)
    args = parser.parse_args(argv)
    s, b, h, a, t = (args.seq_length, args.micro_batch_size, args.hidden_size, args.num_attention_heads,
                     args.tensor_model_parallel_size)
    schemes = [scheme for scheme in SCHEMES if args.scheme is None or scheme.name in args.scheme]
    errors = _split_errors(args, schemes)
    several_ranks = sorted({scheme.name for scheme in schemes if scheme_ranks(args, scheme) > 1})
    if args.num_experts > 1 and several_ranks:
        errors.append(f"--num-experts {args.num_experts}: an MoE layer is measured on one rank (--scheme 'no "
                      f"parallelism'), not in {', '.join(several_ranks)}")
    if errors:
        parser.error("; ".join(errors))
    print(f"activation bytes saved for backward by one transformer layer: s={s} b={b} h={h} a={a} t={t} (Ulysses "
          f"SP at TP 1), bf16 activations, per rank (the largest); paper: its GPT-2 layer, planner: "
          f"planning/memory.py for this layer")
    print(f"{'scheme':<22} {'backend':<8} {'measured':>12} {'planner':>12} {'ratio':>7} {'paper':>12} {'ratio':>7}")
    for scheme in schemes:
        measured, planned = run_scheme(args, scheme), planner_bytes(args, scheme)
        paper = paper_bytes(scheme, s, b, h, a, t, with_attention_scores=scheme.backend == "local")
        print(f"{scheme.name:<22} {scheme.backend:<8} {measured:>12,} {int(planned):>12,} {measured / planned:>7.3f} "
              f"{int(paper):>12,} {measured / paper:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
