"""Ring attention: context parallelism by passing key/value blocks around a ring (Megatron-Core's
--cp-comm-type p2p), and its all-gather variant (--cp-comm-type allgather). Each of the CP ranks holds a part
of the sequence of every tensor (queries, keys, values); key/value blocks (GQA's key/value heads as they are,
never expanded) travel rank to rank with dist.batch_isend_irecv while the block in hand computes, and each
block's partial output is merged into the running one by the log-sum-exp of its rows (online softmax), so that
the result is exact. The backward runs the ring again: dQ accumulates where the queries live, dK and dV (in fp32
or wider) travel with their key/value block and arrive back at their owner after a full turn.

    split_for_context_parallel(tensor, cp_size, cp_rank, dim=0) -> the rank's part of a whole-sequence tensor
    join_context_parallel_parts(parts, dim=0) -> the whole sequence from every rank's part, in rank order
    gather_from_context_parallel(tensor, group, dim=0) -> join of every rank's part, on every rank
    ring_attention(query, key, value, group, causal=True, softmax_scale=None, dropout_p=0.0, seed=None) -> context
    all_gather_attention(query, key, value, group, causal=True, softmax_scale=None, dropout_p=0.0, seed=None)
        -> the same context, every rank's keys and values gathered at once

and the parts they are made of:

    visible_part(rank, owner, local_length, causal) -> what rank's queries see of owner's key/value block
    gathered_parts(rank, cp_size, local_length, causal) -> all_gather_attention's blocks of the whole sequence
    attention_block(query, key, value, scale, causal, dropout=None) -> (output, log-sum-exp) of one block
    attention_block_backward(query, key, value, out, grad_out, lse, scale, causal, dropout=None) -> (dq, dk, dv)
    math_block / math_block_backward -> the same in plain PyTorch (the reference; fp64, dropout)
    kernel_block / kernel_block_backward -> the same through torch's flash kernels
    kernel_serves(query, value, dropout=None) -> whether the kernels compute a block
    merge_block(out, lse, block_out, block_lse) -> a block folded into the running output, in place
    compute_dtype(dtype) -> the dtype blocks compute and merge in

The layout is core attention's (attention.py): query [b, heads, s_local, d], key [b, groups, s_local, d] and
value [b, groups, s_local, dv], groups dividing heads (query head h uses key/value head h // (heads / groups));
the context is [b, heads, s_local, dv]. The scores are scaled by softmax_scale, 1 / sqrt(d) by default.

Causal load balancing (Megatron-Core's and torchtitan's): the sequence is cut into 2 x CP chunks and rank i holds
chunks i and 2 CP - 1 - i (core/sequence_split.py's load_balanced_chunks), so every rank has as many visible (query,
key) pairs as any other. With that layout a key/value block of another rank is, for this rank's queries, either fully
visible or fully masked in halves (see visible_part); only a rank's own block needs the causal mask. Non-causal
attention does not depend on where a rank's tokens lie in the sequence: any split of it works, this one included.

all_gather_attention gathers every rank's key/value block (unexpanded) and joins them into the whole sequence;
each of the rank's two query chunks then attends to the keys before its chunk (no mask) and to its own chunk
(causal mask), blocks merged as the ring's are (gathered_parts). Its backward gathers the keys and values again
rather than keep the whole sequence's, computes dQ locally, and reduce-scatters the whole sequence's dK and dV
(in fp32 or wider) to their owners, each in its owner's layout. It sends (CP - 1) / CP of the sequence's keys
and values at once, where the ring overlaps each block's transfer with the previous block's compute.

Each block runs attention_block (forward: output and log-sum-exp) and attention_block_backward, which is given
the whole attention's output and log-sum-exp of the block's query rows. Without dropout, in fp32 or bf16 on a
CPU and fp16 or bf16 on CUDA (head dim = value head dim, on CUDA a multiple of 8 up to 256), they run torch's
flash kernels that return the log-sum-exp (aten._scaled_dot_product_flash_attention[_for_cpu] and their
backwards; the CUDA calls are written from the ops' schemas and untested); otherwise plain PyTorch math in fp32,
or the inputs' dtype if wider. Blocks merge in fp32 or wider either way.

Dropout (dropout_p, with seed: a 0-d int64 tensor, the same on every rank, as counter_hash.draw_seed gives) drops
exactly what the model's flash op (fusions/flash_attention.py) drops on the whole sequence at that seed: the counter
hash of row (batch x heads + head) x s + the query's global position, s the whole sequence's length, and column the
key's global position. As there, it drops normalised probabilities: each block's log-sum-exp is that of its scores
without dropout (so blocks merge as without it), and only its output sums the dropped ones, scaled by 1 / (1 - p).
Backward takes the softmax's row term as delta = rowsum(dO x O) of the dropped output.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ds.core.fusions.counter_hash import column_mixes, drop_threshold, keep_from_mixes, row_hashes
from megatron_ds.core.sequence_split import context_parallel_positions, load_balanced_chunks

# ---------------------------------------------------------------------------------------------------------------
# Where each rank's tokens lie in the sequence


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
    """The queries (a slice of the rank's) and keys (a slice of the block's: the owner's, or all_gather_attention's
    whole sequence) that attend, and whether they need the causal mask (sq == sk tokens in the same order)."""
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


def gathered_parts(rank, cp_size, local_length, causal):
    """The blocks all_gather_attention computes for rank's queries against the whole sequence's keys. Causal: each
    query chunk (global chunk c, of local_length / 2 tokens) sees the keys of chunks before c whole and its own
    chunk's keys causally; the parts cover every visible (query, key) pair once."""
    sequence_length = local_length * cp_size
    if not causal:
        return [VisiblePart(_EVERYTHING, slice(0, sequence_length), False)]
    chunk, parts = local_length // 2, []
    for half, global_chunk in enumerate((rank, 2 * cp_size - 1 - rank)):
        queries, start = slice(half * chunk, (half + 1) * chunk), global_chunk * chunk
        if start:
            parts.append(VisiblePart(queries, slice(0, start), False))
        parts.append(VisiblePart(queries, slice(start, start + chunk), True))
    return parts


