"""DeepSpeed's pipeline engine driven from outside: its instruction map and train schedule, the split backward's
targets and buffers, integer messages between stages, the layer partition and checkpointed inputs.
"""
import contextlib

from megatron_ds.core.deepspeed_internals.engine_mends import scaled_loss


def wrap_pipeline_instructions(engine, wrap):
    """Make the pipeline engine run wrap(instruction class, function) for each schedule instruction: it runs
    them through _INSTRUCTION_MAP {instruction class: unbound method}, looked up on self (0.19.8). Wrapping again
    wraps the wrapped functions."""
    engine._INSTRUCTION_MAP = {instruction: wrap(instruction, function)
                               for instruction, function in engine._INSTRUCTION_MAP.items()}


def install_train_schedule(engine, schedule_class, instructions):
    """Make the pipeline engine's train_batch run schedule_class(micro_batches, stages, stage_id) (a PipeSchedule)
    and understand `instructions` {instruction class: function(engine, **instruction kwargs)} besides its own:
    train_batch asks self._train_schedule() for the schedule and runs each instruction through
    self._INSTRUCTION_MAP (0.19.8). Install before anything wraps the instructions."""
    engine._train_schedule = lambda: schedule_class(micro_batches=engine.micro_batches, stages=engine.num_stages,
                                                    stage_id=engine.stage_id)
    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, **instructions}


def scale_loss_outside_output_hooks(engine):
    """From now on the engine's forwards register output hooks that leave gradients as they are: DeepSpeed's
    last stage otherwise divides its output's gradient by the accumulation steps in a hook on that tensor
    (_backward_prologue_per_tensor), which a weight-gradient pass starting at that tensor's node would run a
    second time; backward_targets divides the loss instead (0.19.8)."""
    engine._backward_prologue_per_tensor = lambda grad: grad


def backward_targets(engine, buffer_id):
    """(tensors, their gradients) a backward of the buffer's micro-batch starts from, as the pipeline engine's
    _exec_backward_pass has them: the last stage's loss over the accumulation steps, times fp16's loss scale
    (gradient None; see scale_loss_outside_output_hooks and scaled_loss), else the stage's floating-point
    outputs, reassembled where DeepSpeed split them over the TP ranks (pipe_partitioned / grad_partitioned), with
    the received gradients (0.19.8); those gradients carry the loss scale already."""
    from deepspeed.runtime.utils import PartitionedTensor
    if engine.is_last_stage():
        return [scaled_loss(engine, engine.loss / engine.gradient_accumulation_steps())], None
    outputs = engine.pipe_buffers["outputs"][buffer_id]
    group = engine.grid.get_slice_parallel_group()
    if engine.is_pipe_partitioned:
        whole = engine.pipe_buffers["output_tensors"][buffer_id]
        if engine.is_grad_partitioned:
            if engine.pipe_partition_output_meta_cache is None:
                engine.pipe_partition_output_meta_cache = outputs[0].to("cpu")
            whole.data = PartitionedTensor.from_meta(meta=engine.pipe_partition_output_meta_cache,
                                                     local_part=outputs[1], group=group).full()
            outputs = (whole, *outputs[2:])
        else:
            whole.data = outputs[0]
            outputs = (whole, *outputs[1:])
    gradients = engine.grad_layer
    if engine.is_grad_partitioned:
        if engine.grad_partition_grad_layer_meta_cache is None:
            engine.grad_partition_grad_layer_meta_cache = engine.grad_layer[0].to("cpu")
        full = PartitionedTensor.from_meta(meta=engine.grad_partition_grad_layer_meta_cache,
                                           local_part=engine.grad_layer[1], group=group).full()
        gradients = (full, *gradients[2:])
    outputs = [tensor for tensor in outputs if tensor.is_floating_point()] if isinstance(outputs, tuple) else [outputs]
    return outputs, list(gradients) if isinstance(gradients, (tuple, list)) else [gradients]


@contextlib.contextmanager
def deepspeed_checkpoints_recompute_in_partial_backward():
    """Within the block DeepSpeed's activation checkpoint recomputes inside a backward that asks for some inputs'
    gradients only (torch.autograd.grad, as the split backward's input-gradient pass does). Its reentrant
    CheckpointFunction.backward refuses one when torch.autograd._is_checkpoint_valid() is False, because its
    inner backward adds the recomputed region's weight gradients into their .grad, which .grad() promises not to
    do. Here that is wanted: those weights are reachable only through the checkpoint, so their gradients are taken
    there, during the input-gradient pass, as megatron_ds's own recompute takes them (0.19.8)."""
    import torch
    own = torch.autograd._is_checkpoint_valid
    torch.autograd._is_checkpoint_valid = lambda: True
    try:
        yield
    finally:
        torch.autograd._is_checkpoint_valid = own


