"""--pipeline-timeline DIR: what each pipeline rank ran, and when, for a few iterations, and how much of the
pipeline it spent waiting.

Every instruction DeepSpeed's pipeline engine executes (its schedule's loads, forwards, backwards, sends,
receives, gradient reductions and optimizer step) is timed on every rank for the recorded iterations: those of
the --profile window (--profile-step-start .. --profile-step-end - 1), else the three after the run's first
(warm-up) iteration. Each rank writes

    DIR/timeline_rank<R>.json    Chrome trace events (open in https://ui.perfetto.dev or chrome://tracing):
                                 one complete event per instruction, the process named by stage and rank

and at the end of training rank 0 prints each stage's idle share of the pipeline: 1 - (forward + backward
time) / (the pipeline's span: from the first instruction of any rank to the end of the last one before the
gradient reductions, on the hosts' clocks), the mean over the recorded iterations and the stage's ranks, beside
the planner's bubble for the schedule (which divides by the same span, its makespan). A stage's own span would
leave out the time its rank waits before its first instruction or after its last: the last stage's cool-down
under 1F1B. tools/plot_timeline.py
draws all ranks' timelines into one PNG.
"""
import json
import os
import time

import torch.distributed as dist

from megatron_ds.core import deepspeed_internals, parallel_state
from megatron_ds.core.pipeline_schedules import simulate, split_micro_batch

COMPUTE = ("ForwardPass", "BackwardPass", "BackwardInputPass", "BackwardWeightPass")
PIPELINE_END = ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")
FILE_PATTERN = "timeline_rank{rank}.json"
RECORDED_AFTER_WARMUP = 3


def recorded_iterations(logging, first_iteration, last_iteration):
    """The iterations a timeline records: --pipeline-timeline-iterations, else the --profile window, else the three
    after the first of this run."""
    if logging.pipeline_timeline_iterations:
        return range(*logging.pipeline_timeline_iterations)
    if logging.profile:
        return range(logging.profile_step_start, logging.profile_step_end)
    return range(first_iteration + 1, min(first_iteration + 1 + RECORDED_AFTER_WARMUP, last_iteration + 1))


def pipeline_timeline(logging, parallel, model, engine, first_iteration):
    """The run's PipelineTimeline with --pipeline-timeline (from its LoggingConfig, ParallelLayout and
    TransformerConfig), else one that records nothing."""
    if not logging.pipeline_timeline:
        return NoTimeline()
    iterations = recorded_iterations(logging, first_iteration, logging.train_iters)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    return PipelineTimeline(logging.pipeline_timeline, engine, iterations, stage, dist.get_rank(),
                            parallel.pipeline_schedule, parallel.virtual_stages,
                            full_recompute=model.recompute_granularity == "full")


class NoTimeline:
    def begin(self, iteration, micro_batches):
        pass

    def end(self):
        pass

    def finish(self):
        pass