# ---------------------------------------------------------------------------------------------------------------
# Dropout: the flash op's mask of the whole sequence


@dataclass(frozen=True)
class BlockDropout:
    """The keep mask [b, heads, sq, sk] of one block's probabilities and the scale of the kept ones."""
    keep: torch.Tensor
    keep_scale: float

    def apply(self, probs):
        """probs [b, groups, heads / groups, sq, sk] with the dropped ones zeroed and the kept ones scaled."""
        return torch.where(self.keep.view(probs.shape), probs * self.keep_scale, 0.0)


@dataclass(frozen=True)
class HashedDropout:
    """One call's dropout: probability p, the call's seed, the whole sequence's length (every rank's tokens)."""
    p: float
    seed: torch.Tensor
    sequence_length: int

    def block(self, query, query_positions, key_positions):
        """The BlockDropout of query's rows [b, heads, sq, d] at global query_positions [sq] against the keys at
        global key_positions [sk]: the flash op's rows are (batch x heads + head) x s + position."""
        b, heads, sq = query.shape[:3]
        heads_first = torch.arange(b * heads, device=query.device).view(b, heads, 1) * self.sequence_length
        rows = row_hashes(self.seed, heads_first + query_positions.to(query.device))
        keep = keep_from_mixes(rows.view(-1), column_mixes(key_positions.to(query.device)), drop_threshold(self.p))
        return BlockDropout(keep.view(b, heads, sq, key_positions.numel()), 1.0 / (1.0 - self.p))


# ---------------------------------------------------------------------------------------------------------------
# One block's attention: plain math in fp32 or wider, or torch's flash kernels (the replaceable part)


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


def attention_block(query, key, value, scale, causal, dropout=None):
    """softmax(Q K^T scale) V of one block, and the log-sum-exp of each query row: ([b, heads, sq, dv],
    [b, heads, sq]) in compute_dtype. causal: the mask of sq == sk tokens in the same order. dropout: a
    BlockDropout, applied to the probabilities after the log-sum-exp. A kernel computes it where one serves."""
    if kernel_serves(query, value, dropout):
        return kernel_block(query, key, value, scale, causal)
    return math_block(query, key, value, scale, causal, dropout)


