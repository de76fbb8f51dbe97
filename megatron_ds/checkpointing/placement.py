"""Placing a rank's loaded state into DeepSpeed's engine: the weights, the fp32 master weights and Adam moments
(into ZeRO-1/2's or BF16_Optimizer's flat partitions, or a plain torch optimizer), fresh moments, and fp16's loss
scale. The state comes by canonical name (state.py's RankState); the manager decides what to load (load_plan.py)."""
import torch

from megatron_ds.checkpointing import layout
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.state import read_loss_scaler
from megatron_ds.core import deepspeed_internals


def place_rank_state(engine, state, num_layers, pipelined, load_optimizer):
    """Copy this rank's weights and persistent buffers (and fp32 master weights and Adam moments) into the
    engine. Returns how many FP8 amax histories of this rank's linears the checkpoint lacked (they start fresh)."""
    names = {}
    problems = []
    fresh_histories = 0
    with torch.no_grad():
        for name, param in layout.live_parameter_names(engine.module, num_layers, pipelined):
            names[id(param)] = name
            tensor = state.weights.get(name)
            if tensor is None:
                problems.append(f"{name} is missing")
            elif tuple(tensor.shape) != tuple(param.shape):
                problems.append(f"{name} has shape {tuple(tensor.shape)}, the model {tuple(param.shape)}")
            else:
                param.copy_(tensor.to(param.dtype))
        for name, buffer in layout.live_buffer_names(engine.module, num_layers, pipelined):
            saved = state.weights.get(name)
            if saved is None and layout.is_fp8_scaling_state(name):
                fresh_histories += layout.is_fp8_amax_history(name)  # saved without FP8 delayed scaling
                continue
            if saved is None:
                problems.append(f"{name} is missing")
                continue
            saved = _fitted_history(name, saved, buffer)
            if tuple(saved.shape) != tuple(buffer.shape):
                problems.append(f"{name} has shape {tuple(saved.shape)}, the model {tuple(buffer.shape)}")
            else:
                buffer.copy_(saved.to(buffer.dtype))
    if problems:
        raise CheckpointError("the checkpoint does not fit this rank's model:\n  - " + "\n  - ".join(problems))
    optimizer = engine.optimizer
    if load_optimizer:
        place_optimizer_state(optimizer, names, state)
    elif hasattr(optimizer, "refresh_fp32_params"):
        optimizer.refresh_fp32_params()  # fp32 master weights from the loaded weights
    return fresh_histories


def _fitted_history(name, saved, buffer):
    """An FP8 amax history saved at another --fp8-amax-history-len: its newest rows, zeros where it has fewer."""
    if not layout.is_fp8_amax_history(name) or saved.shape == buffer.shape:
        return saved
    rows = min(saved.shape[0], buffer.shape[0])
    fitted = torch.zeros_like(buffer)
    fitted[:rows] = saved[:rows]
    return fitted


def restore_loss_scale(optimizer, path, metadata):
    """fp16 to fp16: the dynamic loss scale goes on where it was (DeepSpeed's own load does the same), instead of
    restarting at --initial-loss-scale and skipping steps to come down again."""
    if deepspeed_internals.has_loss_scaler(optimizer):
        deepspeed_internals.set_loss_scaler_state(optimizer, read_loss_scaler(path, metadata))


def reset_adam_states(optimizer):
    """Fresh Adam moments and step (as --no-load-optim means) in DeepSpeed's ZeRO-1/2 or BF16 optimizer."""
    for _, flat in deepspeed_internals.fp32_partition_groups(optimizer):
        optimizer.optimizer.state[flat] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat),
                                           "exp_avg_sq": torch.zeros_like(flat)}
    deepspeed_internals.relink_optimizer_states(optimizer)


def place_optimizer_state(optimizer, names, state):
    """Put fp32 master weights and Adam moments (full per-parameter tensors of this TP/PP rank) into
    DeepSpeed's ZeRO-1/2 or BF16 optimizer (this DP rank's flat partitions), or a plain torch optimizer."""
    step = torch.tensor(float(state.optimizer_step or 0))
    zero_groups = deepspeed_internals.fp32_partition_groups(optimizer)
    if zero_groups is not None:
        for params, flat in zero_groups:
            moments = {"exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
            targets = {"fp32": flat.data, **moments}
            for param in params:
                mapping = deepspeed_internals.hp_mapping(param)
                if mapping is None:  # no part of this parameter lives in this data-parallel rank's partition
                    continue
                lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
                values = state.optimizer[names[id(param)]]
                for key, target in targets.items():
                    source = values[key].reshape(-1).narrow(0, lp.start, lp.numel)
                    target.narrow(0, hp.start, hp.numel).copy_(source)
            optimizer.optimizer.state[flat] = {"step": step.clone(), **moments}
        deepspeed_internals.relink_optimizer_states(optimizer)
        return
    if type(optimizer).__module__.startswith("torch.optim"):
        for group in optimizer.param_groups:
            for param in group["params"]:
                values = state.optimizer[names[id(param)]]
                optimizer.state[param] = {"step": step.clone(),
                                          "exp_avg": values["exp_avg"].to(param.device, param.dtype).clone(),
                                          "exp_avg_sq": values["exp_avg_sq"].to(param.device, param.dtype).clone()}
        return
    raise CheckpointError(f"cannot place optimizer states into DeepSpeed's {type(optimizer).__name__}; "
                          f"load with --no-load-optim (weights only, fresh Adam moments)")
