"""The one door into DeepSpeed's internals: private names, module state, instruction maps, monkeypatches and
optimizer fields that DeepSpeed does not offer as API. Nothing else in megatron_ds, tools/ or pretrain.py touches
them (tests/glue/test_deepspeed_internals.py scans for the names in OWNED_NAMES).

Each function says what it relies on; all of it was read in, and is tested against, DeepSpeed 0.19.8 (the
range the package pins: SUPPORTED_DEEPSPEED). A DeepSpeed upgrade starts here.

It lives in core/ because core (parallel_state, the MoE layer) needs some of it and imports nothing from outside
core/. It imports DeepSpeed only inside the functions: importing it must not pick DeepSpeed's accelerator
before glue/runtime.py's prepare_host() has run.
"""
import contextlib
import os
from pathlib import Path

SUPPORTED_DEEPSPEED = ">=0.19.8,<0.20"

# What this module owns, as the source scan looks for them: an attribute or imported name, or a dotted
# "module.name" where the bare name is too common to scan for.
OWNED_NAMES = (
    "_INSTRUCTION_MAP", "_hp_mapping", "_hp_optimizer_states_linked",
    "single_partition_of_fp32_groups", "fp32_groups_flat_partition", "bit16_groups", "bf16_groups", "fp16_groups",
    "non_expert_gradients", "has_moe_layers", "buffered_allreduce_fallback", "cur_scale", "loss_scaler",
    "optimizer.param_names", "engine.checkpoint_engine",
    "_get_expert_parallel_rank", "_get_expert_data_parallel_rank", "_get_expert_parallel_group_dict",
    "_get_expert_data_parallel_group_dict", "_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS",
    "_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "expert_tensor_parallel_world_size",
    "groups.mpu", "_gather_tokens", "sharded_moe.drop_tokens", "sharded_moe.gather_tokens",
    "__compatible_ops__", "comm.cdb", "shm_comm_op", "shm_vector_kernel_level",
    "deepspeed_saved_tensors", "saved_data",
    "_train_schedule", "_running_engine_backward", "immediate_grad_update", "pipe_partition_output_meta_cache",
    "grad_partition_grad_layer_meta_cache", "update_hp_grads", "clear_lp_grads", "_backward_prologue_per_tensor",
    "_send_tensor_meta", "has_bool_tensors", "scale_if_loss", "torch_autocast_z0_gradscaler",
    "_is_checkpoint_valid", "loss_scale_config", "custom_loss_scaler", "external_loss_scale",
    "_global_grad_norm", "clip_fp32_gradients", "ds_pipe_replicated", "fp32_groups_flat", "fp16_groups_flat",
    "fp32_groups", "_take_model_step", "_force_grad_boundary", "averaged_gradients", "all_grad_tensors",
    "_release_preflattened_grad_buffers", "reset_cpu_buffers", "_update_hp_grad", "clear_hp_grads",
)


# --- the supported versions -----------------------------------------------------------------------------

