"""Shared by the transformer-layer tests: the two model families' TransformerConfig options, and a TP-sharded
parameter gathered back to its full shape."""
import torch
import torch.distributed as dist

from megatron_ds.core import parallel_state

FAMILIES = {
    "gpt2": dict(),
    "llama": dict(normalization="RMSNorm", gated_linear_unit=True, bias=False, position_embedding_type="rope",
                  num_query_groups=2, ffn_hidden_size=24),
}


def gather_param(tensor, param):
    """The full tensor of a parameter (or its gradient) whose shards live on the TP ranks."""
    if not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    world = parallel_state.get_tensor_model_parallel_world_size()
    shards = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    dim, stride = param.partition_dim, param.partition_stride
    blocks = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([torch.cat([pieces[b] for pieces in blocks], dim=dim) for b in range(stride)], dim=dim)
