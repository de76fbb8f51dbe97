"""Data-parallel gradient reduction for DeepSpeed's BF16_Optimizer (bf16 parameters, fp32 gradients, ZeRO-1).

The optimizer accumulates gradients in one flat fp32 buffer per parameter group. DeepSpeed 0.19's
reduction (`buffered_allreduce_fallback`) concatenates those already-flat buffers into a new tensor,
casts it, all-reduces it, and copies the result back piece by piece: three full passes over the
gradients per step, made even when the data-parallel group has a single rank. Here each buffer is
all-reduced in place (through a cast copy only when the communication dtype differs). The arithmetic is
DeepSpeed's: sum, then multiply by 1/DP, in `communication_data_type` (bf16 unless the config says
otherwise). With one data-parallel rank nothing is done, where DeepSpeed would round the fp32
gradients to bf16 and back.
"""
import torch.distributed as dist

from megatron_ds.core import deepspeed_internals


def install_flat_gradient_reduction(engine, data_parallel_group):
    """Replace the engine's gradient reduction (plain and pipeline engine alike: the one DeepSpeed method both
    reduce through) when its optimizer is BF16_Optimizer without MoE layers; returns whether it did."""
    buffers = deepspeed_internals.dense_bf16_flat_gradients(engine.optimizer)
    if buffers is None or not _averages_after_sum(engine):
        return False

    def reduce_flat_buffers(grads=None, elements_per_buffer=None):
        if grads is not None:
            raise ValueError("flat gradient reduction reduces the optimizer's own buffers; got explicit grads")
        all_reduce_mean(buffers, data_parallel_group, engine.communication_data_type)

    deepspeed_internals.replace_gradient_reduction(engine, reduce_flat_buffers)
    return True


def _averages_after_sum(engine):
    """The config asks for DeepSpeed's default arithmetic (no prescale_gradients, no predivide factor)."""
    return engine.gradient_average and engine.postscale_gradients() and engine.gradient_predivide_factor() == 1.0


def all_reduce_mean(buffers, group, communication_dtype):
    """Average each tensor over `group` in place, communicating in `communication_dtype`."""
    world_size = dist.get_world_size(group=group)
    if world_size == 1:
        return
    for buffer in buffers:
        message = buffer if buffer.dtype == communication_dtype else buffer.to(communication_dtype)
        dist.all_reduce(message, group=group)
        message.mul_(1.0 / world_size)  # DeepSpeed's exact arithmetic
        if message is not buffer:
            buffer.copy_(message)