def deepspeed_version_errors(version=None):
    """[message] when DeepSpeed `version` (default: the installed one) is outside SUPPORTED_DEEPSPEED, else []."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
    if version is None:
        import deepspeed
        version = deepspeed.__version__
    try:
        supported = SpecifierSet(SUPPORTED_DEEPSPEED).contains(Version(version), prereleases=True)
    except InvalidVersion:
        supported = False
    if supported:
        return []
    return [f"DeepSpeed {version} is installed; megatron_ds supports deepspeed{SUPPORTED_DEEPSPEED} (it reaches "
            f"into DeepSpeed internals that change between versions): pip install 'deepspeed{SUPPORTED_DEEPSPEED}'"]


def check_deepspeed_version(version=None):
    """Raise RuntimeError naming the installed and the supported versions when they do not match."""
    errors = deepspeed_version_errors(version)
    if errors:
        raise RuntimeError(errors[0])


# --- expert-parallel groups (deepspeed.utils.groups) ----------------------------------------------------

def expert_parallel_rank(group_name):
    """This rank in DeepSpeed's expert-parallel group `group_name`, 0 when it has none by that name.
    Relies on groups._get_expert_parallel_group_dict and _get_expert_parallel_rank (0.19.8)."""
    from deepspeed.utils import groups
    return groups._get_expert_parallel_rank(group_name) if group_name in groups._get_expert_parallel_group_dict() else 0


def expert_data_parallel_rank(group_name):
    """This rank in DeepSpeed's expert-data-parallel group `group_name`, 0 when it has none by that name.
    Relies on groups._get_expert_data_parallel_group_dict and _get_expert_data_parallel_rank (0.19.8)."""
    from deepspeed.utils import groups
    known = group_name in groups._get_expert_data_parallel_group_dict()
    return groups._get_expert_data_parallel_rank(group_name) if known else 0


def register_expert_parallel_group(group_name, group, ranks):
    """Hand DeepSpeed our expert-parallel group: groups._EXPERT_PARALLEL_GROUP[_RANKS], which its MoE layers
    and engine look up by name (0.19.8)."""
    from deepspeed.utils import groups
    groups._EXPERT_PARALLEL_GROUP[group_name], groups._EXPERT_PARALLEL_GROUP_RANKS[group_name] = group, ranks


def register_expert_data_parallel_group(group_name, group, ranks):
    """Hand DeepSpeed our expert-data-parallel group: groups._EXPERT_DATA_PARALLEL_GROUP[_RANKS] (0.19.8)."""
    from deepspeed.utils import groups
    groups._EXPERT_DATA_PARALLEL_GROUP[group_name] = group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[group_name] = ranks


def set_expert_tensor_parallel_world_size(size):
    """Set groups.expert_tensor_parallel_world_size, the module global DeepSpeed's MoE and gradient norm read
    for experts sharded over TP (0.19.8)."""
    from deepspeed.utils import groups
    groups.expert_tensor_parallel_world_size = size


def set_model_parallel_unit(mpu):
    """Set groups.mpu, the module global DeepSpeed's MoE token split reads when no engine has set it (0.19.8)."""
    from deepspeed.utils import groups
    groups.mpu = mpu


def model_parallel_unit():
    """groups.mpu: the model parallel unit DeepSpeed's MoE token split uses (0.19.8)."""
    from deepspeed.utils import groups
    return groups.mpu


# --- DeepSpeed-MoE's token split over TP (deepspeed.moe.mappings, sharded_moe) -------------------------

def moe_token_functions():
    """DeepSpeed's own (drop_tokens, gather_tokens) from deepspeed.moe.mappings (0.19.8)."""
    from deepspeed.moe import mappings
    return mappings.drop_tokens, mappings.gather_tokens


def install_moe_token_functions(drop_tokens, gather_tokens):
    """Make DeepSpeed's MoE layer split and gather its token slots over TP with these: they replace the names
    sharded_moe imported from mappings, which its MOELayer.forward calls (0.19.8)."""
    from deepspeed.moe import sharded_moe
    sharded_moe.drop_tokens, sharded_moe.gather_tokens = drop_tokens, gather_tokens


def install_moe_tensor_parallel_gather(gather):
    """Replace mappings._gather_tokens, the TP all-gather under DeepSpeed's gather_tokens forward and
    drop_tokens backward (0.19.8)."""
    from deepspeed.moe import mappings
    mappings._gather_tokens = gather


