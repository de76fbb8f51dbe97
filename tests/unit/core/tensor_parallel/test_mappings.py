import pytest
import torch
import torch.distributed as dist

from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from tests.support.distributed import run_distributed

TP_SIZES = [2, 4]


def _run(tp, check, *args):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    check(*args)
    dist.barrier()


def _distributed(check, tp, *args):
    run_distributed(_run, tp, tp, check, *args, timeout=60)


def _ranked(rank, shape, offset=0.0):
    """A tensor that differs per rank in scale and offset, so sums, copies and chunks are told apart."""
    numel = torch.Size(shape).numel()
    return ((rank + 1) * (torch.arange(numel, dtype=torch.float32) + 1) + offset * rank).view(shape)


def _inputs(shape):
    return [_ranked(rank, shape) for rank in range(parallel_state.get_tensor_model_parallel_world_size())]


def _grads(shape):
    return [_ranked(rank, shape, offset=0.5) for rank in range(parallel_state.get_tensor_model_parallel_world_size())]


def _rank():
    return parallel_state.get_tensor_model_parallel_rank()


def _forward_backward(op, input_, grad, *args):
    input_ = input_.clone().requires_grad_()
    output = op(input_, *args)
    output.backward(grad)
    return output.detach(), input_.grad


def _check_copy_to():
    shape = (3, 4)
    output, input_grad = _forward_backward(copy_to_tensor_model_parallel_region, _inputs(shape)[_rank()],
                                           _grads(shape)[_rank()])
    torch.testing.assert_close(output, _inputs(shape)[_rank()], rtol=0, atol=0)
    torch.testing.assert_close(input_grad, sum(_grads(shape)), rtol=0, atol=0)


def _check_reduce_from():
    shape = (3, 4)
    output, input_grad = _forward_backward(reduce_from_tensor_model_parallel_region, _inputs(shape)[_rank()],
                                           _grads(shape)[_rank()])
    torch.testing.assert_close(output, sum(_inputs(shape)), rtol=0, atol=0)
    torch.testing.assert_close(input_grad, _grads(shape)[_rank()], rtol=0, atol=0)


def _check_scatter_to_tensor_region():
    tp = parallel_state.get_tensor_model_parallel_world_size()
    full, chunk = (3, 2 * tp), (3, 2)
    output, input_grad = _forward_backward(scatter_to_tensor_model_parallel_region, _inputs(full)[_rank()],
                                           _grads(chunk)[_rank()])
    torch.testing.assert_close(output, _inputs(full)[_rank()][:, 2 * _rank():2 * _rank() + 2], rtol=0, atol=0)
    torch.testing.assert_close(input_grad, torch.cat(_grads(chunk), dim=-1), rtol=0, atol=0)


def _check_gather_from_tensor_region():
    tp = parallel_state.get_tensor_model_parallel_world_size()
    chunk, full = (3, 2), (3, 2 * tp)
    output, input_grad = _forward_backward(gather_from_tensor_model_parallel_region, _inputs(chunk)[_rank()],
                                           _grads(full)[_rank()])
    torch.testing.assert_close(output, torch.cat(_inputs(chunk), dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(input_grad, _grads(full)[_rank()][:, 2 * _rank():2 * _rank() + 2], rtol=0, atol=0)


def _check_scatter_to_sequence_region():
    tp = parallel_state.get_tensor_model_parallel_world_size()
    full, chunk = (2 * tp, 2, 3), (2, 2, 3)
    output, input_grad = _forward_backward(scatter_to_sequence_parallel_region, _inputs(full)[_rank()],
                                           _grads(chunk)[_rank()])
    torch.testing.assert_close(output, _inputs(full)[_rank()][2 * _rank():2 * _rank() + 2], rtol=0, atol=0)
    torch.testing.assert_close(input_grad, torch.cat(_grads(chunk), dim=0), rtol=0, atol=0)


def _check_gather_from_sequence_region(tensor_parallel_output_grad):
    tp = parallel_state.get_tensor_model_parallel_world_size()
    chunk, full = (2, 2, 3), (2 * tp, 2, 3)
    output, input_grad = _forward_backward(gather_from_sequence_parallel_region, _inputs(chunk)[_rank()],
                                           _grads(full)[_rank()], tensor_parallel_output_grad)
    torch.testing.assert_close(output, torch.cat(_inputs(chunk), dim=0), rtol=0, atol=0)
    grad = sum(_grads(full)) if tensor_parallel_output_grad else _grads(full)[_rank()]
    torch.testing.assert_close(input_grad, grad[2 * _rank():2 * _rank() + 2], rtol=0, atol=0)


def _check_reduce_scatter_to_sequence_region():
    tp = parallel_state.get_tensor_model_parallel_world_size()
    full, chunk = (2 * tp, 2, 3), (2, 2, 3)
    output, input_grad = _forward_backward(reduce_scatter_to_sequence_parallel_region, _inputs(full)[_rank()],
                                           _grads(chunk)[_rank()])
    torch.testing.assert_close(output, sum(_inputs(full))[2 * _rank():2 * _rank() + 2], rtol=0, atol=0)
    torch.testing.assert_close(input_grad, torch.cat(_grads(chunk), dim=0), rtol=0, atol=0)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_copy_to_tensor_region_is_identity_and_sums_grads(tp):
    _distributed(_check_copy_to, tp)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_reduce_from_tensor_region_sums_and_passes_grads(tp):
    _distributed(_check_reduce_from, tp)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_scatter_to_tensor_region_keeps_last_dim_chunk_and_gathers_grads(tp):
    _distributed(_check_scatter_to_tensor_region, tp)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_gather_from_tensor_region_concatenates_last_dim_and_splits_grads(tp):
    _distributed(_check_gather_from_tensor_region, tp)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_scatter_to_sequence_region_keeps_first_dim_chunk_and_gathers_grads(tp):
    _distributed(_check_scatter_to_sequence_region, tp)


@pytest.mark.parametrize("tensor_parallel_output_grad", [True, False])
@pytest.mark.parametrize("tp", TP_SIZES)
def test_gather_from_sequence_region_concatenates_first_dim(tp, tensor_parallel_output_grad):
    _distributed(_check_gather_from_sequence_region, tp, tensor_parallel_output_grad)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_reduce_scatter_to_sequence_region_sums_then_splits_first_dim(tp):
    _distributed(_check_reduce_scatter_to_sequence_region, tp)
