"""Ring attention: context parallelism by passing key/value blocks around a ring (Megatron-Core's
--cp-comm-type p2p). Each of the CP ranks holds a part of the sequence of every tensor (queries, keys, values);
key/value blocks (GQA's key/value heads as they are, never expanded) travel rank to rank with
dist.batch_isend_irecv while the block in hand computes, and each block's partial output is merged into the
running one by the log-sum-exp of its rows (online softmax), so that the result is exact. The backward runs the
ring again: dQ accumulates where the queries live, dK and dV (in fp32 or wider) travel with their key/value
block and arrive back at their owner after a full turn.

    load_balanced_chunks(sequence_length, cp_size, cp_rank) -> (slice, slice)
    context_parallel_positions(sequence_length, cp_size, cp_rank) -> the rank's global token positions
    split_for_context_parallel(tensor, cp_size, cp_rank, dim=0) -> the rank's part of a whole-sequence tensor
    join_context_parallel_parts(parts, dim=0) -> the whole sequence from every rank's part, in rank order
    gather_from_context_parallel(tensor, group, dim=0) -> join of every rank's part, on every rank
    ring_attention(query, key, value, group, causal=True, softmax_scale=None, dropout_p=0.0) -> context

The layout is core attention's (attention.py): query [b, heads, s_local, d], key [b, groups, s_local, d] and
value [b, groups, s_local, dv], groups dividing heads (query head h uses key/value head h // (heads / groups));
the context is [b, heads, s_local, dv]. The scores are scaled by softmax_scale, 1 / sqrt(d) by default.

Causal load balancing (Megatron-Core's and torchtitan's): the sequence is cut into 2 x CP chunks and rank i
holds chunks i and 2 CP - 1 - i, so every rank has as many visible (query, key) pairs as any other. With that
layout a key/value block of another rank is, for this rank's queries, either fully visible or fully masked in
halves (see visible_part); only a rank's own block needs the causal mask. Non-causal attention does not depend on
where a rank's tokens lie in the sequence: any split of it works, this one included.

Each block runs attention_block (forward: output and log-sum-exp) and attention_block_backward: plain PyTorch
math, in fp32 or the inputs' dtype if wider, one replaceable pair (on GPUs: kernels that return the
log-sum-exp). Dropout is not supported yet.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------------------------------------
# Where each rank's tokens lie in the sequence


def load_balanced_chunks(sequence_length, cp_size, cp_rank):
    """The two slices of the sequence that CP rank cp_rank holds: chunks cp_rank and 2 cp_size - 1 - cp_rank of
    2 cp_size equal chunks."""
    _check_layout(sequence_length, cp_size, cp_rank)
    chunk = sequence_length // (2 * cp_size)
    last = 2 * cp_size - 1 - cp_rank
    return slice(cp_rank * chunk, (cp_rank + 1) * chunk), slice(last * chunk, (last + 1) * chunk)


def _check_layout(sequence_length, cp_size, cp_rank):
    if cp_size < 1:
        raise ValueError(f"cp_size must be at least 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    if sequence_length % (2 * cp_size):
        raise ValueError(f"sequence_length {sequence_length} is not divisible by 2 x cp_size = {2 * cp_size} "
                         "(context parallelism cuts the sequence into 2 chunks per rank)")


def context_parallel_positions(sequence_length, cp_size, cp_rank):
    """The global positions [s / cp_size] of the tokens CP rank cp_rank holds, in the order it holds them (for
    position embeddings and masks)."""
    return torch.cat([torch.arange(part.start, part.stop)
                      for part in load_balanced_chunks(sequence_length, cp_size, cp_rank)])


def split_for_context_parallel(tensor, cp_size, cp_rank, dim=0):
    """The part of a whole-sequence tensor (the sequence along dim) that CP rank cp_rank holds: its two chunks,
    concatenated (a copy)."""
    return torch.cat([tensor.narrow(dim, part.start, part.stop - part.start)
                      for part in load_balanced_chunks(tensor.size(dim), cp_size, cp_rank)], dim=dim)


def join_context_parallel_parts(parts, dim=0):
    """The whole-sequence tensor from every CP rank's part (parts[r]: rank r's, as split_for_context_parallel
    gives it): the inverse of the split."""
    halves = [part.chunk(2, dim=dim) for part in parts]
    return torch.cat([first for first, _ in halves] + [second for _, second in reversed(halves)], dim=dim)


def gather_from_context_parallel(tensor, group=None, dim=0):
    """Every CP rank's part of a sequence gathered over group and joined back into the whole sequence, on every
    rank (for tests and checks; not differentiable)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return join_context_parallel_parts(parts, dim=dim)


