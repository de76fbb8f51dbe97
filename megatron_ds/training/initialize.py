"""What every rank does once the process group exists, before any data (start_up): the parallel groups, seeding, the
model inside its engine, and the start-up log. pretrain() and tools/dry_run.py both run it.
"""
import contextlib
import json
import logging
import sys

import torch.distributed as dist

from megatron_ds.core import parallel_state
from megatron_ds.core.pipeline_split import describe_stages
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.transformer.fused_ops import compiled_ops, describe_fused_ops
from megatron_ds.engine.activation_checkpointing import configure_activation_checkpointing
from megatron_ds.engine.moe_token_gather import mend_token_split
from megatron_ds.launch.cpu_features import sixteen_bit_warning_here
from megatron_ds.launch.runtime import (
    device,
    local_world_size,
    print_rank_0,
)
from megatron_ds.launch.topology import describe_ranks, tensor_parallel_placement_warning
from megatron_ds.observability.throughput import peak_tflops_per_device
from megatron_ds.planning.from_flags import model_spec
from megatron_ds.planning.parameters import active_parameters, total_parameters
from megatron_ds.training.model_setup import setup_engine
from megatron_ds.training.optimizer import optimizer_description


def start_up(args, watchdog=None, all_reduce_note=None, building_model=contextlib.nullcontext):
    """What every rank does once the process group exists, before any data: the model-parallel and expert
    groups, the placement log, DeepSpeed's activation checkpointing, seeding, the model inside its DeepSpeed
    engine (built under `building_model()`) and the start-up log. pretrain() and tools/dry_run.py (the model
    under FakeTensorMode, on a fake process group) both run it. Returns (engine, MFU peak per device)."""
    _configure_logging()
    initialize_groups(args)
    _log_placement(args)
    if all_reduce_note:
        print_rank_0(all_reduce_note)
    configure_activation_checkpointing(args, device())  # DeepSpeed's checkpoint and RNG tracker, if asked for
    model_parallel_cuda_manual_seed(args.seed)
    if watchdog is not None:
        watchdog.activity = "building the model and the DeepSpeed engine"
    engine = setup_engine(args, args.model, building_model)
    peak, peak_source = peak_tflops_per_device(args.peak_tflops, args.params_dtype, device())
    log_startup(args, args.model, engine, peak, peak_source)
    return engine, peak


def initialize_groups(args):
    """The model-parallel groups and, for an MoE, the expert groups (every rank creates all of them, in order)."""
    parallel_state.initialize_model_parallel(topology=parallel_state.topology_of(args.parallel),
                                             ulysses_chunk_size=args.model.fpdt_chunk_size)
    if args.moe or args.dropless_moe:
        parallel_state.initialize_expert_parallel(args.moe_expert_parallel_size, args.parallel.expert_tensor_parallel)
    if args.moe:
        mend_token_split()