# --- engines ---------------------------------------------------------------------------------------------

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
    (gradient None; see scale_loss_outside_output_hooks and _scaled_loss), else the stage's floating-point
    outputs, reassembled where DeepSpeed split them over the TP ranks (pipe_partitioned / grad_partitioned), with
    the received gradients (0.19.8); those gradients carry the loss scale already."""
    from deepspeed.runtime.utils import PartitionedTensor
    if engine.is_last_stage():
        return [_scaled_loss(engine, engine.loss / engine.gradient_accumulation_steps())], None
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


def _scaled_loss(engine, loss):
    """The loss as DeepSpeedEngine.backward scales it before its backward, with fp16 at ZeRO 0 mended (see
    mend_zero_stage_0): a ZeRO optimizer's scale_if_loss (fp16's dynamic or static loss scale under
    ZeRO 1 and 2; BF16_Optimizer leaves it), or ZeRO 0's autocast GradScaler (0.19.8)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    if isinstance(engine.optimizer, ZeROOptimizer):
        return engine.optimizer.scale_if_loss(loss)
    if engine.torch_autocast_z0_gradscaler is not None:
        return engine.torch_autocast_z0_gradscaler.scale(loss)
    return _fp16_zero_stage_0_scaled(engine, loss)


def _fp16_zero_stage_0_scaled(engine, loss):
    """The loss times the loss scale that fp16's ZeRO-0 optimizers (FP16_Optimizer, FP16_UnfusedOptimizer) divide
    the gradients by in step(), as their own backward() scales it (0.19.8)."""
    config = getattr(engine.optimizer, "loss_scale_config", None)
    if not engine.fp16_enabled() or engine.zero_optimization() or config is None:
        return loss
    if engine.optimizer.custom_loss_scaler:
        return loss * engine.optimizer.external_loss_scale
    return loss.float() * config.cur_scale if config.use_grad_scaling else loss


def mend_zero_stage_0(engine):
    """Make DeepSpeed 0.19.8's ZeRO-stage-0 engine train as its ZeRO-1 engine does, with tensor and pipeline
    parallelism. Without ZeRO it goes wrong in four places, each mended here:
    - fp16: DeepSpeedEngine.backward scales the loss only for ZeRO optimizers, while fp16's ZeRO-0 optimizers
      divide the gradients by the loss scale in step(): updates loss-scale times too small, clipping never
      triggered, small gradients underflowing (DeepSpeed pull request 8393, open). Mended class-wide, because the
      pipeline engine's last stage calls it through super().
    - fp16 with an optimizer other than FusedAdam (FP16_UnfusedOptimizer): the gradient norm for clipping is taken
      over gradient tensors, which carry neither ds_pipe_replicated (a tied embedding's second copy, counted twice)
      nor tensor_model_parallel (TP ranks > 0 skip every gradient); and the norm it reports keeps the loss scale.
    - fp32: clip_fp32_gradients counts the replicated parameters on model-parallel rank 0 only, which with
      DeepSpeed's pipeline grid is the first stage's TP rank 0 (later stages' norms are left out), and the norm
      it computes is never reported (get_global_grad_norm() is None). Not mended for MoE models, whose expert
      norms DeepSpeed's clip_grad_norm_ averages over the data-parallel group (get_weight_norm sums over the
      model-parallel one only).
    - fp16: both optimizers take an optimizer step with zero gradients when built (initialize_optimizer_states):
      AdamW's step count starts at 1 (its bias correction off by a step ever after) and its weight decay shrinks
      the fp32 master weights by lr x decay, away from the 16-bit ones.
    bf16 needs none of it."""
    if engine.zero_optimization() or engine.bfloat16_enabled():
        return
    if engine.fp16_enabled():
        _scale_fp16_loss_at_zero_stage_0()
        _undo_the_initial_fp16_step(engine.optimizer)
        _mend_unfused_fp16_norm(engine.optimizer)
    elif not engine.has_moe_layers:
        engine.clip_fp32_gradients = lambda: _clip_fp32_gradients(engine)


def _scale_fp16_loss_at_zero_stage_0():
    from deepspeed.runtime.engine import DeepSpeedEngine
    own = DeepSpeedEngine.backward
    if getattr(own, "scales_fp16_at_zero_stage_0", False):
        return

    def backward(self, loss, *args, **kwargs):
        return own(self, _fp16_zero_stage_0_scaled(self, loss), *args, **kwargs)

    backward.scales_fp16_at_zero_stage_0 = True
    DeepSpeedEngine.backward = backward


