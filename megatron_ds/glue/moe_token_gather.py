"""DeepSpeed's MoE at TP > 1 on gloo.

With tensor parallelism each TP rank sends its share of the dispatched tokens to the experts, and DeepSpeed's
MoE gathers the shares back (deepspeed.moe.mappings._gather_tokens) with all_gather_into_tensor into a flat
buffer, which gloo refuses ("invalid tensor size"). On gloo the same gather is done with all_gather into one
tensor per rank: same values, same order. NCCL keeps DeepSpeed's.
"""
import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe import mappings
from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_world_size


def _gather_tokens_over_gloo(input_, dim=0):
    """The tensors of the TP ranks concatenated along dim, in rank order."""
    mpu = deepspeed.utils.groups.mpu
    input_ = input_.contiguous()
    world_size = bwc_tensor_model_parallel_world_size(mpu)
    if world_size == 1:
        return input_
    pieces = [torch.empty_like(input_) for _ in range(world_size)]
    dist.all_gather(pieces, input_, group=bwc_tensor_model_parallel_group(mpu))
    return torch.cat(pieces, dim=dim).contiguous()


def use_gloo_token_gather():
    """Install the gloo gather when the default process group runs gloo."""
    if dist.get_backend() == "gloo":
        mappings._gather_tokens = _gather_tokens_over_gloo
