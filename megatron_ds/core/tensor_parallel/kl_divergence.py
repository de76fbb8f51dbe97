"""The distillation term over logits whose vocabulary dimension is split across TP ranks (neither model's full
logits are gathered on one rank):

    vocab_parallel_kl_divergence(student [..., V/tp], teacher [..., V/tp], T) -> T^2 KL(p_t || p_s) per token [...]

with p = softmax(logits / T) over the whole vocabulary. Its gradient with respect to the student's logits is
T (p_s - p_t), written out in backward; the teacher's logits get none. As the chunked cross entropy
(core/fusions/fused_cross_entropy.py), it works a chunk of tokens at a time and keeps for backward only the
two models' logits (alive anyway) and each token's two log-sum-exps: its float32 temporaries are a chunk's,
never the whole s x b x V / tp (four of which an unchunked term needs at its peak).
"""
import torch
import torch.distributed as dist

from megatron_ds.core.fusions.fused_cross_entropy import default_chunk_rows
from megatron_ds.core.parallel_state import get_tensor_model_parallel_group, get_tensor_model_parallel_world_size


def _all_reduce(tensor, op):
    if get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=get_tensor_model_parallel_group())
    return tensor


def _scaled(chunk, temperature):
    """A chunk of logits / T, in at least float32."""
    return chunk.to(torch.promote_types(chunk.dtype, torch.float32)) / temperature


def _log_sum_exp(rows, temperature, chunk_rows):
    """Per row of logits / T: the log-sum-exp over the whole vocabulary (this rank's shard, then over TP)."""
    maxes, sums = [], []
    for chunk in rows.split(chunk_rows):
        scaled = _scaled(chunk, temperature)
        row_max = scaled.amax(dim=-1)
        maxes.append(row_max)
        sums.append((scaled - row_max.unsqueeze(-1)).exp_().sum(dim=-1))
    local_max, local_sum = torch.cat(maxes), torch.cat(sums)
    global_max = _all_reduce(local_max.clone(), dist.ReduceOp.MAX)
    return global_max + _all_reduce(local_sum * torch.exp(local_max - global_max), dist.ReduceOp.SUM).log()


def _log_probs(chunk, lse, temperature):
    return _scaled(chunk, temperature).sub_(lse.unsqueeze(-1))


class _VocabParallelKLDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_logits, teacher_logits, temperature, chunk_rows):
        vocab = student_logits.size(-1)
        student, teacher = (logits.reshape(-1, vocab) for logits in (student_logits, teacher_logits))
        student_lse, teacher_lse = (_log_sum_exp(rows, temperature, chunk_rows) for rows in (student, teacher))
        per_token = []
        for start in range(0, student.size(0), chunk_rows):
            rows = slice(start, start + chunk_rows)
            teacher_log_probs = _log_probs(teacher[rows], teacher_lse[rows], temperature)
            student_log_probs = _log_probs(student[rows], student_lse[rows], temperature)
            per_token.append((teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(dim=-1))
        kl = _all_reduce(torch.cat(per_token), dist.ReduceOp.SUM)
        ctx.save_for_backward(student, teacher, student_lse, teacher_lse)
        ctx.temperature, ctx.chunk_rows, ctx.shape = temperature, chunk_rows, student_logits.shape
        return (kl * temperature ** 2).view(student_logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_per_token):
        student, teacher, student_lse, teacher_lse = ctx.saved_tensors
        scale = grad_per_token.reshape(-1) * ctx.temperature
        grad = torch.empty_like(student)
        for start in range(0, student.size(0), ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            difference = (_log_probs(student[rows], student_lse[rows], ctx.temperature).exp_()
                          - _log_probs(teacher[rows], teacher_lse[rows], ctx.temperature).exp_())
            grad[rows] = difference.mul_(scale[rows].unsqueeze(-1))
        return grad.view(ctx.shape), None, None, None


def vocab_parallel_kl_divergence(student_logits, teacher_logits, temperature=1.0, chunk_rows=None):
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"distillation: student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ; the two models must share the vocabulary and see the "
                         f"same tokens")
    chunk_rows = chunk_rows or default_chunk_rows(student_logits.size(-1))
    return _VocabParallelKLDivergence.apply(student_logits, teacher_logits.detach(), float(temperature), chunk_rows)