def _undo_the_initial_fp16_step(optimizer):
    """The wrapped optimizer's state emptied and the fp32 master weights copied back from the 16-bit ones they
    were made from, as they were before initialize_optimizer_states stepped (FP16_Optimizer: flat groups;
    FP16_UnfusedOptimizer: per parameter)."""
    import torch
    optimizer.optimizer.state.clear()
    if hasattr(optimizer, "fp32_groups_flat"):
        pairs = zip(optimizer.fp32_groups_flat, optimizer.fp16_groups_flat)
    else:
        pairs = zip((p for group in optimizer.fp32_groups for p in group),
                    (p for group in optimizer.fp16_groups for p in group))
    with torch.no_grad():
        for master, weight in pairs:
            master.copy_(weight)


def _mend_unfused_fp16_norm(optimizer):
    """FP16_UnfusedOptimizer's norm from gradients that carry their parameters' tags (through the module's
    split_params_grads_into_shared_and_expert_params, which hands them to get_weight_norm); the norm it reports
    without the loss scale of the step that took it."""
    from deepspeed.runtime.fp16 import unfused_optimizer
    if not isinstance(optimizer, unfused_optimizer.FP16_UnfusedOptimizer):
        return
    split = unfused_optimizer.split_params_grads_into_shared_and_expert_params
    if not getattr(split, "tags_gradients", False):
        def tagged_split(group):
            _tagged_gradients(group)
            return split(group)
        tagged_split.tags_gradients = True
        unfused_optimizer.split_params_grads_into_shared_and_expert_params = tagged_split
    step = optimizer.step

    def step_reporting_the_unscaled_norm(*args, **kwargs):
        scale = optimizer.loss_scale_config.cur_scale  # before step() may change it
        overflow = step(*args, **kwargs)
        optimizer._global_grad_norm = optimizer._global_grad_norm / scale
        return overflow

    optimizer.step = step_reporting_the_unscaled_norm


def _tagged_gradients(params):
    """The parameters' gradients, each carrying its parameter's ds_pipe_replicated and tensor_model_parallel,
    which DeepSpeed's get_weight_norm reads off the tensors it is given."""
    gradients = []
    for param in params:
        if param.grad is not None:
            param.grad.ds_pipe_replicated = getattr(param, "ds_pipe_replicated", False)
            param.grad.tensor_model_parallel = getattr(param, "tensor_model_parallel", False)
            gradients.append(param.grad)
    return gradients


def _clip_fp32_gradients(engine):
    """Every gradient clipped by the norm DeepSpeed's get_weight_norm takes over the model-parallel ranks (each
    replicated parameter once: on TP rank 0, a tied embedding on its first stage); the norm kept for
    get_global_grad_norm() (nan where it is not finite)."""
    from deepspeed.runtime.utils import get_weight_norm
    gradients = _tagged_gradients(engine.module.parameters())
    norm = get_weight_norm(gradients, mpu=engine.mpu)
    engine._global_grad_norm = norm if norm >= 0 else float("nan")  # -1: not finite
    coefficient = engine.gradient_clipping() / (norm + 1e-6)
    if 0 <= norm and coefficient < 1:
        for gradient in gradients:
            gradient.mul_(coefficient)


@contextlib.contextmanager
def engine_backward(engine):
    """Within the block a backward counts as the engine's own (_running_engine_backward), as in
    _exec_backward_pass: DeepSpeed's post-backward hook then skips its check for a direct tensor.backward()
    (0.19.8)."""
    engine._running_engine_backward = True
    try:
        yield
    finally:
        engine._running_engine_backward = False


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