def attention_block_backward(query, key, value, out, grad_out, lse, scale, causal, dropout=None):
    """Gradients (dq [b, heads, sq, d], dk [b, groups, sk, d], dv [b, groups, sk, dv]) of one block, in
    compute_dtype, given the whole attention's output and log-sum-exp of its query rows. dropout: the forward's."""
    if kernel_serves(query, value, dropout):
        return kernel_block_backward(query, key, value, out, grad_out, lse, scale, causal)
    return math_block_backward(query, key, value, out, grad_out, lse, scale, causal, dropout)


def math_block(query, key, value, scale, causal, dropout=None):
    """attention_block in plain PyTorch, in compute_dtype (any dtype, dropout, any value head dim)."""
    dtype = compute_dtype(query.dtype)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    scores = _block_scores(query, key, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if dropout is not None:
        probs = dropout.apply(probs)
    out = torch.matmul(probs, value.unsqueeze(2))
    return out.flatten(1, 2), lse.flatten(1, 2)


def math_block_backward(query, key, value, out, grad_out, lse, scale, causal, dropout=None):
    """attention_block_backward in plain PyTorch: the block's probabilities are exp(scores - lse), the softmax's
    row term is delta = rowsum(dO * O), O the whole (dropped) output, as the flash op's kernels take it."""
    dtype, groups = compute_dtype(query.dtype), key.size(1)
    query, key, value, grad_out = (t.to(dtype) for t in (query, key, value, grad_out))
    delta = (grad_out * out.to(dtype)).sum(-1)
    probs = torch.exp(_block_scores(query, key, scale, causal) - _by_group(lse, groups).unsqueeze(-1))
    dropped = probs if dropout is None else dropout.apply(probs)
    grad_out = _by_group(grad_out, groups)
    grad_value = torch.matmul(dropped.transpose(-1, -2), grad_out).sum(2)
    grad_probs = torch.matmul(grad_out, value.unsqueeze(2).transpose(-1, -2))
    if dropout is not None:
        grad_probs = dropout.apply(grad_probs)
    grad_scores = probs * (grad_probs - _by_group(delta, groups).unsqueeze(-1)) * scale
    grad_query = torch.matmul(grad_scores, key.unsqueeze(2)).flatten(1, 2)
    grad_key = torch.matmul(grad_scores.transpose(-1, -2), _by_group(query, groups)).sum(2)
    return grad_query, grad_key, grad_value


# the dtypes torch's flash kernels take, by device type (the CPU's in fp64 too, but fp64 keeps the math)
_KERNEL_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.float16, torch.bfloat16)}
_CUDA_FLASH_HEAD_DIMS = range(8, 257, 8)


def kernel_serves(query, value, dropout=None):
    """Whether kernel_block computes this block: no dropout (the kernels' own is not the flash op's mask), the
    value's head dim the query's, a dtype the device's kernel takes (and on CUDA a head dim flash takes)."""
    if dropout is not None or value.size(-1) != query.size(-1):
        return False
    if query.dtype not in _KERNEL_DTYPES.get(query.device.type, ()):
        return False
    if query.device.type == "cpu":
        return True
    return (query.size(-1) in _CUDA_FLASH_HEAD_DIMS and torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(query.device) >= (8, 0))  # flash 2 needs Ampere or later


def kernel_block(query, key, value, scale, causal):
    """attention_block through torch's flash kernel (GQA's key/value heads as they are), its output and
    log-sum-exp returned in compute_dtype. The CUDA call is written from the op's schema, untested."""
    if query.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False,
                                                                      scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal,
                                                                              scale=scale)
    dtype = compute_dtype(query.dtype)
    return out.to(dtype), lse.to(dtype)


def kernel_block_backward(query, key, value, out, grad_out, lse, scale, causal):
    """attention_block_backward through torch's flash backward kernel, which takes delta = rowsum(dO * O) from
    the output it is given (rounded to the inputs' dtype) and the fp32 log-sum-exp; gradients in compute_dtype.
    The CUDA call is written from the op's schema, untested."""
    out, grad_out, lse = out.to(query.dtype), grad_out.to(query.dtype), lse.float().contiguous()
    if query.device.type == "cuda":
        # no dropout: the philox seed and offset are never read (their shapes are the forward's)
        seed = torch.empty(2, dtype=torch.uint64, device=query.device)
        offset = torch.empty((), dtype=torch.uint64, device=query.device)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, query, key, value, out, lse, None, None, query.size(2), key.size(2), 0.0, causal, seed, offset,
            scale=scale)
    else:
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, causal, scale=scale)
    dtype = compute_dtype(query.dtype)
    return tuple(grad.to(dtype) for grad in grads)


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


