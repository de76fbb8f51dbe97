"""Shared by the transformer-layer tests: the two model families' TransformerConfig options, a TP-sharded
parameter gathered back to its full shape, and a layer's output and gradients on a TP rank gathered whole."""
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


def layer_results_on_this_rank(layer, hidden, output_grad, sequence_parallel, replicated):
    """Forward and backward of `layer` on this TP rank's share of hidden [s, b, h] (its slice of the sequence with
    SP): the output, the input's gradient and every parameter's gradient, each gathered whole; and for each
    parameter `replicated(name)` selects, whether its gradient is equal on every TP rank (key
    'on every rank:<name>')."""
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    split = (lambda t: t.chunk(tp)[rank].clone()) if sequence_parallel else (lambda t: t)  # noqa: E731
    hidden = split(hidden).requires_grad_()
    output = layer(hidden)
    output.backward(split(output_grad))
    results = {"output": _gather_sequence(output.detach(), sequence_parallel),
               "input_grad": _gather_sequence(hidden.grad, sequence_parallel)}
    for name, param in layer.named_parameters():
        results[name] = gather_param(param.grad, param)
        if replicated(name, param):
            copies = [torch.empty_like(param.grad) for _ in range(tp)]
            dist.all_gather(copies, param.grad, group=parallel_state.get_tensor_model_parallel_group())
            results[f"on every rank:{name}"] = all(torch.equal(copy, copies[0]) for copy in copies)
    return results


def _gather_sequence(tensor, sequence_parallel):
    if not sequence_parallel:
        return tensor
    pieces = [torch.empty_like(tensor) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    dist.all_gather(pieces, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(pieces)
