"""DeepSpeed's optimizers (ZeRO-1/2's DeepSpeedZeroOptimizer, BF16_Optimizer, FP16_Optimizer) read and set
through their fields: partitions, groups, hp mappings, the global gradient norm, the loss scaler.
"""
import contextlib


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
