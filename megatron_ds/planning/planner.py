"""One plan: parameters, memory, FLOPs, communication and estimated time of a layout, as a JSON-ready dict."""
import dataclasses

from megatron_ds.core.models.gpt import flops as model_flops
from megatron_ds.planning import communication as comm
from megatron_ds.planning.checkpoints import checkpoint_section
from megatron_ds.planning.hardware_flops import hardware_flops_per_iteration, model_flops_per_iteration
from megatron_ds.planning.memory import (
    GIB,
    dropless_moe_mlp_bytes,
    dropless_received_rows,
    layer_activation_bytes,
    memory_per_stage,
    sharded_state_bytes,
    state_bytes_per_parameter,
)
from megatron_ds.planning.model import (
    RECOMPUTE_CHOICES,
    Cluster,
    Layout,
    ModelSpec,
    expert_data_parallel_size,
    layout_errors,
)
from megatron_ds.planning.parameters import (
    active_parameters,
    dropless_buffer_values,
    dropless_expert_parameters,
    mlp_parameters,
    mtp_parameters,
    rank_parameters,
    total_parameters,
)
from megatron_ds.planning.performance import PerformanceAssumptions, estimate_performance


def representative_stages(stages):
    """The stages that can hold the most memory or take the longest: the first two, the last and the one with
    the most parameters (with MoE, stages differ by their MoE layers)."""
    keep = {0, 1, len(stages) - 1, max(stages, key=lambda stage: stage.total).stage}
    return [stage for stage in stages if stage.stage in keep]