class _BlockDropouts:
    """Each block's dropout (None without dropout): its mask from the global positions of this rank's queries and
    of the block's keys."""

    def __init__(self, query, group, dropout):
        self.size, self.rank, self.local_length = dist.get_world_size(group), dist.get_rank(group), query.size(2)
        self.dropout = dropout

    def _positions(self, rank):
        return context_parallel_positions(self.local_length * self.size, self.size, rank)

    def of(self, query, part, owner=None):
        """The BlockDropout of this rank's queries part.queries against the keys part.keys of owner's block, or of
        the whole sequence (owner None)."""
        if self.dropout is None:
            return None
        keys = torch.arange(self.local_length * self.size) if owner is None else self._positions(owner)
        return self.dropout.block(query, self._positions(self.rank)[part.queries], keys[part.keys])


def _kept_for_backward(ctx, tensors, group, causal, scale, dropout):
    """Both variants' forward ends here: what their backward reads kept, the output returned in the query's dtype."""
    ctx.save_for_backward(*tensors)
    ctx.group, ctx.causal, ctx.scale, ctx.dropout = group, causal, scale, dropout
    query, out = tensors[0], tensors[3]
    return out.to(query.dtype)


class RingAttention(torch.autograd.Function):
    """Ring attention over a process group (see the module docstring); ring_attention checks the inputs."""

    @staticmethod
    def forward(ctx, query, key, value, group, causal, scale, dropout):
        size, rank, local_length = dist.get_world_size(group), dist.get_rank(group), query.size(2)
        dropouts = _BlockDropouts(query, group, dropout)
        out, lse, block = None, None, (key, value)
        for step in range(size):
            exchange = _RingExchange(block, group) if step + 1 < size else None
            owner = (rank - step) % size
            part = visible_part(rank, owner, local_length, causal)
            queries = query[:, :, part.queries]
            block_out, block_lse = attention_block(queries, block[0][:, :, part.keys], block[1][:, :, part.keys],
                                                   scale, part.causal, dropouts.of(queries, part, owner))
            if step == 0:  # a rank's own block reaches every one of its queries: nothing to merge yet
                out, lse = block_out, block_lse
            else:
                merge_block(out[:, :, part.queries], lse[:, :, part.queries], block_out, block_lse)
            if exchange is not None:
                block = exchange.wait()
        return _kept_for_backward(ctx, (query, key, value, out, lse), group, causal, scale, dropout)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        size, rank, local_length = dist.get_world_size(group), dist.get_rank(group), query.size(2)
        dropouts = _BlockDropouts(query, group, ctx.dropout)
        grad_query = torch.zeros_like(query, dtype=out.dtype)
        block, grads_in_flight = (key, value), None
        for step in range(size):
            exchange = _RingExchange(block, group) if step + 1 < size else None
            owner = (rank - step) % size
            part = visible_part(rank, owner, local_length, causal)
            queries = query[:, :, part.queries]
            dq, dk, dv = attention_block_backward(queries, block[0][:, :, part.keys], block[1][:, :, part.keys],
                                                  out[:, :, part.queries], grad_out[:, :, part.queries],
                                                  lse[:, :, part.queries], scale, part.causal,
                                                  dropouts.of(queries, part, owner))
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
        return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), None, None, None,
                None)


def ring_attention(query, key, value, group=None, causal=True, softmax_scale=None, dropout_p=0.0, seed=None):
    """Attention of this CP rank's queries over the whole sequence's keys and values, the key/value blocks
    passed around group's ring: context [b, heads, s_local, dv] (layout, causal split and dropout: the module
    docstring). Every rank of group calls it with its own part of the same sequence (and the same seed)."""
    _check_inputs(query, key, value, causal, dropout_p, seed)
    return RingAttention.apply(query, key, value, group, causal, _scale_of(query, softmax_scale),
                               _dropout_of(query, group, dropout_p, seed))


