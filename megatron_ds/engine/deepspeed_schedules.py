"""The pipeline schedules beyond 1F1B, run by DeepSpeed's pipeline engine: its instruction model, executor, p2p,
tied-module and gradient-reduction machinery, with two instructions added for the split backward.

  BackwardInputPass(buffer)   B: the gradient of the stage's input only (what the previous stage waits for);
                              the autograd graph is kept, with the gradients where the weights' paths leave it
  BackwardWeightPass(buffer)  W: the weight gradients of that micro-batch, from what its B kept

The split is by the autograd graph, so it covers every weight of a stage alike (column- and row-parallel
linears, norms, embeddings, the output layer, experts), with Megatron's sequence parallelism too: torch's own
pipelining split (torch.distributed.pipelining._backward: stage_backward_input / stage_backward_weight, torch
2.13), the gradients added into each weight's .grad.

zbh1 is DeepSpeed's TrainSchedule with the backward of rank r > 0 split and each W taken r backward steps later
(core/pipeline_schedules.py: the same order, simulated): the sends and receives are exactly 1F1B's, so the
pairing of DeepSpeed's blocking p2p is unchanged. Where a W sits between them decides whether it fills a wait or
makes one, since a blocking send waits for its receive: in the steady state it goes first in the next step,
before the gradient send, which the previous stage only receives after its forward (a W after the send holds up
that stage's activation send instead, and the pipeline idles a W per micro-batch); in the cool-down, which
receives nothing, it goes after the send. So placed, the steps take the planner's time when played with blocking
p2p (tests/unit/engine/test_deepspeed_schedules.py). Rank 0 sends no gradient
and keeps the whole backward. --enable-zbh1-exact-semantics changes nothing here: every weight gradient is taken
before the optimizer step, which runs where 1F1B's runs, so the update is 1F1B's exactly.

dualpipev is DeepSpeed's DualPipeVModule (two stages per rank, rank r: stages r and 2p - 1 - r) run by its
DualPipeVEngine, with DeepSpeed's DualPipeVSchedule's steps made zero-bubble: the backwards that
core/pipeline_schedules.py's dualpipev order splits run as B, and each W goes where that order puts it, after
the next commit of the rank's sends and receives (DualPipe's weight chunk: commit, then a W), so that it fills
time the rank would wait. DeepSpeed's sends, receives and commits are untouched, and so is their pairing.
"""
from deepspeed.runtime.pipe import schedule as deepspeed_schedule

from megatron_ds.core import deepspeed_internals
from megatron_ds.core.deepspeed_internals.interleaved_pipeline import become_interleaved, interleaved_module_class
from megatron_ds.core.deepspeed_internals.stage_partition import with_stage_boundaries
from megatron_ds.core.pipeline_schedules import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, stage_order


class BackwardInputPass(deepspeed_schedule.BufferOpInstruction):
    """B of the micro-batch in the buffer: its input gradient; the weight gradients wait for BackwardWeightPass."""


class BackwardWeightPass(deepspeed_schedule.BufferOpInstruction):
    """W of the micro-batch in the buffer: the weight gradients its BackwardInputPass left."""


class ZeroBubbleH1Schedule(deepspeed_schedule.TrainSchedule):
    """1F1B's steps with rank r's backwards split, each W emitted once r more B's have run, at the start of a
    later step after its gradient send; the W's left run before the gradient reductions."""

    def steps(self):
        pending = []  # buffers whose W waits, oldest first
        due = []      # W's to emit in the next step
        for step in super().steps():
            receives = any(isinstance(command, deepspeed_schedule.RecvActivation) for command in step)
            commands = []
            if receives:  # the previous stage is still in its forward: the W fills the wait before the send
                commands, due = [BackwardWeightPass(buffer) for buffer in due], []
            for command in step:
                if isinstance(command, deepspeed_schedule.ReduceTiedGrads):
                    commands += [BackwardWeightPass(buffer) for buffer in due + pending]
                    due, pending = [], []
                if self.stage_id > 0 and isinstance(command, deepspeed_schedule.BackwardPass):
                    commands.append(BackwardInputPass(command.buffer_id))
                    pending.append(command.buffer_id)
                    if len(pending) > self.stage_id:
                        due.append(pending.pop(0))
                    continue
                commands.append(command)
                if isinstance(command, deepspeed_schedule.SendGrad):  # the cool-down: nothing to receive
                    commands += [BackwardWeightPass(buffer) for buffer in due]
                    due = []
            yield commands

    def num_pipe_buffers(self):
        """A rank holds up to p micro-batches whose W has not run (1F1B's first rank's p)."""
        return max(2, min(self.stages, self.micro_batches))


