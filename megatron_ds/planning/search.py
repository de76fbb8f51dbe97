"""--search: every (tp, Ulysses, CP, pp, dp, micro batch, recompute, SP) for a model on a cluster, ranked by
estimated iteration time; the infeasible ones counted by the first rule they break, with the nearest examples.
Each layout with PP > 1 that fits under 1F1B is also timed under every pipeline schedule its layers and
micro-batches allow (ZB-H1; DualPipeV; interleaved with v = 2 to 4 virtual stages), and keeps the fastest that
fits: its row names the schedule.

DeepSpeed-Ulysses is searched only where it is needed. Its use is to split a sample's activations (and its
tokens, where the global batch has fewer samples than data-parallel ranks); the time model credits it with
less compute per micro-batch and a smaller pipeline bubble, but cannot see what it costs beyond its all-to-alls:
matmuls over s/U tokens and attention over a/(tU) heads run less efficiently. So a layout with Ulysses size
U > 1 is tried only when the same TP, PP, micro batch, Megatron SP and recompute choice is infeasible with every
smaller Ulysses size (each U' dividing U, the other ranks in DP): out of memory, breaking a rule, or no candidate
at all (micro batch x DP above the global batch). Context parallelism (CP, the ring) is searched the same way,
with the same reasons: a layout with U x CP ranks splitting each sample is tried only when every smaller split
(U' dividing U, CP' dividing CP, the other ranks in DP) of the same TP, PP, micro batch, SP and recompute fails.
Layouts passed over this way are counted (sequence_split_skipped). With a long sequence whose activations fit no
layout without a split, the search offers the smallest Ulysses and CP sizes that fit each layout and the ranking
chooses among those and the other layouts that fit (Ulysses' all-to-alls against the ring's hops, which hide
behind the attention blocks).

Megatron-LM's uneven split flags (--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-
pipeline-split) say how to split at any PP, so every candidate keeps them: one whose PP or schedule they do not
fit breaks the uneven split's rule, as pretrain.py would refuse it.
"""
import dataclasses
from collections import defaultdict

from megatron_ds.core.parallel_layout import divisors, layouts_of_world
from megatron_ds.core.pipeline_split import PipelineSplit
from megatron_ds.planning.memory import GIB, memory_per_stage
from megatron_ds.planning.model import RECOMPUTE_CHOICES, Cluster, Layout, ModelSpec, layout_errors
from megatron_ds.planning.parameters import rank_parameters
from megatron_ds.planning.performance import PerformanceAssumptions, estimate_performance
from megatron_ds.planning.planner import representative_stages

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
EXAMPLES_PER_REASON = 3


def layouts_with_context(world_size: int):
    """Every (Ulysses SP, TP, PP, CP, DP) whose product is the world size: core's layouts_of_world with each
    divisor of its DP as CP; smaller Ulysses sizes first, and for each Ulysses, TP and PP smaller CP sizes first."""
    for ulysses, tp, pp, rest in layouts_of_world(world_size):
        for context in divisors(rest):
            yield ulysses, tp, pp, context, rest // context


def candidate_layouts(world_size: int, global_batch_size: int, zero_stage: int, split=PipelineSplit(),
                      cp_comm_type: str = "p2p"):
    """All layouts of the world, smaller Ulysses and CP sizes first, each with the split (and CP's exchange);
    micro batches larger than a data-parallel rank's share are skipped."""
    for ulysses, tp, pp, context, dp in layouts_with_context(world_size):
        for micro in MICRO_BATCH_SIZES:
            if micro > 1 and micro * dp > global_batch_size:
                continue
            for sequence_parallel in ((False, True) if tp > 1 else (False,)):
                for recompute in RECOMPUTE_CHOICES:
                    yield Layout(tp, pp, dp, micro, global_batch_size, sequence_parallel, recompute, zero_stage,
                                 ulysses=ulysses, split=split, context=context, cp_comm_type=cp_comm_type)


