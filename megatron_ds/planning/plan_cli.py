"""tools/plan.py: pretrain.py's model, parallel and batch flags plus the cluster -> a plan (or a search).

Parsing reuses `megatron_ds.arguments.build_parser()` (so every pretrain.py flag is accepted and means the
same) and its resolution, with the planner's differences: --train-iters is optional, no data is needed
(a NullTokenizer sized by --vocab-size, the tokenizer's files, or 51200), and nothing is checked against this
machine (fused kernels, fp16 without a local GPU, data files).
"""
import argparse
import json
import sys
import time

from megatron_ds.arguments import (
    ArgumentsError,
    build_parser,
    parse_flags,
    raise_if_invalid,
    resolve,
    tokenizer_type,
)
from megatron_ds.core.pipeline_split import (
    EMBEDDING_FLAG,
    EVEN_SPLIT_FLAGS,
    FIRST_FLAG,
    LAST_FLAG,
    LAYOUT_FLAG,
    LOSS_FLAG,
    PipelineSplit,
    split_from_flags,
)
from megatron_ds.data.tokenizers import build_tokenizer
from megatron_ds.launch.devices import DEVICES, device_spec
from megatron_ds.planning import report
from megatron_ds.planning.memory import GIB, RUNTIME_OVERHEAD_BYTES
from megatron_ds.planning.meta import check_against_formula
from megatron_ds.planning.model import Cluster, ModelSpec, fp8_device_errors
from megatron_ds.planning.parameters import active_parameters, total_parameters
from megatron_ds.planning.performance import PerformanceAssumptions
from megatron_ds.planning.planner import dropless_moe_section, make_plan, moe_section
from megatron_ds.planning.search import search_layouts

DEFAULT_VOCAB_SIZE = 51200
from megatron_ds.planning.from_flags import WITHOUT_MEMORY_CHOICES, layout_from_args, model_spec


def add_cluster_flags(group):
    """The cluster a run is planned (or dry-run) for."""
    group.add_argument("--world-size", type=int, required=True, help="GPUs in the run")
    group.add_argument("--gpus-per-node", type=int, default=8)
    group.add_argument("--device", choices=list(DEVICES), default="a100-80gb")


def build_plan_parser():
    parser = build_parser(prog="tools/plan.py")
    parser.description = ("Plan a 3D-parallel run: parameters, memory, FLOPs, communication and estimated time "
                          "for pretrain.py's flags on a cluster, or --search every layout")
    group = parser.add_argument_group("planner")
    add_cluster_flags(group)
    group.add_argument("--search", action="store_true",
                       help="rank every (tp, Ulysses SP, CP, pp, dp, micro batch, recompute, SP); Ulysses and CP "
                            "only where a layout needs them (megatron_ds/planning/search.py)")
    group.add_argument("--top", type=int, default=20, help="layouts shown by --search")
    group.add_argument("--instantiate", action="store_true",
                       help="build every pipeline stage of TP rank 0 on the meta device and check the counts")
    group.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    group.add_argument("--compute-efficiency", type=float, default=PerformanceAssumptions.compute_efficiency)
    group.add_argument("--bandwidth-efficiency", type=float, default=PerformanceAssumptions.bandwidth_efficiency)
    group.add_argument("--checkpoint-write-gbs", type=float, default=PerformanceAssumptions.checkpoint_write_gbs,
                       help="aggregate write bandwidth of --save's file system, GB/s: the checkpoint's write time")
    group.add_argument("--mtbf-hours", type=float, default=None,
                       help="the job's mean time between failures: the plan then gives the --save-interval that "
                            "loses the least time to failures and saves (megatron_ds/planning/checkpoints.py)")
    return parser


def _vocab_size(args):
    if args.vocab_size is not None:
        return args.vocab_size
    if tokenizer_type(args) == "NullTokenizer":
        return DEFAULT_VOCAB_SIZE
    try:
        return build_tokenizer(tokenizer_type(args), tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                               merge_file=args.merge_file, vocab_size=None).vocab_size
    except (ValueError, OSError) as error:
        raise ArgumentsError([f"cannot read the tokenizer to size the vocabulary ({error}); give --vocab-size"])


