"""The instruction streams the pipeline engine runs for the schedules beyond 1F1B, read off the schedule objects
(no process). Played against each other with DeepSpeed's p2p (TrainSchedule's sends and receives block until
they meet; DualPipeV's wait at each commit) and unit compute times, ZB-H1's streams take the planner's time and
DualPipeV's stay within a chunk op per extra rank of it, both faster than what they replace. The zero-bubble
DualPipeV keeps every send, receive and commit of DeepSpeed's DualPipeVSchedule in its order, splits the
backwards that megatron_ds's dualpipev order splits, and runs each weight gradient once, after its input gradient
and before the gradient reductions; the model's first stage keeps its whole backward.
The interleaved schedule runs Megatron's order, and its messages all pair up (each receive gets the micro-batch
and chunk it expects) and never deadlock."""
import pytest
from deepspeed.runtime.pipe import schedule as deepspeed_schedule

from megatron_ds.core.deepspeed_internals.interleaved_pipeline import InterleavedSchedule
from megatron_ds.core.pipeline_schedules import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    ChunkTimes,
    simulate,
    split_micro_batch,
    stage_order,
)
from megatron_ds.engine.deepspeed_schedules import (
    BackwardInputPass,
    BackwardWeightPass,
    ZeroBubbleDualPipeVSchedule,
    ZeroBubbleH1Schedule,
)

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


# --- the ranks' streams played against each other -------------------------------------------------------------

P2P = (deepspeed_schedule.SendActivation, deepspeed_schedule.SendGrad, deepspeed_schedule.RecvActivation,
       deepspeed_schedule.RecvGrad)


def _play(streams, route, duration=lambda command: 0.0):
    """Every rank's stream run at once with rendezvous p2p: compute takes duration(command); a send or receive is
    posted when its rank reaches it (TrainSchedule's block right there; DualPipeV's and the interleaved
    schedule's queue until the next CommitP2P, which posts them all, as DeepSpeed's commit waits for all its
    requests) and the rank goes on once each posted op has met its partner, matched in order per channel.
    route(rank, command) = (side "send" or "recv", channel, item). Returns (whether each rank finished, the
    receives whose item differs from the send's, the makespan)."""
    ranks = len(streams)
    position, clock = [0] * ranks, [0.0] * ranks
    queued, waiting = [[] for _ in range(ranks)], [None] * ranks
    posted = {}  # (side, channel) -> [(time, item)] in posting order
    wrong = []
    partner = {"send": "recv", "recv": "send"}

    def completes(rank):
        if waiting[rank] is None:
            waiting[rank] = []
            for side, channel, item in queued[rank]:
                book = posted.setdefault((side, channel), [])
                waiting[rank].append((side, channel, len(book), item))
                book.append((clock[rank], item))
            queued[rank] = []
        met = [posted.get((partner[side], channel), []) for side, channel, _, _ in waiting[rank]]
        if any(len(book) <= index for book, (_, _, index, _) in zip(met, waiting[rank])):
            return False
        wrong.extend((channel, book[index][1], item) for book, (side, channel, index, item) in zip(met, waiting[rank])
                     if side == "recv" and book[index][1] != item)
        clock[rank] = max([clock[rank]] + [book[index][0] for book, (_, _, index, _) in zip(met, waiting[rank])])
        waiting[rank] = None
        return True

    batched = [any(isinstance(c, deepspeed_schedule.CommitP2P) for c in stream) for stream in streams]
    moved = True
    while moved:
        moved = False
        for rank in range(ranks):
            while position[rank] < len(streams[rank]):
                command = streams[rank][position[rank]]
                if isinstance(command, P2P):
                    if waiting[rank] is None:
                        queued[rank].append(route(rank, command))
                    if not batched[rank] and not completes(rank):
                        break
                elif isinstance(command, deepspeed_schedule.CommitP2P) and not completes(rank):
                    break
                clock[rank] += duration(command)
                position[rank] += 1
                moved = True
    return [p == len(stream) for p, stream in zip(position, streams)], wrong, max(clock)


def _neighbour_route(rank, command):
    """Phase 0's activations go to the next rank, phase 1's (the second stage of a DualPipeV rank) to the
    previous one; gradients the other way. The item is not checked (buffers are slots, not micro-batches)."""
    phase = getattr(command, "phase", 0)
    downstream, upstream = (rank + 1, rank - 1) if phase == 0 else (rank - 1, rank + 1)
    if isinstance(command, deepspeed_schedule.SendActivation):
        return "send", (rank, downstream, "act", phase), None
    if isinstance(command, deepspeed_schedule.SendGrad):
        return "send", (rank, upstream, "grad", phase), None
    if isinstance(command, deepspeed_schedule.RecvActivation):
        return "recv", (upstream, rank, "act", phase), None
    return "recv", (downstream, rank, "grad", phase), None


