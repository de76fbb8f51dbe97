"""DeepSpeed's MoE at TP > 1: the split of the dispatched tokens over the TP ranks, mended in two places.

With tensor parallelism each TP rank sends its share of each expert's token slots (the capacity) to the experts,
and DeepSpeed's MoE gathers the shares back afterwards (deepspeed.moe.mappings.drop_tokens / gather_tokens):

- on gloo, its gather (all_gather_into_tensor into a flat buffer) is refused ("invalid tensor size"); the same
  gather is done here with all_gather into one tensor per rank: same values, same order. NCCL keeps DeepSpeed's;
- the split needs the capacity to be a multiple of TP. DeepSpeed's gate rounds it so without token dropping,
  except with expert tensor parallelism, where the split then fails. Here a split pads the slots with empty ones
  up to a multiple of TP and the gather that follows it in the layer removes them: empty slots hold no token
  and are combined into no output, so nothing else changes (and nothing at all when the capacity divides).
"""
import torch
import torch.distributed as dist
from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_world_size

from megatron_ds.core import deepspeed_internals

_deepspeed_drop_tokens, _deepspeed_gather_tokens = deepspeed_internals.moe_token_functions()
_slots_before_padding = []  # per split not yet gathered: the slots it had before padding (None: not padded)


def _gather_tokens_over_gloo(input_, dim=0):
    """The tensors of the TP ranks concatenated along dim, in rank order."""
    mpu = deepspeed_internals.model_parallel_unit()
    input_ = input_.contiguous()
    world_size = bwc_tensor_model_parallel_world_size(mpu)
    if world_size == 1:
        return input_
    pieces = [torch.empty_like(input_) for _ in range(world_size)]
    dist.all_gather(pieces, input_, group=bwc_tensor_model_parallel_group(mpu))
    return torch.cat(pieces, dim=dim).contiguous()


def _drop_tokens_padded(input_, dim=0):
    """DeepSpeed's split of the token slots over TP, after padding them to a multiple of TP."""
    tp = bwc_tensor_model_parallel_world_size(deepspeed_internals.model_parallel_unit())
    slots = input_.size(dim)
    if tp > 1 and slots % tp:
        padding = list(input_.shape)
        padding[dim] = tp - slots % tp
        _slots_before_padding.append(slots)
        input_ = torch.cat([input_, input_.new_zeros(padding)], dim=dim)
    else:
        _slots_before_padding.append(None)
    return _deepspeed_drop_tokens(input_, dim)


def _gather_tokens_unpadded(input_, dim=0):
    """DeepSpeed's gather of the token slots over TP, without the slots the split before it added."""
    output = _deepspeed_gather_tokens(input_, dim)
    slots = _slots_before_padding.pop() if _slots_before_padding else None
    return output if slots is None else output.narrow(dim, 0, slots).contiguous()


def mend_token_split():
    """Install the padded split (every backend) and, when the default process group runs gloo, the gloo gather."""
    deepspeed_internals.install_moe_token_functions(_drop_tokens_padded, _gather_tokens_unpadded)
    if dist.get_backend() == "gloo":
        deepspeed_internals.install_moe_tensor_parallel_gather(_gather_tokens_over_gloo)