# ---------------------------------------------------------------------------------------------------------------
# Which part of a key/value block this rank's queries see


@dataclass(frozen=True)
class VisiblePart:
    """The queries and keys of one (query rank, key/value owner) pair that attend, as slices of the local
    sequence, and whether they need the causal mask (the rank's own block, whose local order is the global one)."""
    queries: slice
    keys: slice
    causal: bool


_EVERYTHING = slice(None)


def visible_part(rank, owner, local_length, causal):
    """What rank's queries see of owner's key/value block under the load-balanced layout. Causal: an earlier
    owner's first chunk (owner < rank) comes before both of rank's chunks and its second chunk after both; a
    later owner's chunks both come after rank's first chunk and before its second."""
    if not causal:
        return VisiblePart(_EVERYTHING, _EVERYTHING, False)
    if owner == rank:
        return VisiblePart(_EVERYTHING, _EVERYTHING, True)
    half = local_length // 2
    if owner < rank:
        return VisiblePart(_EVERYTHING, slice(0, half), False)
    return VisiblePart(slice(half, local_length), _EVERYTHING, False)


# ---------------------------------------------------------------------------------------------------------------
# One block's attention: plain math, in fp32 or wider (the replaceable part)


def compute_dtype(dtype):
    """The dtype a block computes and accumulates in: fp32, or the inputs' if wider."""
    return torch.promote_types(dtype, torch.float32)


def _by_group(tensor, groups):
    """[b, heads, s, x] -> [b, groups, heads / groups, s, x] (a view)."""
    b, heads = tensor.shape[:2]
    return tensor.view(b, groups, heads // groups, *tensor.shape[2:])


def _block_scores(query, key, scale, causal):
    """Scaled scores [b, groups, heads / groups, sq, sk], -inf above the diagonal when causal."""
    scores = torch.matmul(_by_group(query, key.size(1)), key.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))
    return scores


def attention_block(query, key, value, scale, causal):
    """softmax(Q K^T scale) V of one block, and the log-sum-exp of each query row: ([b, heads, sq, dv],
    [b, heads, sq]) in compute_dtype. causal: the mask of sq == sk tokens in the same order."""
    dtype = compute_dtype(query.dtype)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    scores = _block_scores(query, key, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), value.unsqueeze(2))
    return out.flatten(1, 2), lse.flatten(1, 2)


def attention_block_backward(query, key, value, grad_out, lse, delta, scale, causal):
    """Gradients (dq [b, heads, sq, d], dk [b, groups, sk, d], dv [b, groups, sk, dv]) of one block, in
    compute_dtype, given the whole attention's log-sum-exp and delta = rowsum(dO * O) of its query rows: the
    block's probabilities are exp(scores - lse), the softmax's row term is delta."""
    dtype, groups = compute_dtype(query.dtype), key.size(1)
    query, key, value, grad_out = (t.to(dtype) for t in (query, key, value, grad_out))
    probs = torch.exp(_block_scores(query, key, scale, causal) - _by_group(lse, groups).unsqueeze(-1))
    grad_out = _by_group(grad_out, groups)
    grad_value = torch.matmul(probs.transpose(-1, -2), grad_out).sum(2)
    grad_probs = torch.matmul(grad_out, value.unsqueeze(2).transpose(-1, -2))
    grad_scores = probs * (grad_probs - _by_group(delta, groups).unsqueeze(-1)) * scale
    grad_query = torch.matmul(grad_scores, key.unsqueeze(2)).flatten(1, 2)
    grad_key = torch.matmul(grad_scores.transpose(-1, -2), _by_group(query, groups)).sum(2)
    return grad_query, grad_key, grad_value