def dualpipev_backward(engine, buffer_id, phase, backward):
    """DualPipeVEngine's backward of the buffer in `phase` - its loss or received (or, on the last rank, turned
    around) gradients made the engine's, the phase's layers active, its buffers freed after - with backward() in
    place of the pipeline engine's own, which DualPipeVEngine._exec_backward_pass calls through super() and is
    therefore swapped on the class for the call (0.19.8)."""
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine
    own = PipelineEngine._exec_backward_pass
    PipelineEngine._exec_backward_pass = lambda self, buffer_id: backward()
    try:
        DualPipeVEngine._exec_backward_pass(engine, buffer_id, phase)
    finally:
        PipelineEngine._exec_backward_pass = own


def pipeline_integer_messages(engine, activation):
    """{dtype: values} of the integer messages the pipeline engine sends beside `activation` (what a stage hands
    the next, a tensor or a tuple): torch.int32, the buffer _send_tensor_meta sends ahead of a stage's first
    message (kind, dtypes and shapes of what follows); torch.int64, where the engine splits the messages over TP
    (pipe_partitioned), the PartitionedTensor layout sent with every activation and gradient. A gradient's
    layout equals its activation's (same shape, same TP rank). Read in 0.19.8's _exec_forward_pass,
    _exec_send_activations, _send_tensor_meta and PartitionedTensor.to_meta; tools/dry_run.py answers the
    receives of its fake backend with them."""
    import torch
    from deepspeed.runtime.utils import PartitionedTensor
    messages, outputs = {}, activation
    if engine.is_pipe_partitioned:
        first, *tail = activation if isinstance(activation, tuple) else (activation,)
        part = PartitionedTensor(tensor=first, group=engine.grid.get_slice_parallel_group())
        messages[torch.int64] = part.to_meta().tolist()
        outputs = (part.to_meta(), part.data(), *tail)
    if isinstance(outputs, tuple) and (engine.has_attention_mask or engine.has_bool_tensors):
        outputs = (*outputs[:-1], outputs[-1].half())  # as _exec_send_activations sends a mask
    neighbour = engine.next_stage if engine.next_stage < engine.num_stages else engine.prev_stage
    with _sends_captured() as sent:
        engine._send_tensor_meta(outputs, neighbour)
    messages[torch.int32] = integer_message_values(sent[0])
    return messages


def integer_message_values(tensor):
    """The values of an integer pipeline message that the receiver reads: all of a PartitionedTensor layout
    (int64), the leading part of _send_tensor_meta's int32 buffer (kind 0: a tensor, dtype, ndims, shape; kind 2:
    a tuple, its length, then dtype, ndims, shape per tensor; the rest is left uninitialised), 0.19.8."""
    import torch
    values = tensor.tolist()
    if tensor.dtype != torch.int32 or not values:
        return values
    if values[0] == 0:
        return values[:3 + values[2]]
    end = 2
    for _ in range(values[1] if values[0] == 2 else 0):
        end += 2 + values[end + 1]
    return values[:end]


@contextlib.contextmanager
def _sends_captured():
    """Copies of the tensors of every point-to-point send issued inside the block, in order (a fake backend
    moves nothing)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    sent = []

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.c10d.send.default:
                sent.extend(tensor.clone() for tensor in args[0])
            return func(*args, **(kwargs or {}))

    with Capture():
        yield sent


def free_backward_buffers(engine, buffer_id):
    """Drop the buffer's outputs once its backward has run, as _exec_backward_pass does (0.19.8)."""
    engine.pipe_buffers["output_tensors"][buffer_id] = None
    engine.pipe_buffers["outputs"][buffer_id] = None


def before_weight_gradients(engine):
    """BF16_Optimizer: its 16-bit gradients cleared before weight gradients are added into them, as the pipeline
    engine does before a backward (0.19.8)."""
    if engine.using_bf16_optimizer:
        engine.optimizer.clear_lp_grads()


def after_weight_gradients(engine):
    """BF16_Optimizer (without immediate_grad_update): the 16-bit weight gradients just computed added into its
    fp32 gradients and cleared, which the pipeline engine does after a backward (update_hp_grads) (0.19.8)."""
    if engine.using_bf16_optimizer and not engine.optimizer.immediate_grad_update:
        engine.optimizer.update_hp_grads(clear_lp_grads=True)


def checkpoint_saved_inputs(node):
    """The tensors DeepSpeed's activation checkpointing keeps for backward in autograd node `node` (its
    ctx.deepspeed_saved_tensors; a partitioned input keeps only its saved_data) (0.19.8); [] for other nodes."""
    import torch
    kept = []
    for tensor in getattr(node, "deepspeed_saved_tensors", None) or ():
        if torch.is_tensor(tensor):
            kept.append(tensor.saved_data if getattr(tensor, "saved_data", None) is not None else tensor)
    return kept