# SP and recompute do not change the model's shapes


def validated_args(args):
    """pretrain.py's resolution of the flags, for a cluster that is not this machine."""
    if args.world_size < 1 or args.gpus_per_node < 1:
        raise ArgumentsError([f"--world-size {args.world_size} and --gpus-per-node {args.gpus_per_node} "
                              f"must be positive"])
    flags = argparse.Namespace(**vars(args))
    flags.vocab_size, flags.tokenizer_type = _vocab_size(args), "NullTokenizer"
    if flags.train_iters is None and flags.train_samples is None:  # planning needs no schedule
        flags.train_iters = 1
    if args.search and args.pipeline_model_parallel_layout:
        raise ArgumentsError([f"--search with {LAYOUT_FLAG} {args.pipeline_model_parallel_layout}: the layout names "
                              f"each model stage, so it fixes PP (x the schedule's stages per rank); plan it as one "
                              f"layout (without --search), or search with {FIRST_FLAG} / {LAST_FLAG} or "
                              f"{EMBEDDING_FLAG} / {LOSS_FLAG}, which split the layers at any PP"])
    if args.search:   # the layout is searched: resolve the model alone, at TP = Ulysses = CP = PP = 1, evenly split
        flags.tensor_model_parallel_size = flags.pipeline_model_parallel_size = flags.ds_sequence_parallel_size = 1
        flags.context_parallel_size, flags.hierarchical_context_parallel_sizes = 1, None
        vars(flags).update(WITHOUT_MEMORY_CHOICES, **EVEN_SPLIT_FLAGS)
    resolved = resolve(flags, args.world_size, on_this_host=False, layout_known=not args.search)
    unplanned = unplanned_dropless_choices(resolved.model) if resolved.dropless_moe else []
    if unplanned:
        raise ArgumentsError([f"{', '.join(unplanned)}: the planner and the dry run plan the dropless MoE layer with "
                              f"its alltoall dispatcher and no capacity (every pair computed); leave these unset to "
                              f"plan it"])
    return resolved


def unplanned_dropless_choices(config):
    """The dropless MoE layer's choices whose traffic and memory the planner does not model, as their flags."""
    unplanned = []
    if config.moe_token_dispatcher_type != "alltoall":
        unplanned.append(f"--moe-token-dispatcher-type {config.moe_token_dispatcher_type}")
    if config.moe_expert_capacity_factor is not None:
        unplanned.append(f"--moe-expert-capacity-factor {config.moe_expert_capacity_factor:g}")
    return unplanned


def model_summary(model: ModelSpec) -> dict:
    config = model.config
    features = [config.normalization, "SwiGLU" if config.gated_linear_unit else "GeLU",
                {"rope": "RoPE", "learned_absolute": "learned positions"}.get(config.position_embedding_type,
                                                                              "no positions"),
                "biases" if config.bias else "no biases", "tied embeddings" if model.tied_embeddings else "untied"]
    if config.multi_latent_attention:
        features.append(f"MLA (q rank {config.q_lora_rank}, kv rank {config.kv_lora_rank}, head dims qk "
                        f"{config.qk_head_dim} + rope {config.qk_pos_emb_head_dim}, v {config.v_head_dim})")
    moe = moe_section(model) or dropless_moe_section(model)
    if config.is_moe:
        experts = "/".join(map(str, sorted(set(moe["experts"]))))
        features.append(f"MoE {experts} experts every {config.expert_interval} layers, top-{config.moe_router_topk}"
                        f"{', residual' if config.moe_residual else ''}, EP {config.moe_expert_parallel_size}")
    if config.is_dropless_moe:
        features.append(_dropless_feature(moe))
    return {"layers": config.num_layers, "hidden": config.hidden_size, "heads": config.num_attention_heads,
            "kv_heads": config.num_query_groups, "kv_channels": config.kv_channels, "ffn": config.ffn_hidden_size,
            "seq_length": model.seq_length, "max_position_embeddings": model.max_position_embeddings,
            "vocab_size": model.vocab_size, "precision": model.describe_precision(), "features": features,
            "total_parameters": total_parameters(model), "active_parameters": active_parameters(model),
            **({"moe": moe} if config.is_moe else {}), **({"dropless_moe": moe} if config.is_dropless_moe else {})}


