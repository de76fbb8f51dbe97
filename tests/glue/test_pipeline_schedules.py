"""The instruction streams the pipeline engine runs for the schedules beyond 1F1B, read off the schedule objects
(no process): the zero-bubble DualPipeV keeps every send, receive and commit of DeepSpeed's DualPipeVSchedule
in its order, splits the backwards that megatron_ds's dualpipev order splits, and runs each weight gradient once,
after its input gradient and before the gradient reductions; the model's first stage keeps its whole backward."""
import pytest
from deepspeed.runtime.pipe import schedule as deepspeed_schedule

from megatron_ds.core.pipeline_schedules import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, stage_order
from megatron_ds.glue.pipeline_schedules import (BackwardInputPass, BackwardWeightPass,
                                                 ZeroBubbleDualPipeVSchedule)

COMPUTE = (deepspeed_schedule.ForwardPass, deepspeed_schedule.BackwardPass, BackwardInputPass, BackwardWeightPass)
CASES = [(ranks, micro_batches, rank) for ranks in (2, 3, 4, 6) for micro_batches in (2 * ranks, 2 * ranks + 3)
         for rank in range(ranks)]


def _stream(schedule):
    return [command for step in schedule.steps() for command in step]


def _signature(command):
    return type(command).__name__, command.kwargs


@pytest.mark.parametrize("ranks, micro_batches, rank", CASES)
def test_the_communication_is_deepspeeds_own(ranks, micro_batches, rank):
    ours = _stream(ZeroBubbleDualPipeVSchedule(micro_batches, ranks, rank))
    theirs = _stream(deepspeed_schedule.DualPipeVSchedule(micro_batches, ranks, rank))
    assert [_signature(c) for c in ours if not isinstance(c, COMPUTE)] == \
           [_signature(c) for c in theirs if not isinstance(c, COMPUTE)]


@pytest.mark.parametrize("ranks, micro_batches, rank", CASES)
def test_the_compute_follows_the_planned_order(ranks, micro_batches, rank):
    """The engine's forwards, input gradients and weight gradients are the planner's dualpipev ops, in its order
    (the first stage's split backward runs whole where its W is planned: it has no input gradient)."""
    stream = _stream(ZeroBubbleDualPipeVSchedule(micro_batches, ranks, rank))
    kinds = {deepspeed_schedule.ForwardPass: FORWARD, deepspeed_schedule.BackwardPass: BACKWARD,
             BackwardInputPass: INPUT_GRAD, BackwardWeightPass: WEIGHT_GRAD}
    ran = [(kinds[type(c)], c.buffer_id % micro_batches, c.phase) for c in stream if isinstance(c, COMPUTE)]
    planned = []
    for op in stage_order("dualpipev", ranks, micro_batches, rank):
        if rank == 0 and op.chunk == 0 and op.kind in (INPUT_GRAD, WEIGHT_GRAD):
            if op.kind == WEIGHT_GRAD:
                planned.append((BACKWARD, op.micro_batch, 0))
            continue
        planned.append((op.kind, op.micro_batch, op.chunk))
    assert ran == planned
    assert any(kind == WEIGHT_GRAD for kind, _, _ in ran)  # every rank defers some weight gradients


@pytest.mark.parametrize("ranks, micro_batches, rank", CASES)
def test_each_weight_gradient_runs_once_after_its_input_gradient_before_the_reductions(ranks, micro_batches, rank):
    stream = _stream(ZeroBubbleDualPipeVSchedule(micro_batches, ranks, rank))
    reductions = next(i for i, c in enumerate(stream) if isinstance(c, deepspeed_schedule.ReduceTiedGrads))
    inputs = {c.buffer_id: i for i, c in enumerate(stream) if isinstance(c, BackwardInputPass)}
    weights = {c.buffer_id: i for i, c in enumerate(stream) if isinstance(c, BackwardWeightPass)}
    assert len(weights) == len([c for c in stream if isinstance(c, BackwardWeightPass)])
    assert weights.keys() == inputs.keys()
    assert all(inputs[buffer] < weights[buffer] < reductions for buffer in weights)
    whole = [c.buffer_id for c in stream if isinstance(c, deepspeed_schedule.BackwardPass)]
    assert len(whole) + len(inputs) == 2 * micro_batches and not set(whole) & inputs.keys()
    if rank == 0:
        assert all(buffer >= micro_batches for buffer in inputs)  # stage 0 (phase 0 of rank 0): whole backwards
