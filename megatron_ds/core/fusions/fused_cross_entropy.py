"""Vocab-parallel cross entropy that never holds the logits in fp32 all at once.

Megatron's vocab-parallel cross entropy (logits [..., V/tp], this rank's vocabulary slice; targets [...] in
the full vocabulary; per-token fp32 loss [...]; tensor_parallel.vocab_parallel_cross_entropy is this
module's reference), with the same loss and gradients as the textbook form, but:
- forward walks the tokens in chunks of `chunk_rows`, keeping per-token fp32 statistics only (this
  rank's max and sum of exp), so the extra memory is O(chunk_rows x V/tp) fp32 rather than O(tokens x V/tp);
- the TP collectives act on those per-token statistics, once for the whole batch: one MAX all-reduce and
  one SUM all-reduce of [2, tokens] (sum of exp and target logit), skipped when TP has one rank;
- it saves the logits (the caller's tensor, no copy), the local target and the fp32 log-sum-exp per token,
  not the fp32 softmax; backward recomputes softmax - one_hot chunk by chunk, in the logits' dtype.
The triton kernels stream each row through registers (an online max/sum), so they need no chunking.
"""
import torch
import torch.distributed as dist

from megatron_ds.core.fusions._triton import check_device, kernel, next_power_of_2, tl
from megatron_ds.core.fusions.backends import FusedOp, compiled
from megatron_ds.core.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)

CHUNK_ELEMENTS = 1 << 24  # default chunk: 16M fp32 logits (64 MiB per temporary), 128 tokens at V/tp = 128k


def default_chunk_rows(vocab_per_partition: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab_per_partition))


def _all_reduce(tensor, op):
    if get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=get_tensor_model_parallel_group())
    return tensor


def _local_stats(chunk):
    """Per row of this rank's logits: (max, sum of exp(logit - max)), fp32."""
    chunk = chunk.float()
    row_max = chunk.amax(dim=-1)
    return row_max, (chunk - row_max.unsqueeze(-1)).exp_().sum(dim=-1)


def _grad_chunk(chunk, lse, local_target, grad_loss):
    """(softmax - one_hot(local_target)) * grad_loss in the logits' dtype; local_target -1 = not on this rank."""
    grad = (chunk.float() - lse.unsqueeze(-1)).exp_().mul_(grad_loss.unsqueeze(-1))
    # the target column of every row, minus grad_loss where the target is on this rank (minus 0 elsewhere: the same
    # value back); gather and scatter keep the shapes fixed, so no nonzero makes the host wait for the device
    column = local_target.clamp(min=0).unsqueeze(-1)
    subtracted = torch.where(local_target >= 0, grad_loss, 0.0).unsqueeze(-1)
    grad.scatter_(-1, column, grad.gather(-1, column) - subtracted)
    return grad.to(chunk.dtype)


def _grad_chunk_compilable(chunk, lse, local_target, grad_loss):
    """_grad_chunk without in-place updates or data-dependent shapes, for torch.compile to fuse."""
    probs = torch.exp(chunk.float() - lse.unsqueeze(-1))
    # int32: inductor vectorises the compare at half the work of int64 (this backward 0.9x the time)
    columns = torch.arange(chunk.size(-1), device=chunk.device, dtype=torch.int32)
    probs = probs - (columns == local_target.to(torch.int32).unsqueeze(-1)).to(probs.dtype)
    return (probs * grad_loss.unsqueeze(-1)).to(chunk.dtype)


class _Torch:
    """Chunked passes in eager PyTorch, or (compiled=True) through torch.compile."""

    def __init__(self, use_compile):
        self.use_compile = use_compile

    def local_stats(self, logits, chunk_rows):
        stats = compiled(_local_stats) if self.use_compile else _local_stats
        pieces = [stats(chunk) for chunk in logits.split(chunk_rows)]
        return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])

    def grad(self, logits, lse, local_target, grad_loss, chunk_rows):
        grad_fn = compiled(_grad_chunk_compilable) if self.use_compile else _grad_chunk
        if 0 < logits.size(0) <= chunk_rows:  # one chunk: its result is the gradient, not copied into place
            return grad_fn(logits, lse, local_target, grad_loss)
        grad = torch.empty_like(logits)
        for start in range(0, logits.size(0), chunk_rows):
            rows = slice(start, start + chunk_rows)
            grad[rows] = grad_fn(logits[rows], lse[rows], local_target[rows], grad_loss[rows])
        return grad