def moe_section(model, layout=None):
    """The MoE layers (None for a dense model): experts per layer and per rank, top-k, EP and the expert-data-
    parallel size, parameters of one expert; with a layout, the all-to-all of each MoE layer per micro-batch."""
    config = model.config
    if not config.is_moe:
        return None
    ep, numbers = config.moe_expert_parallel_size, comm.moe_layer_numbers(model)
    section = {"moe_layers": numbers, "experts": [config.experts_in_layer(n) for n in numbers],
               "experts_per_rank": [config.experts_in_layer(n) // ep for n in numbers],
               "expert_interval": config.expert_interval, "top_k": config.moe_router_topk,
               "expert_parallel_size": ep, "residual": config.moe_residual,
               "capacity_factor": config.moe_train_capacity_factor, "token_dropping": config.moe_token_dropping,
               "parameters_per_expert": mlp_parameters(config)}
    if layout is not None:
        section["expert_data_parallel_size"] = expert_data_parallel_size(model, layout)
        section["all_to_all_per_layer_per_micro_batch"] = [   # one entry per distinct expert count
            {"layers": [n for n in numbers if config.experts_in_layer(n) == experts]}
            | dataclasses.asdict(comm.expert_parallel_traffic_per_layer(model, layout, experts))
            for experts in sorted(set(section["experts"]))]
    return section


def dropless_moe_section(model, layout=None):
    """The dropless MoE layers (None without): the layers, experts and experts per rank, top-k, EP, the routed and
    shared experts' widths, parameters of one routed expert, fp32 buffer bytes per layer and the MoE MLP's forward
    FLOPs per token (core/models/gpt/flops.py); with a layout, the expert-data-parallel size, the rows one rank
    routes and computes per layer and micro-batch (expected under uniform routing, the plan's; and the worst), the
    MoE MLP's activations for each, and the all-to-all per layer and micro-batch."""
    config = model.config
    if not config.is_dropless_moe:
        return None
    numbers, ep = comm.dropless_moe_layer_numbers(model), config.moe_expert_parallel_size
    section = {"moe_layers": numbers, "experts": config.num_moe_experts,
               "experts_per_rank": config.num_moe_experts // ep, "top_k": config.moe_router_topk,
               "expert_parallel_size": ep, "ffn_hidden_size": config.moe_ffn_hidden_size,
               "shared_expert_ffn_hidden_size": config.moe_shared_expert_intermediate_size or 0,
               "parameters_per_expert": dropless_expert_parameters(config),
               "expert_tensor_parallel_size": layout.tp if layout is not None and config.moe_expert_tensor_parallel
               else 1,
               "buffer_bytes_per_layer": 4 * dropless_buffer_values(config, numbers[0]),
               "forward_flops_per_token": model_flops.dropless_moe_flops_per_token(config)}
    if layout is not None:
        section |= {"expert_data_parallel_size": expert_data_parallel_size(model, layout),
                    "rows_per_layer_per_micro_batch": _dropless_rows(model, layout),
                    "all_to_all_per_layer_per_micro_batch": dataclasses.asdict(
                        comm.dropless_traffic_per_layer(model, layout))}
    return section


def _dropless_rows(model, layout):
    """What one rank routes and computes per dropless MoE layer and micro-batch, and the MoE MLP's activations:
    the plan counts the expected rows."""
    tokens = comm.dropless_routed_tokens(model, layout)
    expected, worst = dropless_received_rows(model, layout), dropless_received_rows(model, layout, worst=True)
    return {"tokens": tokens, "rows_sent": model.config.moe_router_topk * tokens,
            "rows_per_expert_from_each_rank": model.config.moe_router_topk * tokens / model.config.num_moe_experts,
            "rows_computed_expected": expected, "rows_computed_worst": worst, "planned": "expected",
            "mlp_activation_bytes_expected": dropless_moe_mlp_bytes(model, layout, expected),
            "mlp_activation_bytes_worst": dropless_moe_mlp_bytes(model, layout, worst)}


def _has_experts(model):
    return model.config.is_moe or model.config.is_dropless_moe


def _parameters_section(model, layout, stages):
    padded = dataclasses.replace(model, vocab_size=model.padded_vocab_size(layout.tp), make_vocab_size_divisible_by=1)
    # distinct over the stage's TP ranks and (with MoE) EP ranks
    whole = {stage.stage: stage for stage in rank_parameters(padded, layout, tp=1, ep=1)}
    section = {
        "total": total_parameters(model, layout.tp),
        "active": active_parameters(model, layout.tp),
        "padded_vocab_size": model.padded_vocab_size(layout.tp),
        "per_stage": [{"stage": device.stage, "layers": device.num_layers, "stage_total": whole[device.stage].total,
                       "per_device": device.total, "per_device_parts": {
                           "embedding": device.embedding, "layers": device.layers,
                           "final_norm": device.final_norm, "output_head": device.output_head}}
                      for device in stages],
        "per_device_max": max(stage.total for stage in stages),
    }
    if _has_experts(model):
        for row, device in zip(section["per_stage"], stages):
            row["per_device_parts"]["experts"] = device.experts
    if model.config.mtp_num_layers:  # beside the total, as DeepSeek-V3 counts its 671B
        section["mtp"] = mtp_parameters(model.config)
        for row, device in zip(section["per_stage"], stages):
            row["per_device_parts"]["mtp"] = device.mtp
    return section


def _memory_section(model, layout, cluster, stages):
    per_stage = memory_per_stage(model, layout, stages)
    peak = max(per_stage, key=lambda memory: memory.total)
    capacity = cluster.device.memory_gib * GIB
    state = state_bytes_per_parameter(model.precision, layout.zero_stage)
    return {
        "per_stage": [dataclasses.asdict(memory) | {"total": memory.total} for memory in per_stage],
        "peak_stage": peak.stage, "peak_bytes": peak.total, "capacity_bytes": capacity,
        "margin_bytes": capacity - peak.total, "fits": peak.total <= capacity,
        "state_bytes_per_parameter": dataclasses.asdict(state),
        "state_bytes_per_parameter_on_device": dataclasses.asdict(
            sharded_state_bytes(state, layout.zero_stage, layout.sequence_data_parallel)),
        **({"expert_state_bytes_per_parameter_on_device": dataclasses.asdict(
            sharded_state_bytes(state, layout.zero_stage, expert_data_parallel_size(model, layout)))}
           if _has_experts(model) else {}),
        "activation_bytes_per_layer": {str(choice): layer_activation_bytes(model, layout, choice,
                                                                           fp8=model.config.fp8_format is not None)
                                       for choice in RECOMPUTE_CHOICES},
    }


def _flops_section(model, layout):
    variants = {str(choice): hardware_flops_per_iteration(model, dataclasses.replace(layout, recompute=choice))
                for choice in RECOMPUTE_CHOICES}
    return {"model_per_iteration": model_flops_per_iteration(model, layout),
            "hardware_per_iteration": hardware_flops_per_iteration(model, layout),
            "hardware_per_iteration_by_recompute": variants}


def _communication_section(model, layout, stages):
    tp_layer = comm.tensor_parallel_traffic_per_layer(model, layout)
    most_layers = max(stage.num_layers for stage in stages)
    m = layout.num_micro_batches
    pp_payload = comm.pipeline_payload_per_micro_batch(model, layout)
    section = {
        "tensor_parallel": {"payload_bytes": tp_layer.payload, "collectives": tp_layer.collectives,
                            "per_layer_per_micro_batch": {"forward": tp_layer.forward, "backward": tp_layer.backward,
                                                          "recompute": tp_layer.recompute},
                            "per_iteration_per_device": comm.tensor_parallel_bytes_per_micro_batch(
                                model, layout, most_layers) * m},
        "pipeline": {"payload_bytes_per_micro_batch": pp_payload,
                     "split_over_tensor_parallel": layout.pp > 1 and comm.split_over_tensor_parallel(layout),
                     "per_iteration_per_device": comm.pipeline_bytes_per_micro_batch(model, layout) * m,
                     "tensor_parallel_gathers_per_iteration_per_device":
                         comm.pipeline_gather_bytes_per_micro_batch(model, layout) * m},
        "data_parallel": {"ranks": layout.sequence_data_parallel,
                          "per_iteration_per_device": comm.largest_stage_data_parallel_traffic(model, layout, stages),
                          "tied_embedding_all_reduce": comm.tied_embedding_traffic(model, layout)},
    }
    if layout.ulysses > 1:
        per_layer = dataclasses.asdict(comm.ulysses_traffic_per_layer(model, layout))
        per_iteration = comm.ulysses_bytes_per_micro_batch(model, layout, most_layers) * m
        section["ulysses"] = {"ranks": layout.ulysses, "per_layer_per_micro_batch": per_layer,
                              "per_iteration_per_device": per_iteration}
    if layout.context > 1:
        section["context"] = {"ranks": layout.context, "per_layer_per_micro_batch": dataclasses.asdict(
            comm.context_traffic_per_layer(model, layout)),
            "per_iteration_per_device": comm.context_bytes_per_micro_batch(model, layout, most_layers) * m}
    fp8_layers = [n for n in range(1, model.config.num_layers + 1) if model.config.fp8_in_layer(n)]
    if fp8_layers and layout.tp > 1:
        section["fp8_amax_per_layer_per_micro_batch"] = dataclasses.asdict(
            comm.fp8_amax_reductions_per_layer(model, layout, fp8_layers[0]))
    if _has_experts(model):
        section["expert_parallel"] = {
            "all_to_all_per_layer_per_micro_batch": (moe_section(model, layout) or dropless_moe_section(
                model, layout))["all_to_all_per_layer_per_micro_batch"],
            "per_iteration_per_device": max(comm.expert_parallel_bytes_per_micro_batch(
                model, layout, stage.num_layers, stage.first_layer) for stage in stages) * m}
    return section


def _warnings(model, layout, cluster, performance):
    warnings = []
    links = performance["links"]
    if links["tensor_spans_nodes"]:
        warnings.append(f"TP {layout.tp} spans nodes of {cluster.gpus_per_node} GPUs: tensor-parallel "
                        f"collectives run over the inter-node network ({cluster.device.inter_node_gbs:g} GB/s)")
    if links["ulysses_spans_nodes"]:
        warnings.append(f"Ulysses SP {layout.ulysses} with TP {layout.tp} spans nodes of {cluster.gpus_per_node} "
                        f"GPUs: its all-to-alls run over the inter-node network ({cluster.device.inter_node_gbs:g} "
                        f"GB/s)")
    if layout.context > 1 and model.config.attention_dropout > 0:
        warnings.append(f"attention dropout {model.config.attention_dropout:g} with CP {layout.context}: the ring's "
                        f"blocks run plain math (fp32 scores of a block), a transient the plan does not count")
    if layout.num_micro_batches < layout.pp:
        warnings.append(f"{layout.num_micro_batches} micro-batches for {layout.pp} pipeline stages: most of the "
                        f"iteration is pipeline bubble")
    if layout.sequence_parallel and layout.tp == 1:
        warnings.append("--sequence-parallel has no effect with TP 1")
    if model.config.moe_residual:
        warnings.append("PR-MoE's residual MLP (--mlp-type residual) is not in the activation count: an MoE layer "
                        "keeps a dense MLP's activations more than the plan says")
    if model.config.is_dropless_moe and model.config.moe_expert_parallel_size > 1:
        warnings.append(_dropless_routing_warning(_dropless_rows(model, layout)))
    if model.config.is_moe and not model.config.moe_token_dropping:
        warnings.append("--disable-moe-token-dropping: an expert's capacity is its largest token count, which the "
                        "plan takes as balanced routing (k x tokens / experts); unbalanced routing keeps more")
    return warnings


def _dropless_routing_warning(rows):
    more = (rows["mlp_activation_bytes_worst"] - rows["mlp_activation_bytes_expected"]) / GIB
    return (f"dropless MoE: memory planned for the expected {rows['rows_computed_expected']:,.0f} rows per MoE layer "
            f"and micro-batch on a rank's experts (uniform routing: k x tokens); at worst (every row of the EP group "
            f"on one rank's experts, {rows['rows_computed_worst']:,.0f}) a layer keeps {more:.2f} GiB more per "
            f"micro-batch")


def make_plan(model: ModelSpec, layout: Layout, cluster: Cluster,
              assumptions: PerformanceAssumptions = PerformanceAssumptions(), all_stages: bool = True) -> dict:
    """Everything the planner reports about one layout; {"errors": [...]} when the layout is invalid."""
    errors = layout_errors(model, layout, cluster.world_size)
    if errors:
        return {"layout": dataclasses.asdict(layout), "errors": [list(error) for error in errors]}
    stages = rank_parameters(model, layout)
    if not all_stages:
        stages = representative_stages(stages)
    performance = estimate_performance(model, layout, cluster, stages, assumptions)
    return {
        "layout": dataclasses.asdict(layout) | {"num_micro_batches": layout.num_micro_batches},
        "errors": [],
        "parameters": _parameters_section(model, layout, stages),
        **({"moe": moe_section(model, layout)} if model.config.is_moe else {}),
        **({"dropless_moe": dropless_moe_section(model, layout)} if model.config.is_dropless_moe else {}),
        "memory": _memory_section(model, layout, cluster, stages),
        "flops": _flops_section(model, layout),
        "communication": _communication_section(model, layout, stages),
        "performance": performance,
        "checkpoint": checkpoint_section(model, layout, performance["iteration_s"], assumptions.checkpoint_write_gbs,
                                         assumptions.mtbf_hours),
        "warnings": _warnings(model, layout, cluster, performance),
    }