def _makespan(schedule_class, ranks, micro_batches, times):
    """The streams of `schedule_class` at compute times `times` (ChunkTimes), played with DeepSpeed's p2p."""
    seconds = {deepspeed_schedule.ForwardPass: times.forward, BackwardInputPass: times.input_grad,
               BackwardWeightPass: times.weight_grad,
               deepspeed_schedule.BackwardPass: times.input_grad + times.weight_grad}
    streams = [_stream(schedule_class(micro_batches, ranks, rank)) for rank in range(ranks)]
    finished, _, makespan = _play(streams, _neighbour_route, lambda command: seconds.get(type(command), 0.0))
    assert all(finished), "the streams deadlock"
    return makespan


@pytest.mark.parametrize("ranks, micro_batches", [(2, 4), (2, 8), (2, 16), (3, 9), (4, 8), (4, 16)])
@pytest.mark.parametrize("times", [ChunkTimes(1, 1, 1), ChunkTimes(1, 0.8, 1.2), ChunkTimes(1, 1.3, 1)],
                         ids=["equal", "cheap-input-grad", "dear-input-grad"])
def test_zbh1_takes_the_planners_time_under_blocking_p2p(ranks, micro_batches, times):
    """The planner's time at equal F, B and W; when B and W differ, a blocking send can wait their difference once
    per extra stage. Where a W sits between the sends decides it: after the gradient send it holds up the previous
    stage's activation send and the pipeline idles a W per micro-batch (31 units at PP 2, m 8, 1F1B's 27)."""
    played = _makespan(ZeroBubbleH1Schedule, ranks, micro_batches, times)
    planned = simulate("zbh1", ranks, micro_batches, times).makespan
    assert planned - 1e-9 <= played <= planned + (ranks - 1) * abs(times.input_grad - times.weight_grad) + 1e-9
    assert played < _makespan(deepspeed_schedule.TrainSchedule, ranks, micro_batches, times)


@pytest.mark.parametrize("ranks, micro_batches", [(2, 4), (2, 8), (2, 16), (3, 9), (4, 8), (4, 16)])
def test_dualpipev_stays_near_the_planners_time_under_deepspeeds_commits(ranks, micro_batches):
    """A commit posts and waits at once, so a W cannot overlap the wait it follows: within one chunk op per
    extra rank of the planner, and faster than DeepSpeed's DualPipeV with its whole backwards."""
    times = split_micro_batch("dualpipev")
    played = _makespan(ZeroBubbleDualPipeVSchedule, ranks, micro_batches, times)
    planned = simulate("dualpipev", ranks, micro_batches, times).makespan
    assert planned - 1e-9 <= played <= planned + (ranks - 1) * times.forward + 1e-9
    assert played < _makespan(deepspeed_schedule.DualPipeVSchedule, ranks, micro_batches, times)


@pytest.mark.parametrize("ranks, micro_batches, rank", [(2, 8, 1), (4, 8, 1), (4, 9, 3)])
def test_zbh1_computes_the_planned_order(ranks, micro_batches, rank):
    stream = _stream(ZeroBubbleH1Schedule(micro_batches, ranks, rank))
    kinds = {deepspeed_schedule.ForwardPass: FORWARD, BackwardInputPass: INPUT_GRAD, BackwardWeightPass: WEIGHT_GRAD}
    assert [(kinds[type(c)], c.buffer_id) for c in stream if isinstance(c, COMPUTE)] == \
           [(op.kind, op.micro_batch % ZeroBubbleH1Schedule(micro_batches, ranks, rank).num_pipe_buffers())
            for op in stage_order("zbh1", ranks, micro_batches, rank)]


# --- interleaved ------------------------------------------------------------------------------------------

def _messages(ranks, micro_batches, virtual_stages, forward_only):
    """Every rank's interleaved stream played against the others (_play): whether each finished, and every
    received (micro-batch, chunk) that differs from what was sent."""
    streams = [[c for step in InterleavedSchedule(micro_batches, ranks, rank, virtual_stages, forward_only).steps()
                for c in step] for rank in range(ranks)]

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

    finished, wrong, _ = _play(streams, route)
    return finished, wrong


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
