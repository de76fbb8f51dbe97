import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    initialize_deterministically,
    vocab_parallel_cross_entropy,
)
from tests.support.distributed import run_distributed

CONFIG = types.SimpleNamespace(params_dtype=torch.float32)
SEED = 1234


def _run(tp, check, *args):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    check(*args)
    dist.barrier()


def _tp2(check, *args):
    run_distributed(_run, 2, 2, check, *args, timeout=60)


def _rank():
    return parallel_state.get_tensor_model_parallel_rank()


def _world():
    return parallel_state.get_tensor_model_parallel_world_size()


def _shard(full, dim, stride=1):
    """This rank's shard: the full tensor is `stride` blocks along dim; the rank holds its chunk of each."""
    return torch.cat([block.chunk(_world(), dim=dim)[_rank()] for block in full.chunk(stride, dim=dim)], dim=dim)


def _gather_full(shard, dim, stride=1):
    """Inverse of _shard: all-gather the TP shards and interleave their stride blocks."""
    shards = [torch.empty_like(shard) for _ in range(_world())]
    dist.all_gather(shards, shard.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    blocks = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([torch.cat([pieces[b] for pieces in blocks], dim=dim) for b in range(stride)], dim=dim)


def _gather_param(param):
    if not getattr(param, "tensor_model_parallel", False):
        return param.detach().clone()
    return _gather_full(param, param.partition_dim, param.partition_stride)


@torch.no_grad()
def _randomize_shards(module):
    """Different random values per TP rank for sharded parameters, identical ones for replicated parameters."""
    for index, param in enumerate(module.parameters()):
        sharded = getattr(param, "tensor_model_parallel", False)
        generator = torch.Generator().manual_seed(100 * index + (_rank() + 1 if sharded else 0))
        param.copy_(torch.randn(param.shape, generator=generator))


def _shared_randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _check_column_parallel_linear(gather_output, bias, stride):
    layer = ColumnParallelLinear(4, 8, config=CONFIG, init_method=None, bias=bias, gather_output=gather_output,
                                 stride=stride)
    _randomize_shards(layer)
    weight = _gather_full(layer.weight, dim=0, stride=stride).requires_grad_()
    full_bias = _gather_full(layer.bias, dim=0, stride=stride).requires_grad_() if bias else None
    serial_input = _shared_randn(3, 2, 4, seed=1).requires_grad_()
    serial_output = F.linear(serial_input, weight, full_bias)
    output_grad = _shared_randn(*serial_output.shape, seed=2)
    serial_output.backward(output_grad)

    input_ = serial_input.detach().clone().requires_grad_()
    output, returned_bias = layer(input_)
    local_grad = output_grad if gather_output else _shard(output_grad, dim=-1, stride=stride)
    output.backward(local_grad)

    assert returned_bias is None
    expected = serial_output if gather_output else _shard(serial_output, dim=-1, stride=stride)
    _assert_close(output, expected.detach())
    _assert_close(input_.grad, serial_input.grad)
    _assert_close(layer.weight.grad, _shard(weight.grad, dim=0, stride=stride))
    if bias:
        _assert_close(layer.bias.grad, _shard(full_bias.grad, dim=0, stride=stride))


def _check_row_parallel_linear(input_is_parallel):
    layer = RowParallelLinear(8, 4, config=CONFIG, init_method=None, bias=True, input_is_parallel=input_is_parallel)
    _randomize_shards(layer)
    weight = _gather_full(layer.weight, dim=1).requires_grad_()
    full_bias = layer.bias.detach().clone().requires_grad_()
    serial_input = _shared_randn(3, 2, 8, seed=1).requires_grad_()
    serial_output = F.linear(serial_input, weight, full_bias)
    output_grad = _shared_randn(*serial_output.shape, seed=2)
    serial_output.backward(output_grad)

    full_input = serial_input.detach().clone()
    input_ = (_shard(full_input, dim=-1) if input_is_parallel else full_input).requires_grad_()
    output, returned_bias = layer(input_)
    output.backward(output_grad)

    assert returned_bias is None
    _assert_close(output, serial_output.detach())
    _assert_close(input_.grad, _shard(serial_input.grad, dim=-1) if input_is_parallel else serial_input.grad)
    _assert_close(layer.weight.grad, _shard(weight.grad, dim=1))
    _assert_close(layer.bias.grad, full_bias.grad)


def _check_vocab_parallel_embedding():
    layer = VocabParallelEmbedding(8, 3, config=CONFIG, init_method=None)
    _randomize_shards(layer)
    weight = _gather_full(layer.weight, dim=0).requires_grad_()
    ids = torch.tensor([[0, 5, 3], [7, 4, 5], [3, 3, 1]])
    serial_output = F.embedding(ids, weight)
    output_grad = _shared_randn(*serial_output.shape, seed=2)
    serial_output.backward(output_grad)

    output = layer(ids)
    output.backward(output_grad)

    assert (layer.vocab_start_index, layer.vocab_end_index) == (4 * _rank(), 4 * _rank() + 4)
    _assert_close(output, serial_output.detach())
    _assert_close(layer.weight.grad, _shard(weight.grad, dim=0))


def _check_vocab_parallel_cross_entropy():
    logits = (20 * _shared_randn(3, 2, 8, seed=1)).requires_grad_()
    target = torch.tensor([[0, 7], [4, 3], [5, 1]])
    serial_loss = F.cross_entropy(logits.view(-1, 8), target.view(-1), reduction="none").view(3, 2)
    loss_grad = _shared_randn(3, 2, seed=2)
    serial_loss.backward(loss_grad)

    local_logits = _shard(logits.detach(), dim=-1).requires_grad_()
    loss = vocab_parallel_cross_entropy(local_logits, target)
    loss.backward(loss_grad)

    _assert_close(loss, serial_loss.detach())
    _assert_close(local_logits.grad, _shard(logits.grad, dim=-1))


class _Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.column = ColumnParallelLinear(4, 8, config=CONFIG, init_method=init_method_normal(0.02))
        self.strided = ColumnParallelLinear(4, 8, config=CONFIG, init_method=init_method_normal(0.02), stride=2)
        self.row = RowParallelLinear(8, 4, config=CONFIG, init_method=init_method_normal(0.02))
        self.embedding = VocabParallelEmbedding(8, 4, config=CONFIG, init_method=init_method_normal(1.0))


def _save_initialized_full_weights(path):
    layers = _Layers()
    initialize_deterministically(layers, "model", SEED)
    full = {name: _gather_param(param) for name, param in layers.named_parameters()}
    if dist.get_rank() == 0:
        torch.save(full, path)


@pytest.mark.parametrize("gather_output, bias, stride", [
    (True, True, 1),
    (True, False, 1),
    (False, True, 1),
    (False, False, 1),
    (False, True, 2),
    (True, True, 2),
])
def test_column_parallel_linear_matches_serial_linear(gather_output, bias, stride):
    _tp2(_check_column_parallel_linear, gather_output, bias, stride)


@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_matches_serial_linear(input_is_parallel):
    _tp2(_check_row_parallel_linear, input_is_parallel)


def test_vocab_parallel_embedding_matches_serial_embedding():
    _tp2(_check_vocab_parallel_embedding)


def test_vocab_parallel_cross_entropy_matches_serial_cross_entropy():
    _tp2(_check_vocab_parallel_cross_entropy)


def test_deterministic_initialization_gives_same_full_weights_at_tp1_and_tp2(tmp_path):
    run_distributed(_run, 1, 1, _save_initialized_full_weights, str(tmp_path / "tp1.pt"), timeout=60)
    run_distributed(_run, 2, 2, _save_initialized_full_weights, str(tmp_path / "tp2.pt"), timeout=60)
    tp1, tp2 = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")

    assert tp1.keys() == tp2.keys()
    for name in tp1:
        torch.testing.assert_close(tp2[name], tp1[name], rtol=0, atol=0, msg=name)
    assert tp1["column.weight"].std() > 0.01
    assert not torch.equal(tp1["column.weight"], tp1["strided.weight"])