@kernel
def _ce_stats_kernel(X, MAX, SUM, v, BLOCK_V: tl.constexpr):
    """Online max and sum of exp along one row, per lane, then combined across lanes."""
    row = tl.program_id(0).to(tl.int64)
    lane_max = tl.full([BLOCK_V], -3.0e38, tl.float32)  # finite: no inf - inf for lanes past v
    lane_sum = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, v, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(X + row * v + cols, mask=cols < v, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        lane_sum = lane_sum * tl.exp(lane_max - new_max) + tl.exp(x - new_max)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    tl.store(MAX + row, row_max)
    tl.store(SUM + row, tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0))


@kernel
def _ce_grad_kernel(X, LSE, TARGET, DLOSS, DX, v, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(LSE + row)
    target = tl.load(TARGET + row)
    dloss = tl.load(DLOSS + row).to(tl.float32)
    for start in range(0, v, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < v
        x = tl.load(X + row * v + cols, mask=inside, other=0.0).to(tl.float32)
        probs = tl.exp(x - lse)
        probs = tl.where(cols == target, probs - 1.0, probs)
        tl.store(DX + row * v + cols, (probs * dloss).to(DX.dtype.element_ty), mask=inside)


class _Triton:
    """Whole-batch kernels: one program per token streams its row (no fp32 copy, so no chunking)."""

    @staticmethod
    def _block(v):
        return min(next_power_of_2(v), 4096)

    def local_stats(self, logits, chunk_rows):
        rows, v = logits.shape
        row_max = torch.empty(rows, dtype=torch.float32, device=logits.device)
        sum_exp = torch.empty_like(row_max)
        if rows:
            _ce_stats_kernel[(rows,)](logits, row_max, sum_exp, v, BLOCK_V=self._block(v))
        return row_max, sum_exp

    def grad(self, logits, lse, local_target, grad_loss, chunk_rows):
        rows, v = logits.shape
        grad = torch.empty_like(logits)
        if rows:
            _ce_grad_kernel[(rows,)](logits, lse, local_target, grad_loss.float().contiguous(), grad, v,
                                     BLOCK_V=self._block(v))
        return grad


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, passes, chunk_rows):
        vocab = logits.size(-1)
        flat = logits.reshape(-1, vocab).contiguous()
        start = get_tensor_model_parallel_rank() * vocab
        target = target.reshape(-1)
        inside = (target >= start) & (target < start + vocab)
        local_target = torch.where(inside, target - start, -1)

        row_max, sum_exp = passes.local_stats(flat, chunk_rows)
        global_max = _all_reduce(row_max.clone(), dist.ReduceOp.MAX)
        sum_exp = sum_exp * torch.exp(row_max - global_max)  # exact (factor 1) with one TP rank
        target_logit = flat.gather(-1, local_target.clamp(min=0).unsqueeze(-1)).squeeze(-1).float() - global_max
        summed = _all_reduce(torch.stack((sum_exp, target_logit.masked_fill(~inside, 0.0))), dist.ReduceOp.SUM)
        log_sum_exp = summed[0].log()
        ctx.save_for_backward(flat, local_target, global_max + log_sum_exp)
        ctx.passes, ctx.chunk_rows, ctx.shape = passes, chunk_rows, logits.shape
        return (log_sum_exp - summed[1]).view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss):
        flat, local_target, lse = ctx.saved_tensors
        grad_loss = grad_loss.reshape(-1).float()
        grad = ctx.passes.grad(flat, lse, local_target, grad_loss, ctx.chunk_rows)
        return grad.view(ctx.shape), None, None, None


def _cross_entropy(passes, logits, target, chunk_rows):
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"cross entropy: logits {tuple(logits.shape)} and target {tuple(target.shape)} "
                         f"disagree; expected logits [..., vocab/tp] and target [...]")
    chunk_rows = chunk_rows or default_chunk_rows(logits.size(-1))
    return _ChunkedVocabParallelCrossEntropy.apply(logits, target, passes, chunk_rows)


def cross_entropy_reference(logits, target, chunk_rows=None):
    """Per-token loss [...] from this rank's logits [..., V/tp]; chunked eager PyTorch."""
    return _cross_entropy(_Torch(use_compile=False), logits, target, chunk_rows)


def cross_entropy_compile(logits, target, chunk_rows=None):
    """As the reference, each chunk's passes through torch.compile (no fp32 copy of the chunk either)."""
    return _cross_entropy(_Torch(use_compile=True), logits, target, chunk_rows)


def cross_entropy_triton(logits, target, chunk_rows=None):
    """Triton kernels, forward and backward (chunk_rows is ignored: rows are streamed)."""
    check_device(logits, op="cross_entropy")
    return _cross_entropy(_Triton(), logits, target, chunk_rows)


OPS = (FusedOp("cross_entropy",
               {"reference": cross_entropy_reference, "triton": cross_entropy_triton,
                "compile": cross_entropy_compile}, faster_compiled_on_cpu=True),)
