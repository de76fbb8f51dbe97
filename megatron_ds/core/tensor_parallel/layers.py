"""Tensor-parallel layers: column/row-parallel linears and the vocab-parallel embedding.

Linear layers return `(output, bias)`: with `skip_bias_add=True` the bias is returned unadded so the
caller can fuse it into the next elementwise op; otherwise the second item is None.
Sharded parameters carry `tensor_model_parallel`, `partition_dim` and `partition_stride` (DeepSpeed's
grad-norm and our deterministic initialization read them).
"""
import torch
import torch.nn.functional as F

from megatron_ds.core.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from megatron_ds.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                       gather_from_tensor_model_parallel_region,
                                                       reduce_from_tensor_model_parallel_region,
                                                       scatter_to_tensor_model_parallel_region)
from megatron_ds.core.tensor_parallel.random import set_init_method


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by {denominator}")
    return numerator // denominator


def _sharded_parameter(shape, dtype, partition_dim, stride=1, init_method=None, fill=None):
    param = torch.nn.Parameter(torch.empty(shape, dtype=dtype))
    if fill is not None:
        with torch.no_grad():
            param.fill_(fill)
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride
    if init_method is not None:
        set_init_method(param, init_method)
    return param


def _replicated_bias(size, dtype):
    return torch.nn.Parameter(torch.zeros(size, dtype=dtype))


class ColumnParallelLinear(torch.nn.Module):
    """Y = XA + b with A split by columns (output features) across TP ranks.

    gather_output: all-gather Y so every rank holds the full output; otherwise each rank keeps its
    columns (the input of a RowParallelLinear). stride > 1 interleaves several logical matrices
    (e.g. SwiGLU's gate and up projections) so each rank gets its part of each.
    """

    def __init__(self, input_size, output_size, *, config, init_method, bias=True, gather_output=False,
                 stride=1, skip_bias_add=False):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        divide(output_size, tp * stride, f"ColumnParallelLinear output size (stride {stride} x TP)")
        self.output_size_per_partition = output_size // tp
        self.gather_output = gather_output
        self.stride = stride
        self.skip_bias_add = skip_bias_add
        self.weight = _sharded_parameter((self.output_size_per_partition, input_size), config.params_dtype,
                                         partition_dim=0, stride=stride, init_method=init_method)
        self.bias = (_sharded_parameter((self.output_size_per_partition,), config.params_dtype, partition_dim=0,
                                        stride=stride, fill=0.0) if bias else None)

    def forward(self, input_):
        parallel_input = copy_to_tensor_model_parallel_region(input_)
        added_bias = None if self.skip_bias_add else self.bias
        output = F.linear(parallel_input, self.weight, added_bias)
        if self.gather_output:
            output = self._full_column_order(gather_from_tensor_model_parallel_region(output))
        return output, (self.bias if self.skip_bias_add else None)


    def _full_column_order(self, gathered):
        """The gather yields [rank][stride block][columns]; the full layer's order is [block][rank][columns]."""
        if self.stride == 1:
            return gathered
        *lead, size = gathered.shape
        tp = get_tensor_model_parallel_world_size()
        blocks = gathered.view(*lead, tp, self.stride, size // (tp * self.stride))
        return blocks.transpose(-3, -2).reshape(*lead, size)


class RowParallelLinear(torch.nn.Module):
    """Y = XA + b with A split by rows (input features) across TP ranks; the partial products are
    all-reduced, then the (replicated) bias is added.

    input_is_parallel: the input is already split along its last dim (output of a ColumnParallelLinear).
    """

    def __init__(self, input_size, output_size, *, config, init_method, bias=True, input_is_parallel=False,
                 skip_bias_add=False):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.input_size_per_partition = divide(input_size, tp, "RowParallelLinear input size")
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.weight = _sharded_parameter((output_size, self.input_size_per_partition), config.params_dtype,
                                         partition_dim=1, init_method=init_method)
        self.bias = _replicated_bias(output_size, config.params_dtype) if bias else None

    def forward(self, input_):
        parallel_input = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_)
        output = reduce_from_tensor_model_parallel_region(F.linear(parallel_input, self.weight))
        if self.bias is None or self.skip_bias_add:
            return output, self.bias
        return output + self.bias, None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding with the vocabulary split across TP ranks; each rank looks up the ids it owns and the
    partial results are all-reduced. num_embeddings must already be padded to a multiple of TP."""

    def __init__(self, num_embeddings, embedding_dim, *, config, init_method):
        super().__init__()
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        per_partition = divide(num_embeddings, tp, "padded vocabulary size")
        self.vocab_start_index = rank * per_partition
        self.vocab_end_index = self.vocab_start_index + per_partition
        self.weight = _sharded_parameter((per_partition, embedding_dim), config.params_dtype, partition_dim=0,
                                         init_method=init_method)

    def forward(self, input_ids):
        if get_tensor_model_parallel_world_size() == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(partial)
