"""Tensor-parallel layers: column/row-parallel linears and the vocab-parallel embedding.

Linear layers return `(output, bias)`: with `skip_bias_add=True` the bias is returned unadded so the
caller can fuse it into the next elementwise op; otherwise the second item is None.
Sharded parameters carry `tensor_model_parallel`, `partition_dim` and `partition_stride` (DeepSpeed's
grad-norm and our deterministic initialization read them).

FP8: a linear whose config has an `fp8_format` runs its GEMMs through core/tensor_parallel/fp8.py (its
`fp8_recipe`; `keep_out_of_fp8` sets it back to None for the output layer and the layers kept in bf16). Its
amaxes are reduced over the TP group across the split dimension, so TP t quantises to the bytes TP 1 would:
column-parallel splits the outputs, and takes whole tokens (gathered along the sequence under sequence
parallelism, where the bf16 path gathers them inside its GEMM); row-parallel splits the contraction. Under delayed
scaling the recipe is a child module holding the layer's amax history (fp8_delayed.py), reduced once per step.
"""
import torch
import torch.nn.functional as F

from megatron_ds.core.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron_ds.core.tensor_parallel.fp8 import Fp8Recipe
from megatron_ds.core.tensor_parallel.fp8_delayed import DelayedScaling
from megatron_ds.core.tensor_parallel.mappings import (
    _reduce,
    _reduce_scatter_first_dim,
    copy_to_tensor_model_parallel_region,
    gather_along_tensor_parallel,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_ds.core.tensor_parallel.random import set_init_method


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by {denominator}")
    return numerator // denominator


def _sharded_parameter(shape, dtype, partition_dim, stride=1, init_method=None, fill=None, sharded=True):
    param = torch.nn.Parameter(torch.empty(shape, dtype=dtype))
    if fill is not None:
        with torch.no_grad():
            param.fill_(fill)
    param.tensor_model_parallel = sharded
    param.partition_dim = partition_dim
    param.partition_stride = stride
    if init_method is not None:
        set_init_method(param, init_method)
    return param


def _replicated_bias(size, dtype, sequence_parallel=False):
    bias = torch.nn.Parameter(torch.zeros(size, dtype=dtype))
    if sequence_parallel:
        mark_sequence_parallel_parameter(bias)
    return bias


def mark_sequence_parallel_parameter(param):
    """A parameter replicated across TP but applied to this rank's sequence chunk only (norm weights,
    row-parallel biases under sequence parallelism): its gradient is summed over the TP group as it
    is produced, before DeepSpeed accumulates it, so it stays identical on every TP rank."""
    param.sequence_parallel = True
    param.register_hook(_reduce)


def fp8_recipe_of(config, split=None):
    """The FP8 recipe of a linear built from `config` (None: no fp8_format, its GEMMs stay in high precision);
    split: the dimension ("outputs", "inputs" or "tokens") the TP group splits, whose amaxes it reduces. Delayed
    scaling is a module of its own state (its amaxes are reduced once per step, over the whole stage)."""
    if getattr(config, "fp8_format", None) is None:
        return None
    if config.fp8_recipe == DelayedScaling.recipe:
        return DelayedScaling(config.fp8_format, config.fp8_margin, config.fp8_amax_history_len,
                              config.fp8_amax_compute_algo)
    if split is None or get_tensor_model_parallel_world_size() == 1:
        return Fp8Recipe(config.fp8_recipe, config.fp8_format, config.fp8_margin)
    return Fp8Recipe(config.fp8_recipe, config.fp8_format, config.fp8_margin, get_tensor_model_parallel_group(), split)


def keep_out_of_fp8(module):
    """Every GEMM under `module` back to high precision (the output layer, --first-last-layers-bf16's layers)."""
    for submodule in module.modules():
        if hasattr(submodule, "fp8_recipe"):
            submodule.fp8_recipe = None


def _local_linear(input_, weight, bias, fp8_recipe):
    if fp8_recipe is None:
        return F.linear(input_, weight, bias)
    output = fp8_recipe.linear(input_, weight)
    return output if bias is None else output + bias


class _LinearWithSequenceGather(torch.autograd.Function):
    """Y = all_gather_seq(X) A^T + b, saving only this rank's sequence chunk of X: backward gathers it
    again (what keeps the activation memory of TP + SP at 34 s b h / t per layer)."""

    @staticmethod
    def forward(ctx, input_shard, weight, bias):
        ctx.save_for_backward(input_shard, weight)
        ctx.has_bias = bias is not None
        return F.linear(gather_along_tensor_parallel(input_shard, 0), weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_shard, weight = ctx.saved_tensors
        total_input = gather_along_tensor_parallel(input_shard, 0)
        grad_input = _reduce_scatter_first_dim(grad_output.matmul(weight))
        grad_weight = grad_output.reshape(-1, grad_output.size(-1)).t().matmul(
            total_input.reshape(-1, total_input.size(-1)))
        grad_bias = grad_output.reshape(-1, grad_output.size(-1)).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias


def linear_with_tensor_parallel_input(input_, weight, bias, sequence_parallel):
    """The input side of a column-parallel linear: copy (TP) or all-gather of the sequence (TP + SP)."""
    if sequence_parallel and get_tensor_model_parallel_world_size() > 1:
        return _LinearWithSequenceGather.apply(input_, weight, bias)
    return F.linear(copy_to_tensor_model_parallel_region(input_), weight, bias)


class ColumnParallelLinear(torch.nn.Module):
    """Y = XA + b with A split by columns (output features) across TP ranks.

    gather_output: all-gather Y so every rank holds the full output; otherwise each rank keeps its
    columns (the input of a RowParallelLinear). With sequence parallelism the input is this rank's
    sequence chunk [s/t, b, h], all-gathered along the sequence first. stride > 1 interleaves several logical matrices
    (e.g. SwiGLU's gate and up projections) so each rank gets its part of each. tensor_parallel=False: the whole
    matrix on this rank and no communication (an MoE expert, replicated over TP).
    """

    def __init__(self, input_size, output_size, *, config, init_method, bias=True, gather_output=False,
                 stride=1, skip_bias_add=False, tensor_parallel=True):
        super().__init__()
        tp = get_tensor_model_parallel_world_size() if tensor_parallel else 1
        divide(output_size, tp * stride, f"ColumnParallelLinear output size (stride {stride} x TP)")
        self.output_size_per_partition = output_size // tp
        self.tensor_parallel = tensor_parallel
        self.sequence_parallel = getattr(config, "sequence_parallel", False) and tensor_parallel
        if self.sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output is not supported with sequence parallelism")
        self.gather_output = gather_output
        self.stride = stride
        self.skip_bias_add = skip_bias_add
        self.weight = _sharded_parameter((self.output_size_per_partition, input_size), config.params_dtype,
                                         partition_dim=0, stride=stride, init_method=init_method,
                                         sharded=tensor_parallel)
        self.bias = (_sharded_parameter((self.output_size_per_partition,), config.params_dtype, partition_dim=0,
                                        stride=stride, fill=0.0, sharded=tensor_parallel) if bias else None)
        self.fp8_recipe = fp8_recipe_of(config, "outputs" if tensor_parallel else None)

    def forward(self, input_):
        added_bias = None if self.skip_bias_add else self.bias
        if not self.tensor_parallel:
            return _local_linear(input_, self.weight, added_bias, self.fp8_recipe), \
                (self.bias if self.skip_bias_add else None)
        if self.fp8_recipe is None:
            output = linear_with_tensor_parallel_input(input_, self.weight, added_bias, self.sequence_parallel)
        else:
            output = _local_linear(self._whole_tokens(input_), self.weight, added_bias, self.fp8_recipe)
        if self.gather_output:
            output = self._full_column_order(gather_from_tensor_model_parallel_region(output))
        return output, (self.bias if self.skip_bias_add else None)

    def _whole_tokens(self, input_):
        """The input every TP rank multiplies: all-gathered along the sequence (SP) or copied (TP)."""
        if self.sequence_parallel and get_tensor_model_parallel_world_size() > 1:
            return gather_from_sequence_parallel_region(input_)
        return copy_to_tensor_model_parallel_region(input_)

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
    all-reduced (reduce-scattered along the sequence with sequence parallelism), then the replicated
    bias is added.

    input_is_parallel: the input is already split along its last dim (output of a ColumnParallelLinear).
    tensor_parallel=False: the whole matrix on this rank and no communication (an MoE expert, replicated over TP).
    """

    def __init__(self, input_size, output_size, *, config, init_method, bias=True, input_is_parallel=False,
                 skip_bias_add=False, tensor_parallel=True):
        super().__init__()
        tp = get_tensor_model_parallel_world_size() if tensor_parallel else 1
        self.input_size_per_partition = divide(input_size, tp, "RowParallelLinear input size")
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.tensor_parallel = tensor_parallel
        self.sequence_parallel = getattr(config, "sequence_parallel", False) and tensor_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence parallelism needs input_is_parallel=True")
        self.weight = _sharded_parameter((output_size, self.input_size_per_partition), config.params_dtype,
                                         partition_dim=1, init_method=init_method, sharded=tensor_parallel)
        self.bias = _replicated_bias(output_size, config.params_dtype, self.sequence_parallel) if bias else None
        self.fp8_recipe = fp8_recipe_of(config, "inputs" if tensor_parallel else None)

    def forward(self, input_):
        if not self.tensor_parallel:
            output = _local_linear(input_, self.weight, None, self.fp8_recipe)
        else:
            parallel_input = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_)
            partial = _local_linear(parallel_input, self.weight, None, self.fp8_recipe)
            output = (reduce_scatter_to_sequence_parallel_region(partial) if self.sequence_parallel
                      else reduce_from_tensor_model_parallel_region(partial))
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