def replace_gradient_reduction(engine, reduce):
    """Make reduce(grads=None, elements_per_buffer=None) the engine's buffered_allreduce_fallback, through which
    the plain engine (allreduce_gradients) and the pipeline engine (_bf16_reduce_grads) both reduce
    BF16_Optimizer's gradients (0.19.8)."""
    engine.buffered_allreduce_fallback = reduce


def replace_checkpoint_engine(engine, writer):
    """Make the engine write its checkpoint files through `writer` (a CheckpointEngine): engine.checkpoint_engine,
    which save_checkpoint and load_checkpoint use and no public setter reaches (0.19.8)."""
    engine.checkpoint_engine = writer


class DeferredOptimizerStep:
    """Within `with DeferredOptimizerStep(engine) as step:` the optimizer step DeepSpeed takes at the end of a
    global batch (the pipeline engine's OptimizerStep instruction, DeepSpeedEngine.step() at the accumulation
    boundary; both call engine._take_model_step(lr_kwargs), 0.19.8) is held instead: afterwards step.apply()
    takes it exactly as DeepSpeed would have, or step.discard() drops the global batch's gradients as
    DeepSpeed drops an overflowed step's, leaving the engine as before the batch. Nothing reads the gradients
    between the end of the schedule and the step, so holding it changes no number."""

    def __init__(self, engine):
        self.engine, self.held = engine, None

    def __enter__(self):
        self.engine._take_model_step = self._hold  # an instance attribute shadows the class's method
        return self

    def __exit__(self, *exception):
        del self.engine._take_model_step

    def _hold(self, lr_kwargs):
        self.held = (lr_kwargs,)

    def apply(self):
        engine = self.engine
        boundary = getattr(engine, "_force_grad_boundary", None)
        if boundary is not None:  # the pipeline engine forces the boundary around its step
            engine._force_grad_boundary = True
        try:
            type(engine)._take_model_step(engine, *self.held)
        finally:
            if boundary is not None:
                engine._force_grad_boundary = False
        self.held = None

    def discard(self):
        _discard_gradients(self.engine)
        self.held = None


def held_gradients(engine):
    """The gradients the held step (DeferredOptimizerStep) would apply, as this rank holds them once reduced
    (0.19.8): ZeRO 1/2's partitions (averaged_gradients; None under CPU offload, whose gradients are already in
    host buffers), BF16_Optimizer's fp32 buffers (get_grads_for_reduction), else the module's .grad."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        if optimizer.cpu_offload:
            return None
        return [grad for grads in optimizer.averaged_gradients.values() for grad in grads or () if grad is not None]
    if isinstance(optimizer, BF16_Optimizer):
        dense, experts = optimizer.get_grads_for_reduction()
        return [*dense, *(grad for grads in experts.values() for grad in grads)]
    return [param.grad for param in engine.module.parameters() if param.grad is not None]


def _discard_gradients(engine):
    """What each optimizer does with an overflowed step's gradients (0.19.8): ZeRO 1/2 also drops its reduced
    partitions; BF16_Optimizer's and the fp16 optimizers' zero_grad clear their 16-bit and fp32 gradients."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        optimizer.zero_grad(set_to_none=True)
        optimizer._release_preflattened_grad_buffers()
        if optimizer.cpu_offload:
            optimizer.reset_cpu_buffers()
        else:
            for key in optimizer.averaged_gradients.keys():
                optimizer.averaged_gradients[key] = None
                optimizer.all_grad_tensors[key] = None
    elif engine.bfloat16_enabled() or engine.fp16_enabled():
        optimizer.zero_grad()
    else:
        engine.zero_grad()


def shared_memory_all_reduce_level():
    """The vector kernel level of deepspeed.comm's shared-memory all-reduce op (0: none, 1: fp32, 2: also bf16 and
    fp16), read off comm.cdb, the current backend, and its shm_comm_op, shm_vector_kernel_level (0.19.8)."""
    import deepspeed.comm
    backend = deepspeed.comm.comm.cdb
    return 0 if backend.shm_comm_op is None else backend.shm_vector_kernel_level


