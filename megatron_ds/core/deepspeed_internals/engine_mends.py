"""DeepSpeed's engines mended where they are wrong or in the way: fp16 at ZeRO stage 0, unfused fp16 norms, fp32
gradient clipping, the backward flag, gradient reduction and checkpoint writer replaced, a deferred optimizer step.
"""
import contextlib


def scaled_loss(engine, loss):
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
