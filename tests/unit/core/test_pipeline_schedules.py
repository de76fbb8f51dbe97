"""The pipeline schedules' orders: complete and deadlock-free, the published bubbles reproduced by the
simulation, DualPipeV's order the same as DeepSpeed's DualPipeVSchedule, and the flag rules' messages."""
import pytest
from deepspeed.runtime.pipe import schedule as deepspeed_schedule

from megatron_ds.core.pipeline_schedules import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    SCHEDULES,
    WEIGHT_GRAD,
    ChunkTimes,
    Op,
    ScheduleDeadlock,
    chunks_per_rank,
    micro_batch_problems,
    schedule_problems,
    simulate,
    stage_order,
)

SHAPES = [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 24)]
TIMES = [ChunkTimes(1.0, 1.0, 1.0), ChunkTimes(1.0, 1.3, 0.7), ChunkTimes(1.0, 2.0, 1.0)]


def _virtual(schedule):
    return 2 if schedule == "interleaved" else 1


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("ranks, micro_batches", SHAPES)
def test_every_rank_runs_each_micro_batch_once_each_way(schedule, ranks, micro_batches):
    v = _virtual(schedule)
    for rank in range(ranks):
        order = stage_order(schedule, ranks, micro_batches, rank, v)
        for chunk in range(chunks_per_rank(schedule, v)):
            ops = [op for op in order if op.chunk == chunk]
            forwards = [op.micro_batch for op in ops if op.kind == FORWARD]
            whole = [op.micro_batch for op in ops if op.kind == BACKWARD]
            inputs = [op.micro_batch for op in ops if op.kind == INPUT_GRAD]
            weights = [op.micro_batch for op in ops if op.kind == WEIGHT_GRAD]
            assert sorted(forwards) == list(range(micro_batches))
            assert sorted(whole + inputs) == list(range(micro_batches)) and sorted(inputs) == sorted(weights)
            for mb in inputs:  # a weight gradient after its input gradient
                assert ops.index(Op(WEIGHT_GRAD, mb, chunk)) > ops.index(Op(INPUT_GRAD, mb, chunk))


@pytest.mark.parametrize("ranks, micro_batches", SHAPES)
@pytest.mark.parametrize("times", TIMES)
def test_simulated_bubbles_are_the_published_ones(ranks, micro_batches, times):
    """1F1B: (p - 1)(F + B); ZB-H1: (p - 1)(F + B - 2W), B the whole backward (Qi et al. 2023, for W <= F);
    interleaved with v chunks of 1/v of a stage each: (p - 1)(F + B) / v (Narayanan et al. 2021)."""
    p, m = ranks, micro_batches
    f, b, w = times.forward, times.input_grad + times.weight_grad, times.weight_grad
    work = m * (f + b)
    assert simulate("1f1b", p, m, times).makespan == pytest.approx(work + (p - 1) * (f + b))
    assert simulate("zbh1", p, m, times).makespan == pytest.approx(work + (p - 1) * (f + b - 2 * w))
    for v in (2, 3):
        chunk = ChunkTimes(times.forward / v, times.input_grad / v, times.weight_grad / v)
        if m % p == 0:
            assert simulate("interleaved", p, m, chunk, v).makespan == pytest.approx(work + (p - 1) * (f + b) / v)


@pytest.mark.parametrize("ranks, micro_batches", SHAPES)
def test_zero_bubble_holds_no_more_activations_than_one_forward_one_backward(ranks, micro_batches):
    times = ChunkTimes(1.0, 1.0, 1.0)
    plain, zero_bubble = simulate("1f1b", ranks, micro_batches, times), simulate("zbh1", ranks, micro_batches, times)
    assert plain.peak_in_flight == tuple(min(ranks - rank, micro_batches) for rank in range(ranks))
    assert max(zero_bubble.peak_in_flight) <= max(plain.peak_in_flight)
    half = ChunkTimes(0.5, 0.5, 0.5)  # DualPipeV: two chunks of half a stage each
    if micro_batches >= 2 * ranks:
        dual = simulate("dualpipev", ranks, micro_batches, half)
        assert dual.bubble_fraction < zero_bubble.bubble_fraction < plain.bubble_fraction


@pytest.mark.parametrize("ranks, micro_batches", [(2, 4), (2, 7), (4, 8), (4, 11), (8, 16)])
def test_dualpipev_runs_deepspeeds_order(ranks, micro_batches):
    """Forwards and backwards, by chunk (DeepSpeed's phase) and micro-batch, in the order DeepSpeed 0.19's
    DualPipeVSchedule issues them; ours splits the last backwards and places their weight gradients."""
    for rank in range(ranks):
        ours = [(op.kind == FORWARD, op.chunk, op.micro_batch)
                for op in stage_order("dualpipev", ranks, micro_batches, rank) if op.kind != WEIGHT_GRAD]
        theirs = [(isinstance(command, deepspeed_schedule.ForwardPass), command.kwargs.get("phase", 0),
                   command.buffer_id % micro_batches)
                  for step in deepspeed_schedule.DualPipeVSchedule(micro_batches, ranks, rank).steps()
                  for command in step
                  if isinstance(command, (deepspeed_schedule.ForwardPass, deepspeed_schedule.BackwardPass))]
        assert ours == theirs


def test_an_order_that_waits_forever_is_named():
    orders = [[Op(BACKWARD, 0), Op(FORWARD, 0)], [Op(FORWARD, 0), Op(BACKWARD, 0)]]
    with pytest.raises(ScheduleDeadlock, match="rank 0 at Op"):
        simulate("1f1b", 2, 1, ChunkTimes(1.0, 1.0, 1.0), orders=orders)


def test_schedule_rules_name_the_numbers_and_the_nearest_valid_values():
    assert schedule_problems("1f1b", 1) == [] and micro_batch_problems("1f1b", 4, 3) == []
    assert schedule_problems("zbh1", 1) == [
        "--pipeline-schedule zbh1 needs --pipeline-model-parallel-size 2 or more (it is 1): with one stage there "
        "is no pipeline to schedule"]
    assert micro_batch_problems("dualpipev", 4, 6) == [
        "the dualpipev schedule needs at least 2 x --pipeline-model-parallel-size = 8 micro-batches per iteration "
        "(it has 6: global batch / (micro batch x data-parallel size))"]
    assert micro_batch_problems("interleaved", 4, 10) == [
        "the interleaved schedule needs the micro-batches per iteration (10: global batch / (micro batch x "
        "data-parallel size)) to be a multiple of --pipeline-model-parallel-size 4 (nearest: 8, 12)"]
    assert "2 or more virtual stages" in schedule_problems("interleaved", 2, 1)[0]
    assert schedule_problems("gpipe", 2) == ["--pipeline-schedule gpipe: choose one of 1f1b, zbh1, interleaved, "
                                             "dualpipev"]
