"""The pipeline schedule's part of a plan: how long the pipeline takes for m micro-batches, how much of it is
bubble, and how many micro-batches' activations a rank holds at its peak.

1F1B keeps its closed form ((m + p - 1) slots of the slowest stage, (p - 1) / (m + p - 1) bubble, min(p - r, m)
micro-batches in flight on rank r). The other schedules are timed by simulating their order
(core/pipeline_schedules.py) with every chunk as slow as the slowest stage's share, a micro-batch's time split
as split_micro_batch says (forward : input gradient : weight gradient = 1 : 1 (2 with full recompute) : 1).
"""
import functools
from dataclasses import dataclass

from megatron_ds.core.pipeline_schedules import chunks_per_rank, simulate, split_micro_batch


@dataclass(frozen=True)
class PipelineEstimate:
    seconds: float                # fill, steady state and drain of one iteration's micro-batches
    bubble_fraction: float        # the share of `seconds` the busiest rank waits


def bubble_fraction(pp: int, num_micro_batches: int) -> float:
    """1F1B: (p - 1) / (m + p - 1) of the iteration is pipeline fill and drain."""
    return (pp - 1) / (num_micro_batches + pp - 1)


def _unit_and_times(layout, stage_seconds: float):
    """(seconds of a stage's forward, ChunkTimes in those units) for a rank whose whole stage takes stage_seconds
    per micro-batch (forward + backward); in units, one simulation serves every speed."""
    times = split_micro_batch(layout.pipeline_schedule, layout.virtual_stages, layout.recompute == "full")
    chunks = chunks_per_rank(layout.pipeline_schedule, layout.virtual_stages)
    return stage_seconds / ((times.forward + times.input_grad + times.weight_grad) * chunks), times


def estimate(layout, stage_seconds: float) -> PipelineEstimate:
    p, m = layout.pp, layout.num_micro_batches
    if layout.pipeline_schedule == "1f1b" or p == 1:
        return PipelineEstimate((m + p - 1) * stage_seconds, bubble_fraction(p, m))
    unit, times = _unit_and_times(layout, stage_seconds)
    simulation = _simulation(layout.pipeline_schedule, p, m, layout.virtual_stages, times)
    return PipelineEstimate(simulation.makespan * unit, simulation.bubble_fraction)


def in_flight_micro_batches(layout, rank: int) -> float:
    """Micro-batches of a whole stage's activations rank `rank` holds at its peak (a held chunk counts 1 / v)."""
    p, m = layout.pp, layout.num_micro_batches
    if layout.pipeline_schedule == "1f1b" or p == 1:
        return min(p - rank, m)
    _, times = _unit_and_times(layout, 1.0)
    simulation = _simulation(layout.pipeline_schedule, p, m, layout.virtual_stages, times)
    return simulation.peak_in_flight[rank] / chunks_per_rank(layout.pipeline_schedule, layout.virtual_stages)


def head_rank(layout) -> int:
    """The pipeline rank holding the final norm, the output head and the loss (DualPipeV's V ends on rank 0)."""
    return 0 if layout.pipeline_schedule == "dualpipev" else layout.pp - 1


@functools.lru_cache(maxsize=256)
def _simulation(schedule, ranks, micro_batches, virtual_stages, times):
    return simulate(schedule, ranks, micro_batches, times, virtual_stages)
