"""Megatron's interleaved 1F1B inside DeepSpeed's pipeline engine: v model stages (chunks) per pipeline rank,
rank r holding model stages c x p + r, on the machinery of DeepSpeed's DualPipeV (its per-phase module, its
engine's per-phase buffers, queued p2p and commits), which DeepSpeed 0.19.8 ships for two chunks in a V and is
generalised here to v chunks in a ring: chunk c of the last rank sends to chunk c + 1 of rank 0.

  InterleavedModule      a DualPipeVModule whose phases are the rank's v chunks (deepspeed.initialize therefore
                         builds a DualPipeVEngine for it)
  InterleavedEngine      that engine with the ring's neighbours, the loss stage on the last rank's last chunk and
                         the labels loaded there; become_interleaved() makes the engine one
  InterleavedSchedule    core/pipeline_schedules.py's interleaved order (Megatron's), each forward's and backward's
                         sends queued with the receive of the next one's inputs, one commit per step, as Megatron's
                         batched p2p does

Activations and gradients between two ranks travel under their own tags: at PP 2 both kinds go both ways
between the same pair, with the same shapes, and a receive must never take the other kind's message.
"""
from deepspeed import comm as dist
from deepspeed.runtime.pipe import schedule as deepspeed_schedule
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule
from deepspeed.runtime.pipe.module import PipelineModule

from megatron_ds.core import deepspeed_internals
from megatron_ds.core.pipeline_schedules import FORWARD, model_stage, pipeline_rank_of, stage_order

ACTIVATION_TAG, GRADIENT_TAG = 1, 2
MESSAGE_TAGS = {deepspeed_schedule.SendActivation: ACTIVATION_TAG, deepspeed_schedule.RecvActivation: ACTIVATION_TAG,
                deepspeed_schedule.SendGrad: GRADIENT_TAG, deepspeed_schedule.RecvGrad: GRADIENT_TAG}


def interleaved_module_class(virtual_stages):
    """The InterleavedModule class for v chunks per rank (PipelineModule's constructor takes no such argument)."""
    return type(f"InterleavedModule{virtual_stages}", (InterleavedModule,), {"virtual_stages": virtual_stages})


class InterleavedModule(DualPipeVModule):
    virtual_stages = 2

    def _partition_layers(self, method="uniform"):
        self.pipeline_ranks = self.num_stages
        self.num_stages *= self.virtual_stages
        super(DualPipeVModule, self)._partition_layers(method)  # PipelineModule's, or given stage boundaries
        stages = [model_stage("interleaved", self.pipeline_ranks, self.stage_id, chunk)
                  for chunk in range(self.virtual_stages)]
        self.phase_bounds = [(self.parts[stage], self.parts[stage + 1]) for stage in stages]

    def stage_owner(self, layer_idx):
        """The pipeline rank that owns layer_idx (the rank of its model stage)."""
        return pipeline_rank_of("interleaved", self.pipeline_ranks, PipelineModule.stage_owner(self, layer_idx),
                                self.virtual_stages)

    def _precompute_checkpointable_values(self):
        self.phase_checkpointable = [[] for _ in range(self.virtual_stages)]
        for phase in range(self.virtual_stages):
            self.activate_phase(phase)
            self.is_checkpointable_results_interval = None  # the parent's cache must not carry over between phases
            PipelineModule._precompute_checkpointable_values(self)
            self.phase_checkpointable[phase] = self.is_checkpointable_results

    def _build(self):
        super()._build()
        self.phase_checkpointable = [[] for _ in range(self.virtual_stages)]

    def _each_phase(self, method, *args, **kwargs):
        for phase in range(self.virtual_stages):
            self.activate_phase(phase)
            method(self, *args, **kwargs)

    def save_state_dict(self, *args, **kwargs):
        self._each_phase(PipelineModule.save_state_dict, *args, **kwargs)

    def load_state_dir(self, *args, **kwargs):
        self._each_phase(PipelineModule.load_state_dir, *args, **kwargs)

    def compile(self, *args, **kwargs):
        self._each_phase(PipelineModule.compile, *args, **kwargs)


def _tagged(tag, method):
    """DualPipeVEngine's send or receive instruction, its messages queued under `tag`."""
    def run(engine, buffer_id, phase):
        engine._message_tag = tag
        try:
            return method(engine, buffer_id, phase)
        finally:
            engine._message_tag = None
    return run


def _tag_messages(instruction, method):
    tag = MESSAGE_TAGS.get(instruction)
    return method if tag is None else _tagged(tag, method)


class InterleavedEngine(DualPipeVEngine):
    """DualPipeVEngine's execution with the ring's placement (see become_interleaved)."""

    def is_last_stage(self):
        """Outside a phase: whether this rank holds the loss stage (it loads the labels and reports the loss)."""
        if self._active_phase is None:
            return self.stage_id == self.num_stages - 1
        return self._is_loss_stage(self._active_phase)

    def _is_loss_stage(self, phase):
        return self.stage_id == self.num_stages - 1 and phase == self.virtual_stages - 1

    def _is_last_rank(self):
        return False  # no chunk turns around on its own rank (DualPipeV's last rank does)

    def _loss_stage_global_rank(self):
        return self.grid.stage_to_global(self.num_stages - 1)

    def _downstream_stage(self, phase):
        return (self.stage_id + 1) % self.num_stages

    def _upstream_stage(self, phase):
        return (self.stage_id - 1) % self.num_stages

    def _phase1_buffer(self, buffer_id):
        """Where the labels of the micro-batch loaded into buffer_id go: the last chunk's slot of it."""
        return buffer_id + (self.virtual_stages - 1) * self.micro_batches

    def _train_schedule(self):
        return InterleavedSchedule(self.micro_batches, self.num_stages, self.stage_id, self.virtual_stages)

    def _inference_schedule(self, micro_batches):
        return InterleavedSchedule(micro_batches, self.num_stages, self.stage_id, self.virtual_stages,
                                   forward_only=True)

    def reset_activation_shape(self):
        super().reset_activation_shape()
        self._first_send = [True] * self.virtual_stages
        self._recv_specs = [None] * self.virtual_stages

    def _queue_p2p(self, op, tensors, stage):
        if self._message_tag is None:
            raise AssertionError("the interleaved engine queues a message outside a send or receive instruction")
        peer = self.grid.stage_to_global(stage)
        self._p2p_ops += [dist.P2POp(op, tensor, peer, tag=self._message_tag) for tensor in tensors]


