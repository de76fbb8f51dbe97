"""The pipeline schedules beyond 1F1B, run by DeepSpeed's pipeline engine: its instruction model, executor, p2p,
tied-module and gradient-reduction machinery, with two instructions added for the split backward.

  BackwardInputPass(buffer)   B: the gradient of the stage's input only (what the previous stage waits for);
                              the autograd graph is kept, with the gradients where the weights' paths leave it
  BackwardWeightPass(buffer)  W: the weight gradients of that micro-batch, from what its B kept

The split is by the autograd graph, so it covers every weight of a stage alike (column- and row-parallel
linears, norms, embeddings, the output layer, experts), with Megatron's sequence parallelism too: torch's own
pipelining split (torch.distributed.pipelining._backward: stage_backward_input / stage_backward_weight, torch
2.13), the gradients added into each weight's .grad.

zbh1 is DeepSpeed's TrainSchedule with the backward of rank r > 0 split and each W taken r backward steps later,
after the next step's gradient send (core/pipeline_schedules.py: the same order, simulated): the sends and
receives are exactly 1F1B's, so the pairing of DeepSpeed's blocking p2p is unchanged. Rank 0 sends no gradient
and keeps the whole backward. --enable-zbh1-exact-semantics changes nothing here: every weight gradient is taken
before the optimizer step, which runs where 1F1B's runs, so the update is 1F1B's exactly.
"""
from deepspeed.runtime.pipe import schedule as deepspeed_schedule

from megatron_ds.core import deepspeed_internals


class BackwardInputPass(deepspeed_schedule.BufferOpInstruction):
    """B of the micro-batch in the buffer: its input gradient; the weight gradients wait for BackwardWeightPass."""


class BackwardWeightPass(deepspeed_schedule.BufferOpInstruction):
    """W of the micro-batch in the buffer: the weight gradients its BackwardInputPass left."""


class ZeroBubbleH1Schedule(deepspeed_schedule.TrainSchedule):
    """1F1B's steps with rank r's backwards split, each W emitted once r more B's have run, at the start of a
    later step after its gradient send; the W's left run before the gradient reductions."""

    def steps(self):
        pending = []  # buffers whose W waits, oldest first
        due = []      # W's to emit at the start of the next step
        for step in super().steps():
            commands = []
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
                if isinstance(command, deepspeed_schedule.SendGrad) or (due and _is_receive(command)):
                    commands += [BackwardWeightPass(buffer) for buffer in due]
                    due = []
            yield commands

    def num_pipe_buffers(self):
        """A rank holds up to p micro-batches whose W has not run (1F1B's first rank's p)."""
        return max(2, min(self.stages, self.micro_batches))


def _is_receive(command):
    return isinstance(command, (deepspeed_schedule.RecvActivation, deepspeed_schedule.RecvGrad))


def install_schedule(engine, name):
    """Make the pipeline engine train with the schedule `name` (1f1b: DeepSpeed's own, nothing to do)."""
    if name == "1f1b":
        return
    if name != "zbh1":
        raise ValueError(f"pipeline schedule {name!r} is not run by the pipeline engine yet")
    deferred = {}  # buffer -> what its B kept for its W
    deepspeed_internals.scale_loss_outside_output_hooks(engine)
    deepspeed_internals.install_train_schedule(
        engine, ZeroBubbleH1Schedule,
        {BackwardInputPass: lambda self, buffer_id: _backward_input(self, buffer_id, deferred),
         BackwardWeightPass: lambda self, buffer_id: _backward_weight(self, buffer_id, deferred)})


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
    with deepspeed_internals.engine_backward(engine):
        _, kept = stage_backward_input(targets, gradients, inputs, iter(weights))
    deferred[buffer_id] = (weights, kept)
    deepspeed_internals.free_backward_buffers(engine, buffer_id)


def _backward_weight(engine, buffer_id, deferred):
    from torch.distributed.pipelining._backward import stage_backward_weight
    weights, kept = deferred.pop(buffer_id)
    deepspeed_internals.before_weight_gradients(engine)
    stage_backward_weight(iter(weights), kept)  # the weights' gradient hooks run (sequence parallelism's sum)
    deepspeed_internals.after_weight_gradients(engine)