def _dropless_feature(section):
    shared = section["shared_expert_ffn_hidden_size"]
    return (f"dropless MoE {section['experts']} experts of FFN {section['ffn_hidden_size']} in "
            f"{len(section['moe_layers'])} layers, top-{section['top_k']}"
            f"{f', shared expert FFN {shared}' if shared else ''}, EP {section['expert_parallel_size']}")


def cluster_summary(cluster: Cluster, sixteen_bit: bool) -> dict:
    device = cluster.device
    return {"world_size": cluster.world_size, "gpus_per_node": cluster.gpus_per_node, "device": device.name,
            "memory_gib": device.memory_gib, "peak_tflops": cluster.peak_flops(sixteen_bit) / 1e12,
            "peak_fp8_tflops": cluster.peak_fp8_flops() / 1e12,
            "memory_bandwidth_gbs": device.memory_bandwidth_gbs, "intra_node_gbs": device.intra_node_gbs,
            "inter_node_gbs": device.inter_node_gbs, "source": device.source}


def assumptions_text(assumptions: PerformanceAssumptions, fp8: bool = False):
    return assumptions.describe(fp8) + [
        f"memory: {RUNTIME_OVERHEAD_BYTES / GIB:g} GiB per device for CUDA context, NCCL and allocator slack; "
        f"activation bytes from Korthikanti et al. 2022 (docs/formulas.md); peak over the micro-batches a stage holds "
        f"in flight (1F1B: min(p - stage, m); other schedules: simulated)"]


def instantiate_check(model: ModelSpec, tp: int, pp: int, split: PipelineSplit = PipelineSplit()) -> dict:
    start = time.perf_counter()
    stages = check_against_formula(model, tp, pp, split=split)
    return {"tp": tp, "pp": pp, "stages": stages, "ok": not any(row["difference"] for row in stages.values()),
            "seconds": time.perf_counter() - start}


def run(args) -> tuple:
    """(result dict, exit status)."""
    checked = validated_args(args)
    model = model_spec(checked)
    raise_if_invalid(fp8_device_errors(model, device_spec(checked.device)))
    cluster = Cluster(device_spec(checked.device), checked.world_size, checked.gpus_per_node, checked.peak_tflops)
    assumptions = PerformanceAssumptions(checked.compute_efficiency, checked.bandwidth_efficiency,
                                         checked.checkpoint_write_gbs, checked.mtbf_hours)
    result = {"model": model_summary(model), "cluster": cluster_summary(cluster, model.sixteen_bit),
              "assumptions": assumptions_text(assumptions, model.config.fp8_format is not None)}
    status = 0
    if checked.search:
        result["search"] = search_layouts(model, cluster, checked.global_batch_size, checked.zero_stage, assumptions,
                                          checked.top, split_from_flags(vars(args)), checked.cp_comm_type)
    else:
        layout = layout_from_args(checked)
        result["layout_description"] = layout.describe()
        result["plan"] = make_plan(model, layout, cluster, assumptions)
        status = 2 if result["plan"]["errors"] else 0
        if checked.kd and model.teacher is None:
            result["plan"]["warnings"].append("--kd without --num-layers-teacher, --hidden-size-teacher and "
                                              "--num-attention-heads-teacher: the teacher's memory is not counted")
    if checked.instantiate:
        result["instantiate"] = instantiate_check(model, checked.tensor_model_parallel_size,
                                                  checked.pipeline_model_parallel_size, checked.parallel.split)
        status = status or (0 if result["instantiate"]["ok"] else 1)
    return result, status


def main(argv=None) -> int:
    try:
        args, problems = parse_flags(build_plan_parser(), argv)
        raise_if_invalid(problems)
        result, status = run(args)
    except ArgumentsError as error:
        print(error, file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
        return status
    print(report.search_text(result) if args.search else report.plan_text(result))
    if "instantiate" in result:
        print()
        print(report.instantiate_text(result["instantiate"]))
    return status
