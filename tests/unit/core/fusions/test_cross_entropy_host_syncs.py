"""The reference cross entropy's backward without a host sync: the target column of each row is updated with
gather/scatter, not through torch.nonzero of the rows whose target is on this rank (a sync per chunk on a GPU),
with bitwise the gradient the nonzero form gave."""
import pytest
import torch

from megatron_ds.core.fusions import fused_cross_entropy
from tests.support.host_syncs import HostSyncCounter


def _grad_chunk_with_nonzero(chunk, lse, local_target, grad_loss):
    """The former _grad_chunk, kept as the oracle."""
    grad = (chunk.float() - lse.unsqueeze(-1)).exp_().mul_(grad_loss.unsqueeze(-1))
    rows = torch.nonzero(local_target >= 0).squeeze(-1)
    grad[rows, local_target[rows]] -= grad_loss[rows]
    return grad.to(chunk.dtype)


def _inputs(dtype, rows=37, vocab=129, off_rank=0.4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    chunk = (torch.randn(rows, vocab, generator=generator) * 4).to(dtype)
    lse = torch.logsumexp(chunk.float(), dim=-1)
    local_target = torch.randint(0, vocab, (rows,), generator=generator)
    local_target[torch.rand(rows, generator=generator) < off_rank] = -1  # targets on another TP rank
    grad_loss = torch.randn(rows, generator=generator)
    grad_loss[::5] = 0.0  # zeros and negative zeros: the sign of a zero survives
    grad_loss[1::7] = -0.0
    return chunk, lse, local_target, grad_loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("off_rank", [0.0, 0.4, 1.0])
def test_grad_chunk_is_bitwise_the_nonzero_form(dtype, off_rank):
    inputs = _inputs(dtype, off_rank=off_rank)
    expected = _grad_chunk_with_nonzero(*inputs)
    observed = fused_cross_entropy._grad_chunk(*inputs)
    assert observed.dtype == expected.dtype
    assert torch.equal(observed.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       expected.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_grad_chunk_of_no_rows():
    chunk, lse, local_target, grad_loss = _inputs(torch.float32, rows=0)
    assert fused_cross_entropy._grad_chunk(chunk, lse, local_target, grad_loss).shape == (0, 129)


def test_reference_cross_entropy_backward_makes_no_host_sync():
    """Forward and backward, over several chunks: no op that would make the host wait for a GPU."""
    chunk, _, local_target, _ = _inputs(torch.float32, rows=40)
    logits = chunk.clone().requires_grad_()
    counter = HostSyncCounter()
    counter.iteration = 1
    with counter:
        loss = fused_cross_entropy.cross_entropy_reference(logits, local_target.clamp(min=0), chunk_rows=8)
        loss.backward(torch.ones_like(loss))
    assert not counter.counts[1], dict(counter.counts[1])
