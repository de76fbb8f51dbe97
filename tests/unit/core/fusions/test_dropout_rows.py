"""A rank holding part of a sequence numbers its activations' rows by their global positions (rows=), so every
dropout backend keeps, for the same seed, exactly the elements the whole sequence's mask keeps there: the part's
output and input gradient are the whole's at those positions, bit for bit."""
import pytest
import torch

from megatron_ds.core import fusions
from megatron_ds.core.fusions.dropout import dropout
from megatron_ds.core.fusions.fused_bias_dropout_add import (
    bias_dropout_add_compile,
    bias_dropout_add_reference,
    bias_dropout_add_triton,
)
from megatron_ds.core.sequence_split import context_parallel_positions

SEQUENCE, BATCH, HIDDEN, P = 16, 3, 40, 0.3


def _inputs(device):
    generator = torch.Generator().manual_seed(0)
    x, residual, grad = (torch.randn(SEQUENCE, BATCH, HIDDEN, generator=generator).to(device) for _ in range(3))
    return x, torch.randn(HIDDEN, generator=generator).to(device), residual, grad


def _rows(positions, device):
    return (positions[:, None] * BATCH + torch.arange(BATCH)).flatten().to(device)


def _run(op, x, bias, residual, grad, rows=None):
    x = x.clone().requires_grad_()
    torch.manual_seed(11)  # the seed each call draws
    out = op(x, bias, residual, P, True, rows)
    out.backward(grad)
    return out.detach(), x.grad


def _assert_part_of_whole(op, device):
    x, bias, residual, grad = _inputs(device)
    whole_out, whole_grad = _run(op, x, bias, residual, grad)
    assert 0.5 < (whole_grad == 0).float().mean().item() * 1 / P < 1.5  # about a fraction P dropped
    for rank in range(2):  # CP 2's two parts: chunks (0, 3) and (1, 2) of 4
        positions = context_parallel_positions(SEQUENCE, 2, rank)
        part = [t[positions.to(device)] for t in (x, residual, grad)]
        out, x_grad = _run(op, part[0], bias, part[1], part[2], _rows(positions, device))
        assert torch.equal(out, whole_out[positions.to(device)])
        assert torch.equal(x_grad, whole_grad[positions.to(device)])
    shifted, _ = _run(op, x[:8], bias, residual[:8], grad[:8], _rows(torch.arange(8, 16), device))
    assert not torch.equal(shifted, whole_out[:8])  # the numbers decide the mask


def test_reference_bias_dropout_add_keys_rows_by_their_numbers():
    _assert_part_of_whole(bias_dropout_add_reference, torch.device("cpu"))


def test_plain_dropout_keys_rows_by_their_numbers():
    def embedding_dropout(x, bias, residual, p, training, rows=None):
        return dropout(x, p, training, rows)
    _assert_part_of_whole(embedding_dropout, torch.device("cpu"))


@pytest.mark.skipif(not fusions.is_available("bias_dropout_add", "compile", "cpu"),
                    reason=str(fusions.unavailable_reason("bias_dropout_add", "compile", "cpu")))
def test_compiled_bias_dropout_add_keys_rows_by_their_numbers():
    _assert_part_of_whole(bias_dropout_add_compile, torch.device("cpu"))


def test_triton_bias_dropout_add_keys_rows_by_their_numbers(triton_device):
    _assert_part_of_whole(bias_dropout_add_triton, triton_device)