def merge_block(out, lse, block_out, block_lse):
    """Fold one block's partial output and log-sum-exp into the running ones, in place (online softmax)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


# ---------------------------------------------------------------------------------------------------------------
# The ring


class _RingExchange:
    """Tensors sent to the next rank of the ring while the same number are received from the previous one."""

    def __init__(self, tensors, group):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        sends = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in sends]
        ops = ([dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % size) for t in sends]
               + [dist.P2POp(dist.irecv, t, group=group, group_peer=(rank - 1) % size) for t in self.received])
        self._sends = sends  # kept alive until the transfer completes
        self._works = dist.batch_isend_irecv(ops)

    def wait(self):
        for work in self._works:
            work.wait()
        return self.received


class RingAttention(torch.autograd.Function):
    """Ring attention over a process group (see the module docstring); ring_attention checks the inputs."""

    @staticmethod
    def forward(ctx, query, key, value, group, causal, scale):
        size, rank, local_length = dist.get_world_size(group), dist.get_rank(group), query.size(2)
        out, lse, block = None, None, (key, value)
        for step in range(size):
            exchange = _RingExchange(block, group) if step + 1 < size else None
            part = visible_part(rank, (rank - step) % size, local_length, causal)
            block_out, block_lse = attention_block(query[:, :, part.queries], block[0][:, :, part.keys],
                                                   block[1][:, :, part.keys], scale, part.causal)
            if step == 0:  # a rank's own block reaches every one of its queries: nothing to merge yet
                out, lse = block_out, block_lse
            else:
                merge_block(out[:, :, part.queries], lse[:, :, part.queries], block_out, block_lse)
            if exchange is not None:
                block = exchange.wait()
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        size, rank, local_length = dist.get_world_size(group), dist.get_rank(group), query.size(2)
        delta = (grad_out.to(out.dtype) * out).sum(-1)
        grad_query = torch.zeros_like(query, dtype=out.dtype)
        block, grads_in_flight = (key, value), None
        for step in range(size):
            exchange = _RingExchange(block, group) if step + 1 < size else None
            part = visible_part(rank, (rank - step) % size, local_length, causal)
            dq, dk, dv = attention_block_backward(query[:, :, part.queries], block[0][:, :, part.keys],
                                                  block[1][:, :, part.keys], grad_out[:, :, part.queries],
                                                  lse[:, :, part.queries], delta[:, :, part.queries], scale,
                                                  part.causal)
            grad_query[:, :, part.queries] += dq
            # this block's dK and dV so far: what the ranks before added (arrived while this step computed)
            block_grads = (grads_in_flight.wait() if grads_in_flight is not None
                           else [torch.zeros_like(t, dtype=out.dtype) for t in block])
            block_grads[0][:, :, part.keys] += dk
            block_grads[1][:, :, part.keys] += dv
            grads_in_flight = _RingExchange(block_grads, group) if size > 1 else None
            if exchange is not None:
                block = exchange.wait()
        # one more hop after the last step brings every block's dK and dV home
        grad_key, grad_value = grads_in_flight.wait() if grads_in_flight is not None else block_grads
        return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), None, None, None)


def ring_attention(query, key, value, group=None, causal=True, softmax_scale=None, dropout_p=0.0):
    """Attention of this CP rank's queries over the whole sequence's keys and values, the key/value blocks
    passed around group's ring: context [b, heads, s_local, dv] (layout and causal split: the module
    docstring). Every rank of group calls it with its own part of the same sequence."""
    _check_inputs(query, key, value, causal, dropout_p)
    scale = 1.0 / math.sqrt(query.size(-1)) if softmax_scale is None else softmax_scale
    return RingAttention.apply(query, key, value, group, causal, scale)


def _check_inputs(query, key, value, causal, dropout_p):
    if dropout_p:
        raise NotImplementedError(f"ring attention has no dropout yet: dropout_p must be 0, got {dropout_p}")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("query, key and value must be [b, heads, s, d]; got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape[:3] != value.shape[:3] or key.size(-1) != query.size(-1) or key.size(0) != query.size(0) \
            or key.size(2) != query.size(2):
        raise ValueError("key must be [b, groups, s, d] and value [b, groups, s, dv] for query [b, heads, s, d]; got "
                         f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if query.size(1) % key.size(1):
        raise ValueError(f"the key/value heads ({key.size(1)}) must divide the query heads ({query.size(1)})")
    if causal and query.size(2) % 2:
        raise ValueError(f"causal ring attention needs the two chunks of the load-balanced layout: the local "
                         f"sequence length must be even, got {query.size(2)}")