def smaller_sequence_splits(layout: Layout):
    """The same layout with each smaller split of a sample (Ulysses and CP sizes dividing its own, not both its
    own), the other ranks in DP."""
    splits = [(ulysses, context) for ulysses in divisors(layout.ulysses) for context in divisors(layout.context)]
    return [dataclasses.replace(layout, ulysses=ulysses, context=context,
                                dp=layout.sequence_data_parallel // (ulysses * context))
            for ulysses, context in splits[:-1]]


def evaluate(model: ModelSpec, layout: Layout, cluster: Cluster, assumptions: PerformanceAssumptions):
    """(reason, detail, shortfall bytes) for an infeasible layout, else the summary row."""
    errors = layout_errors(model, layout)
    if errors:
        return errors[0] + (None,)
    stages = representative_stages(rank_parameters(model, layout))
    peak = max(memory.total for memory in memory_per_stage(model, layout, stages))
    capacity = cluster.device.memory_gib * GIB
    if peak > capacity:
        return ("out of memory", f"needs {peak / GIB:.1f} GiB of {cluster.device.memory_gib:g} "
                                 f"(over by {(peak - capacity) / GIB:.1f} GiB)", peak - capacity)
    performance = estimate_performance(model, layout, cluster, stages, assumptions)
    return {"pipeline_schedule": layout.pipeline_schedule, "virtual_stages": layout.virtual_stages,
            "tp": layout.tp, "ulysses": layout.ulysses, "context": layout.context, "pp": layout.pp, "dp": layout.dp,
            "micro_batch_size": layout.micro_batch_size,
            "num_micro_batches": layout.num_micro_batches, "sequence_parallel": layout.sequence_parallel,
            "recompute": layout.recompute, "peak_memory_gib": peak / GIB, "margin_gib": (capacity - peak) / GIB,
            "bubble_fraction": performance["bubble_fraction"], "iteration_s": performance["iteration_s"],
            "hardware_tflops_per_device": performance["hardware_tflops_per_device"], "mfu": performance["mfu"],
            "tp_spans_nodes": performance["links"]["tensor_spans_nodes"]}


MAX_SEARCHED_VIRTUAL_STAGES = 4


def schedule_variants(layout: Layout):
    """The layout under each other pipeline schedule (none at PP 1); evaluate() refuses those whose rules it
    breaks (the layers of a stage that its virtual stages do not divide among them)."""
    if layout.pp == 1:
        return []
    return [dataclasses.replace(layout, pipeline_schedule="zbh1"),
            dataclasses.replace(layout, pipeline_schedule="dualpipev", virtual_stages=2),
            *(dataclasses.replace(layout, pipeline_schedule="interleaved", virtual_stages=v)
              for v in range(2, MAX_SEARCHED_VIRTUAL_STAGES + 1))]


def _fastest_schedule(model, layout, cluster, assumptions, row):
    """The row of the fastest schedule of the layout that fits (row: its 1F1B row)."""
    for variant in schedule_variants(layout):
        result = evaluate(model, variant, cluster, assumptions)
        if isinstance(result, dict) and result["iteration_s"] < row["iteration_s"]:
            row = result
    return row


def _describe(layout: Layout) -> str:
    ulysses = f" Ulysses {layout.ulysses}" if layout.ulysses > 1 else ""
    context = f" CP {layout.context}" if layout.context > 1 else ""
    return (f"TP {layout.tp}{ulysses}{context} PP {layout.pp} DP {layout.dp} mb {layout.micro_batch_size} "
            f"SP {'on' if layout.sequence_parallel else 'off'} recompute {layout.recompute or 'none'}")


def _examples(items):
    """The layouts closest to feasible (smallest memory shortfall), one per distinct detail."""
    examples, details = [], set()
    for _, (layout_text, detail) in sorted(items, key=lambda item: item[0]):
        if detail not in details:
            details.add(detail)
            examples.append(f"{layout_text}: {detail}")
        if len(examples) == EXAMPLES_PER_REASON:
            break
    return examples


def search_layouts(model: ModelSpec, cluster: Cluster, global_batch_size: int, zero_stage: int = 1,
                   assumptions: PerformanceAssumptions = PerformanceAssumptions(), top: int = 20,
                   split: PipelineSplit = PipelineSplit(), cp_comm_type: str = "p2p") -> dict:
    """The candidates of the world, each with the split (the flags' uneven one, or the even split) and CP's
    exchange (the flags')."""
    feasible, infeasible, fitting, skipped = [], defaultdict(list), set(), 0
    for layout in candidate_layouts(cluster.world_size, global_batch_size, zero_stage, split, cp_comm_type):
        if any(smaller in fitting for smaller in smaller_sequence_splits(layout)):
            skipped += 1
            continue
        result = evaluate(model, layout, cluster, assumptions)
        if isinstance(result, dict):
            result = _fastest_schedule(model, layout, cluster, assumptions, result)
            feasible.append(result)
            fitting.add(layout)
        else:
            reason, detail, shortfall = result
            infeasible[reason].append((shortfall or 0.0, (_describe(layout), detail)))
    feasible.sort(key=lambda row: (row["iteration_s"], row["peak_memory_gib"]))
    by_reason = {reason: {"count": len(items), "examples": _examples(items)}
                 for reason, items in sorted(infeasible.items(), key=lambda entry: -len(entry[1]))}
    return {"world_size": cluster.world_size, "global_batch_size": global_batch_size, "split": split.describe(),
            "candidates": len(feasible) + sum(len(items) for items in infeasible.values()),
            "sequence_split_skipped": skipped, "feasible": len(feasible), "ranked": feasible[:top],
            "infeasible_by_reason": by_reason}