class ZeroBubbleDualPipeVSchedule(deepspeed_schedule.DualPipeVSchedule):
    """DeepSpeed's DualPipeV steps, with core/pipeline_schedules.py's dualpipev split of the backwards and
    placement of the weight gradients (the order the planner times)."""

    def steps(self):
        order = stage_order("dualpipev", self.stages, self.micro_batches, self.stage_id)
        position, due = 0, []  # the next op of `order`; the W's to emit after the next commit
        for step in super().steps():
            commands = []
            for command in step:
                if isinstance(command, (deepspeed_schedule.ForwardPass, deepspeed_schedule.BackwardPass)):
                    commands += due
                    due = []
                    command, position = self._matched(command, order, position)
                    while position < len(order) and order[position].kind == WEIGHT_GRAD:
                        due.append(self._weight_pass(order[position]))
                        position += 1
                    if command is None:
                        continue
                elif isinstance(command, deepspeed_schedule.ReduceTiedGrads):
                    commands += due
                    due = []
                commands.append(command)
                if isinstance(command, deepspeed_schedule.CommitP2P):
                    commands += due
                    due = []
            yield commands
        if position != len(order):
            raise RuntimeError(f"DeepSpeed's DualPipeV schedule ran {position} of the {len(order)} ops that "
                               f"megatron_ds's dualpipev order has for rank {self.stage_id} (p {self.stages}, "
                               f"m {self.micro_batches}): the orders differ")

    def _matched(self, command, order, position):
        """The command to run for DeepSpeed's forward or backward `command` (a B where the order splits it), and
        the position after its op in the order, which must be that command's."""
        chunk, micro_batch = command.phase, command.buffer_id - command.phase * self.micro_batches
        kind = FORWARD if isinstance(command, deepspeed_schedule.ForwardPass) else BACKWARD
        op = order[position] if position < len(order) else None
        if op is None or (op.kind if op.kind != INPUT_GRAD else BACKWARD, op.chunk, op.micro_batch) != (
                kind, chunk, micro_batch):
            raise RuntimeError(f"DeepSpeed's DualPipeV schedule runs {command} on rank {self.stage_id} where "
                               f"megatron_ds's dualpipev order has {op} (p {self.stages}, m {self.micro_batches})")
        if op.kind == INPUT_GRAD:
            command = None if self._is_first_stage(chunk) else BackwardInputPass(command.buffer_id, phase=chunk)
        return command, position + 1

    def _weight_pass(self, op):
        """The W of the op; the model's first stage has no input gradient to split off (its input is the token
        ids), so its whole backward waits there instead (nothing is sent after it)."""
        buffer_id = op.chunk * self.micro_batches + op.micro_batch
        if self._is_first_stage(op.chunk):
            return deepspeed_schedule.BackwardPass(buffer_id, phase=op.chunk)
        return BackwardWeightPass(buffer_id, phase=op.chunk)

    def _is_first_stage(self, chunk):
        return self.stage_id == 0 and chunk == 0


def pipeline_module_class(name, virtual_stages=1, stage_boundaries=None):
    """The PipelineModule class that lays a schedule's stages out: DeepSpeed's DualPipeVModule holds two stages per
    rank (rank r: stage r and stage 2p-1-r), and deepspeed.initialize runs it with its DualPipeVEngine; the
    interleaved module (a DualPipeVModule too) holds v, rank r stages c x p + r. stage_boundaries: the layer spec
    where each model stage starts, and the spec count (gpt_model.pipeline_stage_boundaries), which the class then
    uses instead of its partition_method."""
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
    from deepspeed.runtime.pipe.module import PipelineModule
    if name == "interleaved":
        module_class = interleaved_module_class(virtual_stages)
    else:
        module_class = DualPipeVModule if name == "dualpipev" else PipelineModule
    if stage_boundaries is None:
        return module_class
    return with_stage_boundaries(module_class, stage_boundaries)


def install_schedule(engine, name, virtual_stages=1):
    """Make the pipeline engine train with the schedule `name` (1f1b: DeepSpeed's own, nothing to do)."""
    if name == "1f1b":
        return
    if name == "interleaved":
        become_interleaved(engine, virtual_stages)
        return
    deferred = {}  # buffer -> what its B kept for its W
    weight_pass = lambda self, buffer_id, **_: _backward_weight(self, buffer_id, deferred)  # noqa: E731
    if name == "zbh1":
        schedule = ZeroBubbleH1Schedule
        input_pass = lambda self, buffer_id: _backward_input(self, buffer_id, deferred)  # noqa: E731
    elif name == "dualpipev":  # the input gradient inside DualPipeVEngine's per-phase bookkeeping
        schedule = ZeroBubbleDualPipeVSchedule
        input_pass = lambda self, buffer_id, phase: deepspeed_internals.dualpipev_backward(  # noqa: E731
            self, buffer_id, phase, lambda: _backward_input(self, buffer_id, deferred))
    else:
        raise ValueError(f"pipeline schedule {name!r} is not run by the pipeline engine yet")
    deepspeed_internals.scale_loss_outside_output_hooks(engine)
    deepspeed_internals.install_train_schedule(engine, schedule, {BackwardInputPass: input_pass,
                                                                  BackwardWeightPass: weight_pass})


def _backward_input(engine, buffer_id, deferred):
    from torch.distributed.pipelining._backward import stage_backward_input
    if buffer_id in deferred:
        raise RuntimeError(f"pipeline buffer {buffer_id} still holds a micro-batch whose weight gradient has not run")
    targets, gradients = deepspeed_internals.backward_targets(engine, buffer_id)
    if gradients is not None:  # the engine receives the next micro-batch's gradients into the same tensors, and
        gradients = [gradient.clone() for gradient in gradients]  # the W may read these ones after that
    inputs = engine.pipe_buffers["inputs"][buffer_id]
    inputs = [tensor for tensor in (inputs if isinstance(inputs, tuple) else (inputs,))
              if tensor.is_floating_point() and tensor.requires_grad]
    weights = [param for param in engine.module.parameters() if param.requires_grad]
    with deepspeed_internals.engine_backward(engine), \
            deepspeed_internals.deepspeed_checkpoints_recompute_in_partial_backward():
        _, kept = stage_backward_input(targets, gradients, inputs, iter(weights))
    deferred[buffer_id] = (weights, kept)
    deepspeed_internals.free_backward_buffers(engine, buffer_id)


def _backward_weight(engine, buffer_id, deferred):
    from torch.distributed.pipelining._backward import stage_backward_weight
    weights, kept = deferred.pop(buffer_id)
    deepspeed_internals.before_weight_gradients(engine)
    stage_backward_weight(iter(weights), kept)  # the weights' gradient hooks run (sequence parallelism's sum)
    deepspeed_internals.after_weight_gradients(engine)
