"""The instruction streams the pipeline engine runs for the schedules beyond 1F1B, read off the schedule objects
(no process): the zero-bubble DualPipeV keeps every send, receive and commit of DeepSpeed's DualPipeVSchedule
in its order, splits the backwards that megatron_ds's dualpipev order splits, and runs each weight gradient once,
after its input gradient and before the gradient reductions; the model's first stage keeps its whole backward.
The interleaved schedule runs Megatron's order, and its messages, played against each other rank by rank with
rendezvous sends, all pair up (each receive gets the micro-batch and chunk it expects) and never deadlock."""
import pytest
from deepspeed.runtime.pipe import schedule as deepspeed_schedule

from megatron_ds.core.pipeline_schedules import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, stage_order
from megatron_ds.glue.interleaved_pipeline import InterleavedSchedule
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


# --- interleaved ------------------------------------------------------------------------------------------

def _messages(ranks, micro_batches, virtual_stages, forward_only):
    """Run every rank's interleaved instruction stream against the others with rendezvous p2p (a commit ends once
    each of its sends has met its receive and each receive its send, matched in order per (source, destination,
    kind), as DeepSpeed's commit waits for all its requests): each rank's position at the end, and every received
    (micro-batch, chunk) against what was sent."""
    streams = [[c for step in InterleavedSchedule(micro_batches, ranks, rank, virtual_stages, forward_only).steps()
                for c in step] for rank in range(ranks)]
    position, queued, in_flight = [0] * ranks, [[] for _ in range(ranks)], [None] * ranks
    posted = {"send": {}, "recv": {}}
    wrong = []

    def route(rank, command):
        micro_batch = command.buffer_id % micro_batches
        if isinstance(command, deepspeed_schedule.SendActivation):
            wraps = rank == ranks - 1
            return "send", (rank, (rank + 1) % ranks, "act"), (micro_batch, command.phase + wraps)
        if isinstance(command, deepspeed_schedule.SendGrad):
            wraps = rank == 0
            return "send", (rank, (rank - 1) % ranks, "grad"), (micro_batch, command.phase - wraps)
        if isinstance(command, deepspeed_schedule.RecvActivation):
            return "recv", ((rank - 1) % ranks, rank, "act"), (micro_batch, command.phase)
        return "recv", ((rank + 1) % ranks, rank, "grad"), (micro_batch, command.phase)

    def commit_done(rank):
        if in_flight[rank] is None:
            in_flight[rank] = []
            for side, channel, item in queued[rank]:
                book = posted[side].setdefault(channel, [])
                in_flight[rank].append((side, channel, len(book), item))
                book.append(item)
            queued[rank] = []
        other = {"send": "recv", "recv": "send"}
        if not all(len(posted[other[side]].get(channel, [])) > index for side, channel, index, _ in in_flight[rank]):
            return False
        wrong.extend((channel, posted["send"][channel][index], item) for side, channel, index, item in in_flight[rank]
                     if side == "recv" and posted["send"][channel][index] != item)
        in_flight[rank] = None
        return True

    moved = True
    while moved:
        moved = False
        for rank in range(ranks):
            while position[rank] < len(streams[rank]):
                command = streams[rank][position[rank]]
                if isinstance(command, deepspeed_schedule.CommitP2P) and not commit_done(rank):
                    break
                if isinstance(command, (deepspeed_schedule.SendActivation, deepspeed_schedule.SendGrad,
                                        deepspeed_schedule.RecvActivation, deepspeed_schedule.RecvGrad)):
                    queued[rank].append(route(rank, command))
                position[rank] += 1
                moved = True
    return [p == len(s) for p, s in zip(position, streams)], wrong


@pytest.mark.parametrize("ranks, virtual_stages", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 3), (5, 4)])
@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "eval"])
def test_the_interleaved_messages_pair_up_without_deadlock(ranks, virtual_stages, forward_only):
    for micro_batches in (2 * ranks, 3 * ranks):
        finished, wrong = _messages(ranks, micro_batches, virtual_stages, forward_only)
        assert all(finished), (micro_batches, finished)
        assert wrong == [], wrong


@pytest.mark.parametrize("ranks, virtual_stages, micro_batches", [(2, 2, 4), (4, 3, 8)])
def test_the_interleaved_compute_is_megatrons_order(ranks, virtual_stages, micro_batches):
    """Each rank runs core/pipeline_schedules.py's interleaved order (Megatron's), loads its micro-batches where
    its chunks need them (rank 0 the inputs, the last rank the labels) and reduces once at the end."""
    for rank in range(ranks):
        stream = [c for step in InterleavedSchedule(micro_batches, ranks, rank, virtual_stages).steps() for c in step]
        ran = [(FORWARD if isinstance(c, deepspeed_schedule.ForwardPass) else BACKWARD, c.buffer_id % micro_batches,
                c.phase) for c in stream if isinstance(c, (deepspeed_schedule.ForwardPass,
                                                           deepspeed_schedule.BackwardPass))]
        planned = [(op.kind, op.micro_batch, op.chunk)
                   for op in stage_order("interleaved", ranks, micro_batches, rank, virtual_stages)]
        assert ran == planned
        loads = [c.buffer_id for c in stream if isinstance(c, deepspeed_schedule.LoadMicroBatch)]
        assert loads == (list(range(micro_batches)) if rank in (0, ranks - 1) else [])
        assert [type(c).__name__ for c in stream[-3:]] == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
