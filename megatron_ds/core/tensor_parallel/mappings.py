"""Conjugate communication operators between the replicated and tensor-parallel regions.

Each pair is a private autograd Function behind a snake_case wrapper. Every collective is skipped
when the tensor-parallel group has a single rank. "Last dim" operators split hidden features (TP);
"first dim" operators split the sequence (sequence parallelism, [s, b, h] tensors). The TP all-reduce
can be replaced (`use_tensor_parallel_all_reduce`: the glue installs DeepSpeed's shared-memory one where
it applies).
"""
import torch
import torch.distributed as dist

from megatron_ds.core.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


def _process_group_all_reduce(tensor):
    dist.all_reduce(tensor, group=get_tensor_model_parallel_group())


_ALL_REDUCE = {"tensor_parallel": _process_group_all_reduce}


def use_tensor_parallel_all_reduce(all_reduce=None):
    """Sum in place over the TP group with all_reduce(tensor) from now on; None restores the process group's."""
    _ALL_REDUCE["tensor_parallel"] = all_reduce or _process_group_all_reduce


def _reduce(tensor):
    if get_tensor_model_parallel_world_size() == 1:
        return tensor
    tensor = tensor.contiguous()
    _ALL_REDUCE["tensor_parallel"](tensor)
    return tensor


def _split_along(tensor, dim):
    world = get_tensor_model_parallel_world_size()
    if world == 1:
        return tensor
    if tensor.size(dim) % world:
        raise ValueError(f"cannot split dimension {dim} of size {tensor.size(dim)} across {world} "
                         f"tensor-parallel ranks")
    return tensor.chunk(world, dim=dim)[get_tensor_model_parallel_rank()].contiguous()


def gather_along_tensor_parallel(tensor, dim):
    """The TP ranks' tensors (equal shapes) concatenated along dim, in rank order (no autograd)."""
    world = get_tensor_model_parallel_world_size()
    if world == 1:
        return tensor
    tensor = tensor.contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(pieces, tensor, group=get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=dim)


def _reduce_scatter_first_dim(tensor):
    world = get_tensor_model_parallel_world_size()
    if world == 1:
        return tensor
    if tensor.size(0) % world:
        raise ValueError(f"cannot reduce-scatter a first dimension of {tensor.size(0)} across {world} ranks")
    group = get_tensor_model_parallel_group()
    if dist.get_backend(group) == "gloo":  # gloo has no reduce_scatter: all-reduce, keep our chunk
        return _split_along(_reduce(tensor.clone()), 0)
    inputs = [piece.contiguous() for piece in tensor.chunk(world, dim=0)]
    output = torch.empty_like(inputs[0])
    dist.reduce_scatter(output, inputs, group=group)
    return output


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_along(input_, -1)

    @staticmethod
    def backward(ctx, grad_output):
        return gather_along_tensor_parallel(grad_output, -1)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return gather_along_tensor_parallel(input_, -1)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along(grad_output, -1)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_along(input_, 0)

    @staticmethod
    def backward(ctx, grad_output):
        return gather_along_tensor_parallel(grad_output, 0)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, to_model_parallel):
        ctx.to_model_parallel = to_model_parallel
        return gather_along_tensor_parallel(input_, 0)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.to_model_parallel:
            return _reduce_scatter_first_dim(grad_output), None
        return _split_along(grad_output, 0), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce_scatter_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return gather_along_tensor_parallel(grad_output, 0)


def copy_to_tensor_model_parallel_region(input_):
    """Forward: identity. Backward: all-reduce the gradient over the TP group."""
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_tensor_model_parallel_region(input_):
    """Forward: all-reduce over the TP group. Backward: identity."""
    return _ReduceFromModelParallelRegion.apply(input_)


def scatter_to_tensor_model_parallel_region(input_):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""
    return _ScatterToModelParallelRegion.apply(input_)


def gather_from_tensor_model_parallel_region(input_):
    """Forward: all-gather the last dim. Backward: keep this rank's chunk of the last dim."""
    return _GatherFromModelParallelRegion.apply(input_)


def scatter_to_sequence_parallel_region(input_):
    """Forward: keep this rank's chunk of the first (sequence) dim. Backward: all-gather it."""
    return _ScatterToSequenceParallelRegion.apply(input_)


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True):
    """Forward: all-gather the first dim. Backward: reduce-scatter it (or split, when the consumer is
    replicated rather than tensor-parallel)."""
    return _GatherFromSequenceParallelRegion.apply(input_, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_):
    """Forward: reduce-scatter the first dim over the TP group. Backward: all-gather it."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_)