class PipelineTimeline:
    """Call begin(iteration, micro-batches) before and end() after each iteration, finish() once training is over
    (every rank: finish gathers the idle shares)."""

    def __init__(self, folder, engine, iterations, stage, rank, schedule, virtual_stages=1, full_recompute=False):
        self.folder, self.iterations, self.stage, self.rank = folder, iterations, stage, rank
        self.schedule, self.virtual_stages, self.full_recompute = schedule, virtual_stages, full_recompute
        self.stages = parallel_state.get_pipeline_model_parallel_world_size()
        self.planned_bubbles = {}  # micro-batches -> the planner's bubble
        self.events, self.recording, self.iteration = [], False, None
        self.extents = []  # per recorded iteration: (iteration, first start, last end, compute seconds)
        deepspeed_internals.wrap_pipeline_instructions(engine, self._timed)

    def _timed(self, instruction, method):
        name = instruction.__name__

        def run(engine, **kwargs):
            if not self.recording:
                return method(engine, **kwargs)
            start = time.time()
            try:
                return method(engine, **kwargs)
            finally:
                self.events.append((self.iteration, name, kwargs.get("buffer_id"), start, time.time()))
        return run

    def begin(self, iteration, micro_batches):
        self.recording, self.iteration = iteration in self.iterations, iteration
        if self.recording and micro_batches not in self.planned_bubbles:
            self.planned_bubbles[micro_batches] = self.planned_bubble(micro_batches)

    def planned_bubble(self, micro_batches):
        """The planner's bubble: its split of a micro-batch's time, equal stages."""
        times = split_micro_batch(self.schedule, self.virtual_stages, self.full_recompute)
        return simulate(self.schedule, self.stages, micro_batches, times, self.virtual_stages).bubble_fraction

    def end(self):
        if self.recording:
            extent = pipeline_extent([event for event in self.events if event[0] == self.iteration])
            if extent is not None:
                self.extents.append((self.iteration, *extent))
        self.recording = False

    def finish(self):
        """Write this rank's trace; rank 0 prints every stage's idle share."""
        if self.events:
            _write_trace(os.path.join(self.folder, FILE_PATTERN.format(rank=self.rank)), self.events, self.stage,
                         self.rank)
        extents = [None] * dist.get_world_size()
        dist.all_gather_object(extents, (self.stage, self.extents))
        if self.rank == 0 and any(recorded for _, recorded in extents):
            print(self.summary(idle_shares_by_stage(extents)), flush=True)

    def summary(self, by_stage):
        measured = ", ".join(f"stage {stage} {sum(values) / len(values):.1%}"
                             for stage, values in sorted(by_stage.items()) if values)
        first, last = self.iterations[0], self.iterations[-1]
        planned = ", ".join(f"{bubble:.1%} at {m} micro-batches" for m, bubble in sorted(self.planned_bubbles.items()))
        return (f"megatron_ds: pipeline timeline of iterations {first}-{last} ({self.schedule}): idle share of the "
                f"pipeline per stage: {measured}; the planner's bubble for this schedule: {planned}; traces: "
                f"{os.path.join(self.folder, FILE_PATTERN.format(rank='*'))} (https://ui.perfetto.dev)")


def pipeline_extent(events):
    """(start of the first, end of the last pipeline instruction before the gradient reductions, seconds of
    forwards and backwards) of one rank's iteration (events: (iteration, name, buffer, start, end)); None if none."""
    pipeline = [event for event in events if event[1] not in PIPELINE_END]
    if not pipeline:
        return None
    return (min(event[3] for event in pipeline), max(event[4] for event in pipeline),
            sum(event[4] - event[3] for event in pipeline if event[1] in COMPUTE))


def idle_shares_by_stage(extents):
    """{stage: [idle share per rank and iteration]} from every rank's (stage, [(iteration, start, end, compute)]):
    1 - compute / the iteration's span over all ranks."""
    spans = {}
    for _, recorded in extents:
        for iteration, start, end, _ in recorded:
            first, last = spans.get(iteration, (start, end))
            spans[iteration] = (min(first, start), max(last, end))
    by_stage = {}
    for stage, recorded in extents:
        for iteration, _, _, compute in recorded:
            first, last = spans[iteration]
            by_stage.setdefault(stage, []).append(1.0 - compute / (last - first) if last > first else 0.0)
    return by_stage


def _write_trace(path, events, stage, rank):
    """Chrome trace-event JSON, written to a temporary name and renamed."""
    trace = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"stage {stage} (rank {rank})"}},
             {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
    for iteration, name, buffer_id, start, end in events:
        trace.append({"name": name if buffer_id is None else f"{name} {buffer_id}", "cat": name, "ph": "X",
                      "pid": rank, "tid": 0, "ts": start * 1e6, "dur": (end - start) * 1e6,
                      "args": {"iteration": iteration, "buffer": buffer_id, "stage": stage}})
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, handle)
    os.replace(temporary, path)