class AllGatherAttention(torch.autograd.Function):
    """The all-gather variant over a process group (see the module docstring); all_gather_attention checks the
    inputs."""

    @staticmethod
    def forward(ctx, query, key, value, group, causal, scale, dropout):
        size, rank, local_length = dist.get_world_size(group), dist.get_rank(group), query.size(2)
        dropouts = _BlockDropouts(query, group, dropout)
        whole_key, whole_value = (gather_from_context_parallel(t, group, dim=2) for t in (key, value))
        dtype = compute_dtype(query.dtype)
        out = query.new_zeros((*query.shape[:3], value.size(-1)), dtype=dtype)
        lse = torch.full(query.shape[:3], float("-inf"), dtype=dtype, device=query.device)
        for part in gathered_parts(rank, size, local_length, causal):
            queries = query[:, :, part.queries]
            block_out, block_lse = attention_block(queries, whole_key[:, :, part.keys], whole_value[:, :, part.keys],
                                                   scale, part.causal, dropouts.of(queries, part))
            merge_block(out[:, :, part.queries], lse[:, :, part.queries], block_out, block_lse)
        return _kept_for_backward(ctx, (query, key, value, out, lse), group, causal, scale, dropout)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        group = ctx.group
        size, rank, local_length = dist.get_world_size(group), dist.get_rank(group), query.size(2)
        dropouts = _BlockDropouts(query, group, ctx.dropout)
        whole_key, whole_value = (gather_from_context_parallel(t, group, dim=2) for t in (key, value))
        grad_query = torch.zeros_like(query, dtype=out.dtype)
        grad_key, grad_value = (torch.zeros_like(t, dtype=out.dtype) for t in (whole_key, whole_value))
        for part in gathered_parts(rank, size, local_length, ctx.causal):
            queries = query[:, :, part.queries]
            dq, dk, dv = attention_block_backward(queries, whole_key[:, :, part.keys], whole_value[:, :, part.keys],
                                                  out[:, :, part.queries], grad_out[:, :, part.queries],
                                                  lse[:, :, part.queries], ctx.scale, part.causal,
                                                  dropouts.of(queries, part))
            grad_query[:, :, part.queries] += dq
            grad_key[:, :, part.keys] += dk
            grad_value[:, :, part.keys] += dv
        grad_key, grad_value = (_reduce_scatter_to_owners(t, group) for t in (grad_key, grad_value))
        return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), None, None, None,
                None)


def _reduce_scatter_to_owners(whole, group):
    """A whole-sequence tensor [b, x, s, y] summed over group, each rank given its own part (in its layout)."""
    size = dist.get_world_size(group)
    parts = [split_for_context_parallel(whole, size, owner, dim=2) for owner in range(size)]
    mine = torch.empty_like(parts[0])
    dist.reduce_scatter(mine, parts, group=group)
    return mine


def all_gather_attention(query, key, value, group=None, causal=True, softmax_scale=None, dropout_p=0.0, seed=None):
    """ring_attention's result with every rank's keys and values gathered at once (Megatron-Core's
    --cp-comm-type allgather): the same arguments, layout and dropout mask."""
    _check_inputs(query, key, value, causal, dropout_p, seed)
    return AllGatherAttention.apply(query, key, value, group, causal, _scale_of(query, softmax_scale),
                                    _dropout_of(query, group, dropout_p, seed))


def _scale_of(query, softmax_scale):
    return 1.0 / math.sqrt(query.size(-1)) if softmax_scale is None else softmax_scale


def _dropout_of(query, group, dropout_p, seed):
    """The call's HashedDropout over the whole sequence (every rank's part), None without dropout."""
    if not dropout_p:
        return None
    return HashedDropout(dropout_p, seed, query.size(2) * dist.get_world_size(group))


def _check_inputs(query, key, value, causal, dropout_p, seed):
    drop_threshold(dropout_p)  # names a probability outside [0, 1)
    if dropout_p and seed is None:
        raise ValueError(f"dropout_p {dropout_p} needs a seed: a 0-d int64 tensor, the same on every rank")
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
        raise ValueError(f"causal context parallel attention needs the two chunks of the load-balanced layout: "
                         f"the local sequence length must be even, got {query.size(2)}")