def unlink_shared_memory_segment():
    """Remove this rank's file of deepspeed.comm's shared-memory all-reduce from /dev/shm. DeepSpeed never removes
    it (0.19.8: shm.cpp names it deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, 69 MB, and
    has no shm_unlink outside an error path): every launch left 69 MB per rank in RAM-backed /dev/shm until the
    host ran out of memory. Call it once every rank has mapped every other's segment (a barrier after
    init_distributed): the mappings outlive the name."""
    import deepspeed.comm
    if deepspeed.comm.comm.cdb.shm_comm_op is None:
        return
    name = "_".join(["deepspeed_allreduce_buffer", str(os.getuid()), os.environ.get("MASTER_ADDR", ""),
                     os.environ.get("MASTER_PORT", ""), str(deepspeed.comm.get_rank())])
    Path("/dev/shm", name).unlink(missing_ok=True)


def skip_shared_memory_comm_build():
    """Mark the shared-memory comm op incompatible in deepspeed.ops.__compatible_ops__, so that
    init_distributed does not JIT-build it (0.19.8)."""
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def remember_layer_partitions(partitions):
    """PipelineModule's balanced partition of the layers (deepspeed.runtime.utils.partition_balanced, a pure-Python
    dynamic program: a second at 130 layers over 64 stages, the same answer on every rank) served from and added
    to `partitions`, {(layer weights, stages): boundaries} (0.19.8: module.py calls it as ds_utils'
    attribute)."""
    from deepspeed.runtime import utils as ds_utils
    balanced = getattr(ds_utils.partition_balanced, "__wrapped__", ds_utils.partition_balanced)

    def partition_balanced(weights, num_parts):
        key = (tuple(weights), num_parts)
        if key not in partitions:
            partitions[key] = [int(part) for part in balanced(weights, num_parts)]
        return list(partitions[key])

    partition_balanced.__wrapped__ = balanced
    ds_utils.partition_balanced = partition_balanced


def checkpoint_saved_inputs(node):
    """The tensors DeepSpeed's activation checkpointing keeps for backward in autograd node `node` (its
    ctx.deepspeed_saved_tensors; a partitioned input keeps only its saved_data) (0.19.8); [] for other nodes."""
    import torch
    kept = []
    for tensor in getattr(node, "deepspeed_saved_tensors", None) or ():
        if torch.is_tensor(tensor):
            kept.append(tensor.saved_data if getattr(tensor, "saved_data", None) is not None else tensor)
    return kept


# --- optimizers: ZeRO-1/2 (DeepSpeedZeroOptimizer), BF16_Optimizer, FP16_Optimizer ------------------------

def fp32_partition_groups(optimizer):
    """[(16-bit parameters, fp32 flat partition)] per group of DeepSpeedZeroOptimizer (bit16_groups,
    single_partition_of_fp32_groups) or BF16_Optimizer (bf16_groups, fp32_groups_flat_partition), else None
    (0.19.8)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        return list(zip(optimizer.bit16_groups, optimizer.single_partition_of_fp32_groups))
    if isinstance(optimizer, BF16_Optimizer):
        return list(zip(optimizer.bf16_groups, optimizer.fp32_groups_flat_partition))
    return None


def bit16_parameter_groups(optimizer):
    """The 16-bit parameter groups of ZeRO's (bit16_groups), BF16_Optimizer's (bf16_groups) or FP16_Optimizer's
    (fp16_groups) optimizer, in the order DeepSpeed flattens them; None for another optimizer (0.19.8)."""
    for attribute in ("bit16_groups", "bf16_groups", "fp16_groups"):
        if hasattr(optimizer, attribute):
            return getattr(optimizer, attribute)
    return None


def hp_mapping(param):
    """param._hp_mapping: where this rank's fp32 partition holds the parameter's fragment (param_group_index,
    lp_fragment_address, hp_fragment_address), None when it holds none of it (0.19.8)."""
    return getattr(param, "_hp_mapping", None)


def relink_optimizer_states(optimizer):
    """Make the ZeRO-1/2 or BF16 optimizer link the parameters' fragments to the (new) Adam moments at its next
    step, by clearing its _hp_optimizer_states_linked (0.19.8)."""
    optimizer._hp_optimizer_states_linked = False


def dense_bf16_flat_gradients(optimizer):
    """BF16_Optimizer's flat fp32 gradient buffers (non_expert_gradients), or None when `optimizer` is not one or
    has MoE layers (has_moe_layers) (0.19.8). Read it when reducing: the list object is the optimizer's."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    if not isinstance(optimizer, BF16_Optimizer) or optimizer.has_moe_layers:
        return None
    return optimizer.non_expert_gradients


