"""One plan: parameters, memory, FLOPs, communication and estimated time of a layout, as a JSON-ready dict."""
import dataclasses

from megatron_ds.planning import communication as comm
from megatron_ds.planning.flops import hardware_flops_per_iteration, model_flops_per_iteration
from megatron_ds.planning.memory import (GIB, layer_activation_bytes, memory_per_stage, sharded_state_bytes,
                                         state_bytes_per_parameter)
from megatron_ds.planning.model import RECOMPUTE_CHOICES, Cluster, Layout, ModelSpec, layout_errors
from megatron_ds.planning.parameters import stage_parameters, total_parameters
from megatron_ds.planning.performance import PerformanceAssumptions, estimate_performance


def representative_stages(stages):
    """The stages that can hold the most memory or take the longest: the first two and the last."""
    keep = {0, 1, len(stages) - 1}
    return [stage for stage in stages if stage.stage in keep]


def _parameters_section(model, layout, stages):
    padded = dataclasses.replace(model, vocab_size=model.padded_vocab_size(layout.tp), make_vocab_size_divisible_by=1)
    whole = {stage.stage: stage for stage in stage_parameters(padded, 1, layout.pp)}  # distinct, over TP ranks
    return {
        "total": total_parameters(model, layout.tp),
        "padded_vocab_size": model.padded_vocab_size(layout.tp),
        "per_stage": [{"stage": device.stage, "layers": device.num_layers, "stage_total": whole[device.stage].total,
                       "per_device": device.total, "per_device_parts": {
                           "embedding": device.embedding, "layers": device.layers,
                           "final_norm": device.final_norm, "output_head": device.output_head}}
                      for device in stages],
        "per_device_max": max(stage.total for stage in stages),
    }


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
            sharded_state_bytes(state, layout.zero_stage, layout.dp)),
        "activation_bytes_per_layer": {str(choice): layer_activation_bytes(model, layout, choice)
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
    dp = comm.data_parallel_traffic(model, layout, max(s.total for s in stages)) if layout.dp > 1 else {}
    return {
        "tensor_parallel": {"payload_bytes": tp_layer.payload, "collectives": tp_layer.collectives,
                            "per_layer_per_micro_batch": {"forward": tp_layer.forward, "backward": tp_layer.backward,
                                                          "recompute": tp_layer.recompute},
                            "per_iteration_per_device": comm.tensor_parallel_bytes_per_micro_batch(
                                model, layout, most_layers) * m},
        "pipeline": {"payload_bytes_per_micro_batch": pp_payload,
                     "per_iteration_per_device": 2 * pp_payload * m if layout.pp > 1 else 0.0},
        "data_parallel": {"per_iteration_per_device": dp,
                          "tied_embedding_all_reduce": comm.tied_embedding_traffic(model, layout)},
    }


def _warnings(model, layout, cluster, performance):
    warnings = []
    links = performance["links"]
    if links["tensor_spans_nodes"]:
        warnings.append(f"TP {layout.tp} spans nodes of {cluster.gpus_per_node} GPUs: tensor-parallel "
                        f"collectives run over the inter-node network ({cluster.device.inter_node_gbs:g} GB/s)")
    if layout.num_micro_batches < layout.pp:
        warnings.append(f"{layout.num_micro_batches} micro-batches for {layout.pp} pipeline stages: most of the "
                        f"iteration is pipeline bubble")
    if layout.sequence_parallel and layout.tp == 1:
        warnings.append("--sequence-parallel has no effect with TP 1")
    if model.config.attention_backend == "sdpa" and layout.recompute is None:
        warnings.append("activations use the paper's 5as/h attention-score term; flash attention (sdpa on GPUs) "
                        "stores no scores, so the activation figure is an upper bound")
    return warnings


def make_plan(model: ModelSpec, layout: Layout, cluster: Cluster,
              assumptions: PerformanceAssumptions = PerformanceAssumptions(), all_stages: bool = True) -> dict:
    """Everything the planner reports about one layout; {"errors": [...]} when the layout is invalid."""
    errors = layout_errors(model, layout)
    if layout.world_size != cluster.world_size:
        errors.append(("layout does not match the world size",
                       f"TP {layout.tp} x PP {layout.pp} x DP {layout.dp} != {cluster.world_size}"))
    if errors:
        return {"layout": dataclasses.asdict(layout), "errors": [list(error) for error in errors]}
    stages = stage_parameters(model, layout.tp, layout.pp)
    if not all_stages:
        stages = representative_stages(stages)
    performance = estimate_performance(model, layout, cluster, stages, assumptions)
    return {
        "layout": dataclasses.asdict(layout) | {"num_micro_batches": layout.num_micro_batches},
        "errors": [],
        "parameters": _parameters_section(model, layout, stages),
        "memory": _memory_section(model, layout, cluster, stages),
        "flops": _flops_section(model, layout),
        "communication": _communication_section(model, layout, stages),
        "performance": performance,
        "warnings": _warnings(model, layout, cluster, performance),
    }