def _configure_logging():
    """megatron_ds's own log records (dataset index building, fallbacks) on stdout; INFO on rank 0 only."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"megatron_ds [rank {dist.get_rank()}]: %(message)s"))
    package_logger = logging.getLogger("megatron_ds")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO if dist.get_rank() == 0 else logging.WARNING)
    package_logger.propagate = False


def _log_placement(args):
    warning = tensor_parallel_placement_warning(args.tensor_model_parallel_size, local_world_size())
    for text in args.warnings + ((warning,) if warning else ()):
        print_rank_0(f"WARNING: {text}")
    lines = describe_ranks() if args.print_topology else []
    for line in lines:
        print_rank_0(line)


def log_startup(args, config, engine, peak, peak_source):
    sequence = (f"SP {args.ds_sequence_parallel_size} x " if args.ds_sequence_parallel_size > 1 else "") + (
        f"CP {args.context_parallel_size} ({args.cp_comm_type}) x " if args.context_parallel_size > 1 else "")
    print_rank_0(f"world size {args.world_size} = TP {args.tensor_model_parallel_size} x {sequence}PP "
                 f"{args.pipeline_model_parallel_size} x DP {args.data_parallel_size}; global batch "
                 f"{args.global_batch_size} = micro batch {args.micro_batch_size} x DP {args.data_parallel_size} x "
                 f"gradient accumulation {engine.gradient_accumulation_steps()}; padded vocab "
                 f"{args.padded_vocab_size}; dtype {str(args.params_dtype).replace('torch.', '')}; "
                 f"ZeRO stage {args.zero_stage}")
    for axis, groups in parallel_state.all_groups_by_axis().items():
        print_rank_0(f"{axis}-parallel groups: {groups}")
    if config.is_moe or config.is_dropless_moe:
        for axis, groups in parallel_state.expert_groups_by_axis(config.moe_expert_parallel_size,
                                                                 config.moe_expert_tensor_parallel).items():
            print_rank_0(f"{axis}-parallel groups: {groups}")
    _log_parameters_per_stage(engine)
    if args.pipeline_model_parallel_size > 1:
        print_rank_0(_stage_layers_line(args))
    if config.is_moe:
        _log_experts(args, config)
    if config.is_dropless_moe:
        _log_dropless_experts(args, config)
    print_rank_0(f"effective DeepSpeed config: {json.dumps(args.effective_deepspeed_config, sort_keys=True)}")
    print_rank_0(f"MFU peak per device: {peak:.3f} TFLOP/s ({peak_source})")
    compiled = compiled_ops(config)
    compiling = f"; {len(compiled)} compiled on first use, the cost reported after 2 iterations" if compiled else ""
    print_rank_0(f"fused ops (--fusion-backend {args.fusion_backend}): "
                 f"{describe_fused_ops(config)} "
                 f"optimizer={optimizer_description(args.optimization, device().type)}{compiling}")


def _log_parameters_per_stage(engine):
    local = sum(p.numel() for p in engine.module.parameters())
    entry = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_sequence_data_parallel_rank(),
             local)
    entries = [None] * dist.get_world_size()
    dist.all_gather_object(entries, entry)
    per_stage = {}
    for stage, data_rank, count in entries:
        if data_rank == 0:
            per_stage[stage] = per_stage.get(stage, 0) + count
    for stage in sorted(per_stage):
        print_rank_0(f"parameters on pipeline stage {stage} (all TP ranks): {per_stage[stage]:,}")


def _stage_layers_line(args):
    layout = args.parallel
    split = "the even split" if layout.split.is_even else layout.split.describe()
    return (f"transformer layers per model stage: {describe_stages(layout.stage_layers(args.num_layers))} "
            f"({split})")


def _log_experts(args, config):
    """Total and active parameters (the planner's count: the one formula), and the experts' placement."""
    spec = model_spec(args, config)
    counts = sorted({config.experts_in_layer(n) for n in range(1, config.num_layers + 1)} - {1})
    print_rank_0(f"Mixture of Experts: {total_parameters(spec):,} parameters in all, "
                 f"{active_parameters(spec):,} active per token (top-{config.moe_router_topk} of "
                 f"{'/'.join(map(str, counts))} experts every {config.expert_interval} layers); "
                 f"{'/'.join(str(count // config.moe_expert_parallel_size) for count in counts)} experts per "
                 f"rank (EP {config.moe_expert_parallel_size})"
                 + (f", each split over TP {args.tensor_model_parallel_size} (--enable-expert-tensor-parallelism)"
                    if config.moe_expert_tensor_parallel else ""))


def warn_of_16_bit_on_this_cpu(args):
    """On a CPU, --bf16 / --fp16 without the CPU's matrix unit for it (launch/cpu_features.py) runs its matmuls many
    times slower than fp32 (85x for bf16 on an AVX2-only EPYC): rank 0 says so, with the slowdown it measures (only
    then). Not in start_up(): tools/dry_run.py's ranks train nothing here."""
    if device().type == "cpu" and dist.get_rank() == 0:
        text = sixteen_bit_warning_here(args.params_dtype)
        if text:
            print_rank_0(f"WARNING: {text}")


def _expert_split(args, config):
    if not config.moe_expert_tensor_parallel:
        return ""
    return f", each split over TP {args.tensor_model_parallel_size} (--expert-tensor-parallel-size)"


def _log_dropless_experts(args, config):
    """The layer, its dispatch, and its total and active parameters (the planner's count: the one formula)."""
    layers, ep = sum(config.moe_layer_pattern), config.moe_expert_parallel_size
    shared = (f", a shared expert of FFN {config.moe_shared_expert_intermediate_size}"
              if config.moe_shared_expert_intermediate_size else "")
    capacity = (f", capacity factor {config.moe_expert_capacity_factor:g} ({config.moe_token_drop_policy})"
                if config.moe_expert_capacity_factor is not None else ", no token dropped")
    spec = model_spec(args, config)
    print_rank_0(f"dropless Mixture of Experts: {config.num_moe_experts} experts of FFN {config.moe_ffn_hidden_size} "
                 f"in {layers} of {config.num_layers} layers, top-{config.moe_router_topk} "
                 f"({config.moe_router_score_function}){shared}; {config.num_moe_experts // ep} experts per rank "
                 f"(EP {ep}){_expert_split(args, config)}; "
                 f"{'grouped GEMMs' if config.moe_grouped_gemm else 'a GEMM per expert'}; "
                 f"{config.moe_token_dispatcher_type} dispatcher{capacity}; {total_parameters(spec):,} parameters "
                 f"in all, {active_parameters(spec):,} active per token")