def zero_bf16_fp32_gradients_once(optimizer):
    """BF16_Optimizer.step() ends by zeroing its flat fp32 gradients (clear_hp_grads), and the engine's
    _take_model_step calls its zero_grad() right after, which zeroes them again (0.19.8): one more pass over 4 bytes
    per parameter each step, 1-2% of a 32M-parameter model's step on a CPU. Wrapped on this optimizer: zero_grad()
    leaves the fp32 gradients alone while nothing has been added to them since step() zeroed them (every addition
    goes through _update_hp_grad, also under immediate_grad_update). Returns whether it wrapped."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    if not isinstance(optimizer, BF16_Optimizer):
        return False
    step, add_gradient, zero_grad = optimizer.step, optimizer._update_hp_grad, optimizer.zero_grad
    zeroed = [False]  # the fp32 gradients are zero since the last step()

    def step_then_note(*args, **kwargs):
        zeroed[0] = False
        result = step(*args, **kwargs)
        zeroed[0] = True
        return result

    def note_then_add(*args, **kwargs):
        zeroed[0] = False
        return add_gradient(*args, **kwargs)

    def zero_grad_once(set_to_none=True):
        if zeroed[0]:
            optimizer.clear_lp_grads(set_to_none)
        else:
            zero_grad(set_to_none)

    optimizer.step, optimizer._update_hp_grad, optimizer.zero_grad = step_then_note, note_then_add, zero_grad_once
    return True


def host_global_grad_norm(engine):
    """The last step's global gradient norm as a Python float (None: not computed), copied from the device once and
    kept by the engine in place of the tensor (its _global_grad_norm, which get_global_grad_norm() returns and types
    Optional[float]), so that the log line and any later reader of the same step share this one host sync."""
    norm = engine.get_global_grad_norm()
    if hasattr(norm, "item"):
        norm = engine._global_grad_norm = norm.item()
    return norm


def loss_scale(optimizer):
    """The fp16 optimizer's current loss scale: cur_scale (FP16_Optimizer, ZeRO) or loss_scale, else 1 (0.19.8)."""
    return float(getattr(optimizer, "cur_scale", getattr(optimizer, "loss_scale", 1.0)))


def has_loss_scaler(optimizer):
    """Whether the optimizer scales the loss with a loss_scaler (fp16's) (0.19.8)."""
    return hasattr(optimizer, "loss_scaler")


def set_loss_scaler_state(optimizer, values):
    """Set the optimizer's loss-scaler attributes ({"loss_scaler": ..., "dynamic_loss_scale": ...}) as DeepSpeed's
    own load_state_dict does (0.19.8)."""
    for attribute, value in values.items():
        setattr(optimizer, attribute, value)


@contextlib.contextmanager
def parameters_named(optimizer, names):
    """Within the block the optimizer's param_names ({param: name}, by which DeepSpeed's universal-checkpoint
    load finds each parameter's folder) say names[param] (0.19.8)."""
    original = optimizer.param_names
    optimizer.param_names = {param: names[param] for param in original}
    try:
        yield
    finally:
        optimizer.param_names = original
