"""The textbook vocab-parallel cross entropy (Megatron's: fp32 logits, one all-reduce each for the max,
the target logit and the sum of exponentials; the whole fp32 softmax saved): the oracle every backend of
core/fusions' cross_entropy op is checked against."""
import torch
import torch.distributed as dist

from megatron_ds.core.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


def _all_reduce(tensor, op=dist.ReduceOp.SUM):
    if get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=get_tensor_model_parallel_group())
    return tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        logits = logits.float()
        logits_max = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        per_partition = logits.size(-1)
        start = get_tensor_model_parallel_rank() * per_partition
        outside = (target < start) | (target >= start + per_partition)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = _all_reduce(target_logit)

        exp_logits = shifted.exp()
        sum_exp = _all_reduce(exp_logits.sum(dim=-1))
        loss = sum_exp.log() - target_logit

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        # the saved softmax becomes the gradient in place: one [tokens, vocab/tp] fp32 buffer, not three
        grad, local_target, outside = ctx.saved_tensors
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).unsqueeze(-1).to(grad.dtype))
        return grad.mul_(grad_output.unsqueeze(-1)), None


def textbook_vocab_parallel_cross_entropy(vocab_parallel_logits, target):
    """Per-token loss [...] from logits [..., vocab/tp] (this rank's slice) and full-vocab targets [...]."""
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)


def textbook_partial_rope(x, positions, rotary_dim, base=10000.0):
    """RoPE on the leading rotary_dim channels of x [s, b, heads, d], the rest unchanged, in float64 (result in x's
    dtype): channels i and i + rotary_dim/2 (i < rotary_dim/2, the rotate-half pairing) form the complex number
    x_i + j x_{i + rotary_dim/2}, multiplied by e^{j theta} with theta = position * base^(-2i / rotary_dim)."""
    half = rotary_dim // 2
    x64 = x.double()
    pairs = torch.complex(x64[..., :half], x64[..., half:rotary_dim])
    frequencies = base ** (-2.0 * torch.arange(half, dtype=torch.float64) / rotary_dim)
    theta = positions.double()[:, None] * frequencies[None, :]                       # [s, half]
    rotated = pairs * torch.polar(torch.ones_like(theta), theta)[:, None, None, :]
    return torch.cat((rotated.real, rotated.imag, x64[..., rotary_dim:]), dim=-1).to(x.dtype)


def fmix32(x: int) -> int:
    """murmur3's 32-bit finaliser on Python ints."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def textbook_causal_attention(query, key, value, keep=None, dropout_p=0.0):
    """softmax(q k^T / sqrt(d)) with causal masking aligned to the last key, dropout by a given keep mask
    [b, heads, sq, sk], times v; all in fp64, returned in query's dtype."""
    sq, sk = query.size(-2), key.size(-2)
    scores = query.double() @ key.double().transpose(-1, -2) / query.size(-1) ** 0.5
    future = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1 + sk - sq)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    if keep is not None:
        probs = torch.where(keep, probs / (1.0 - dropout_p), 0.0)
    return (probs @ value.double()).to(query.dtype)