def become_interleaved(engine, virtual_stages):
    """Make the DualPipeVEngine deepspeed.initialize built for an InterleavedModule run the interleaved schedule:
    the engine's class becomes InterleavedEngine, which keeps its state and changes its placement, and its send and
    receive instructions queue their messages under their kind's tag (0.19.8)."""
    if not isinstance(engine, DualPipeVEngine) or not isinstance(engine.module, InterleavedModule):
        raise TypeError(f"expected DeepSpeed's DualPipeVEngine over an InterleavedModule, got {type(engine).__name__}")
    engine.__class__ = InterleavedEngine
    engine.virtual_stages, engine._message_tag = virtual_stages, None
    engine.reset_activation_shape()
    deepspeed_internals.wrap_pipeline_instructions(engine, _tag_messages)


class InterleavedSchedule(deepspeed_schedule.PipeSchedule):
    """core/pipeline_schedules.py's interleaved order for one rank, as DeepSpeed instructions with a phase (the
    chunk): each step runs one op of the order's warm-up, steady 1F1B or cool-down, queues its sends with the
    receives of the next forward's input and the next backward's gradient, and commits them together."""

    def __init__(self, micro_batches, stages, stage_id, virtual_stages, forward_only=False):
        super().__init__(micro_batches, stages, stage_id)
        self.virtual_stages, self.forward_only = virtual_stages, forward_only

    def num_pipe_buffers(self):
        return self.virtual_stages * self.micro_batches

    def _buffer(self, op):
        return op.chunk * self.micro_batches + op.micro_batch

    def _takes_input(self, chunk):
        return not (self.stage_id == 0 and chunk == 0)

    def _is_loss_chunk(self, chunk):
        return self.stage_id == self.stages - 1 and chunk == self.virtual_stages - 1

    def _forward(self, op):
        """Rank 0 loads a micro-batch's inputs before its first chunk; the last rank its labels before its last."""
        commands = []
        if op.chunk == 0 and self.stage_id == 0:
            commands.append(deepspeed_schedule.LoadMicroBatch(self._buffer(op)))
        if self._is_loss_chunk(op.chunk) and self.stage_id != 0:
            commands.append(deepspeed_schedule.LoadMicroBatch(op.micro_batch))  # the labels, into the last chunk
        commands.append(deepspeed_schedule.ForwardPass(self._buffer(op), phase=op.chunk))
        if not self._is_loss_chunk(op.chunk):
            commands.append(deepspeed_schedule.SendActivation(self._buffer(op), phase=op.chunk))
        return commands

    def _backward(self, op):
        commands = [deepspeed_schedule.BackwardPass(self._buffer(op), phase=op.chunk)]
        if self._takes_input(op.chunk):
            commands.append(deepspeed_schedule.SendGrad(self._buffer(op), phase=op.chunk))
        return commands

    def _receive_input(self, op):
        if not self._takes_input(op.chunk):
            return []
        return [deepspeed_schedule.RecvActivation(self._buffer(op), phase=op.chunk)]

    def _receive_gradient(self, op):
        if self._is_loss_chunk(op.chunk):
            return []
        return [deepspeed_schedule.RecvGrad(self._buffer(op), phase=op.chunk)]

    def _receives(self, slot):
        """What the ops of a step need from the neighbours: a forward its input, a backward its gradient."""
        return [command for op in slot
                for command in (self._receive_input(op) if op.kind == FORWARD else self._receive_gradient(op))]

    def _slots(self):
        """The order's ops by step: each warm-up forward alone, then each forward with the backward after it (the
        steady 1F1B), then each cool-down backward alone."""
        order = stage_order("interleaved", self.stages, self.micro_batches, self.stage_id, self.virtual_stages)
        if self.forward_only:
            order = [op for op in order if op.kind == FORWARD]
        slots, forward = [], None
        for op in order:
            if op.kind == FORWARD:
                if forward is not None:
                    slots.append([forward])
                forward = op
            else:
                slots.append(([forward] if forward is not None else []) + [op])
                forward = None
        return slots + ([[forward]] if forward is not None else [])

    def steps(self):
        commit = deepspeed_schedule.CommitP2P()
        slots = self._slots()
        yield self._receives(slots[0]) + [commit]
        for index, slot in enumerate(slots):
            commands = [command for op in slot
                        for command in (self._forward(op) if op.kind == FORWARD else self._backward(op))]
            if index + 1 < len(slots):
                commands += self._receives(slots[index + 1])
            yield commands + [commit]
        if not self.forward_only:
            yield [deepspeed_schedule.ReduceTiedGrads(), deepspeed_schedule.ReduceGrads(),
                   deepspeed_schedule.OptimizerStep()]
