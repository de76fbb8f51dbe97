"""Causal attention with dropout on the probabilities, computed in blocks of queries so that the [s, s]
probabilities of all heads are never held at once, flash-style: forward saves q, k, v and one fp32 log-sum-exp
per query row, and without dropout the output; backward recomputes the probabilities block by block. Without
dropout it takes the softmax gradient's row term as delta = rowsum(dO * O), once per call, as the triton kernels
do: summed as rowsum(P * dP) over each block's keys, inductor wrote the fp32 probabilities out and read them
twice (1.4x the backward's time at the LLaMA row's shapes). With dropout that sum costs the same as delta, and it
stays: it is the more accurate one (O is rounded to the input dtype), and the triton kernels are tested against it.
The output is stored [s, b, heads, d] (returned as a [b, heads, s, d] view), so the model's reshape of it for
the output projection is a view and the saved output costs no memory of its own.

    flash_attention(query, key, value, dropout_p, seed, scale=None) -> context [b, heads, sq, dv]

query is [b, heads, sq, d]; key [b, groups, sk, d] and value [b, groups, sk, dv], where groups divides heads
(grouped-query attention: the heads of a group share its key and value, never expanded to every head) and dv
may differ from d (multi-latent attention). The scores are scaled by `scale`, 1 / sqrt(d) by default.

The dropout mask is the model's counter hash (counter_hash.py) of (seed, row, key), where
row = (batch * heads + head) * s + query and `seed` is drawn once per call (`draw_seed`): every backend
(reference, compile, triton) computes the same mask bit for bit, and nothing but the seed is kept for backward.

Matmuls run in the input dtype (fp32 accumulation), softmax and its statistics in fp32, as scaled dot
product attention's math path does.

The triton backend is flash attention proper: a forward kernel per query block (online softmax, key blocks in
the causal future skipped), and a backward of one kernel for dQ over query blocks, which also stores
delta = rowsum(dO * O), then one for dK and dV over key blocks; both regenerate the keep mask from the hash.
"""
import math

import torch
import torch.nn.functional as F

from megatron_ds.core.fusions._triton import cdiv, check_device, kernel, next_power_of_2, tl
from megatron_ds.core.fusions.backends import FusedOp, compiled
from megatron_ds.core.fusions.counter_hash import (
    column_mixes,
    device_function,
    drop_threshold,
    keep_from_mixes,
    keep_tile,
    row_hashes,
)

# Queries per block: a multiple of 64, and at most 8 blocks per call. On a 2-core CPU (bf16, s 512) blocks of 64
# took 0.70-0.84x the backward time of blocks of 128 (the forward's within 3%); the cap bounds the one compiled
# graph per call, which unrolls every block (at s 2048, 56 s to compile 16 blocks, 101 s for 32; one run each).
BLOCK_MULTIPLE, MAX_BLOCKS = 64, 8


def queries_per_block(sq: int) -> int:
    return BLOCK_MULTIPLE * max(1, math.ceil(sq / (BLOCK_MULTIPLE * MAX_BLOCKS)))


def _block_probabilities(q, k, positions, sq, sk, scale, lse=None):
    """fp32 softmax probabilities [b, g, rows, kend] of one block's query rows at `positions` (causal), and
    their log-sum-exp (given in backward, where the forward's is reused)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    keys = torch.arange(k.size(-2), device=q.device, dtype=torch.int32)
    scores = scores.masked_fill(keys[None, :] > positions[:, None] + (sk - sq), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]), lse


def _block_keep(row_hash, column_mix, threshold):
    """The keep mask [b, g, rows, keys] of one block, from its rows' hashes [b, g, rows] and its keys' mixes."""
    return keep_from_mixes(row_hash.reshape(-1), column_mix, threshold).view(*row_hash.shape, column_mix.numel())


def _forward_block(q_block, k_part, v_part, positions, row_hash, column_mix, sq, sk, threshold, keep_scale, scale):
    probs, lse = _block_probabilities(q_block, k_part, positions, sq, sk, scale)
    if threshold:
        probs = torch.where(_block_keep(row_hash, column_mix, threshold), probs * keep_scale, 0.0)
    return torch.matmul(probs.to(v_part.dtype), v_part), lse


def _backward_block(q_block, k_part, v_part, grad_block, lse, delta, positions, row_hash, column_mix, sq, sk, threshold,
                    keep_scale, scale):
    """Gradients of one block: dq for its query rows, dk and dv contributions over its keys (delta: its rows'
    rowsum(dO * O), None with dropout)."""
    probs, _ = _block_probabilities(q_block, k_part, positions, sq, sk, scale, lse)
    grad_dropped = torch.matmul(grad_block, v_part.transpose(-1, -2)).float()
    if threshold:
        keep = _block_keep(row_hash, column_mix, threshold)
        dropped = torch.where(keep, probs * keep_scale, 0.0)
        grad_probs = torch.where(keep, grad_dropped * keep_scale, 0.0)
    else:
        dropped, grad_probs = probs, grad_dropped
    row_term = (probs * grad_probs).sum(-1, keepdim=True) if delta is None else delta.unsqueeze(-1)
    grad_scores = probs * (grad_probs - row_term) * scale
    grad_scores = grad_scores.to(q_block.dtype)
    grad_q = torch.matmul(grad_scores, k_part)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q_block)
    grad_v = torch.matmul(dropped.to(grad_block.dtype).transpose(-1, -2), grad_block)
    return grad_q, grad_k, grad_v


class _Blocks:
    """The blocks of queries of one call, in the grouped layout: the heads that share a key and value head
    (GQA's group; one head without GQA) and a block of their queries form one matmul's rows, [b, g, hpg x bq].
    Each block sees the keys up to its last query (causal); positions are tensors (an int position would make
    torch.compile specialise on it)."""

    def __init__(self, query, key):
        self.b, heads, self.sq, self.d = query.shape
        self.groups, self.sk = key.size(1), key.size(2)
        self.per_group = heads // self.groups
        # int32: inductor's vectorised mask is half the work of int64's (the forward 0.78x the time at s 512)
        self.positions = torch.arange(self.sq, device=query.device, dtype=torch.int32)
        self.block_size = queries_per_block(self.sq)

    def __iter__(self):
        """(the block's query slice, how many keys it sees, its rows' positions)."""
        for start in range(0, self.sq, self.block_size):
            block = slice(start, min(self.sq, start + self.block_size))
            yield block, min(self.sk, block.stop + self.sk - self.sq), self.positions[block].repeat(self.per_group)

    def grouped(self, tensor):
        """[b, heads, s, ...] -> [b, g, hpg, s, ...] (a view)."""
        return tensor.view(self.b, self.groups, self.per_group, *tensor.shape[2:])

    def rows_of(self, tensor, block):
        """The block's [b, g, hpg x bq, ...] rows of a [b, heads, s, ...] tensor (None stays None)."""
        if tensor is None:
            return None
        part = self.grouped(tensor)[:, :, :, block]
        return part.reshape(self.b, self.groups, -1, *part.shape[4:])

    @staticmethod
    def first_keys(key, value, keys):
        """key and value [b, g, keys, d] of the first `keys` keys, compact copies: a matmul given a slice of fewer
        keys than sk would copy it itself, outside the compiled graph (one dispatch per copy)."""
        return key[:, :, :keys].contiguous(), value[:, :, :keys].contiguous()

    @staticmethod
    def keys_of(column_mix, keys):
        """The mixes of the first `keys` keys (None stays None)."""
        return None if column_mix is None else column_mix[:keys]

    def joined(self, parts):
        """The blocks' [b, g, hpg x bq, ...] results, in order, as one [b, heads, s, ...] tensor."""
        whole = torch.cat([part.view(self.b, self.groups, self.per_group, -1, *part.shape[3:]) for part in parts], 3)
        return whole.view(self.b, self.groups * self.per_group, self.sq, *whole.shape[4:])


def _forward_blocks(query, key, value, row_hash, column_mix, threshold: int, keep_scale: float, scale: float):
    """The output and the fp32 log-sum-exp per row of every block, in one function (one compiled graph for the
    compile backend: one dispatch per call, not one per block). row_hash [b, heads, s] and column_mix [sk]: the
    dropout hash's halves, None without dropout."""
    blocks = _Blocks(query, key)
    outs, lses = [], []
    for block, keys, positions in blocks:
        out, lse = _forward_block(blocks.rows_of(query, block), *blocks.first_keys(key, value, keys), positions,
                                  blocks.rows_of(row_hash, block), blocks.keys_of(column_mix, keys),
                                  blocks.sq, blocks.sk, threshold, keep_scale, scale)
        outs.append(out)
        lses.append(lse)
    return blocks.joined(outs).permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3), blocks.joined(lses)


def _backward_blocks(query, key, value, out, grad_out, lse, row_hash, column_mix, threshold: int, keep_scale: float,
                     scale: float):
    """dq, dk, dv of every block, in one function; dk and dv summed over the blocks in fp32."""
    blocks = _Blocks(query, key)
    grad_queries = []
    grad_key = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
    grad_value = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
    delta = None if threshold else (grad_out.float() * out.float()).sum(-1)  # [b, heads, s]
    for block, keys, positions in blocks:
        rows = (blocks.rows_of(t, block) for t in (query, grad_out, lse, delta, row_hash))
        q_rows, grad_rows, lse_rows, delta_rows, hash_rows = rows
        dq, dk, dv = _backward_block(q_rows, *blocks.first_keys(key, value, keys), grad_rows, lse_rows, delta_rows,
                                     positions, hash_rows, blocks.keys_of(column_mix, keys), blocks.sq, blocks.sk,
                                     threshold, keep_scale, scale)
        grad_queries.append(dq)
        unseen = (0, 0, 0, blocks.sk - keys)  # the keys after the block's last query get nothing from it
        grad_key = grad_key + F.pad(dk.float(), unseen)
        grad_value = grad_value + F.pad(dv.float(), unseen)
    return blocks.joined(grad_queries), grad_key.to(key.dtype), grad_value.to(value.dtype)


def _hash_halves(query, key, seed, threshold):
    """With dropout, the hash's halves, computed once per call outside any compiled graph: every row's hash
    (row = (batch * heads + head) * s + query) [b, heads, s] and every key's mix [sk]; (None, None) without."""
    if not threshold:
        return None, None
    b, heads, sq = query.shape[:3]
    rows = torch.arange(b * heads * sq, device=query.device).view(b, heads, sq)
    return row_hashes(seed, rows), column_mixes(torch.arange(key.size(2), device=query.device))


class _BlockedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, dropout_p, seed, compile_blocks, scale):
        forward_blocks = compiled(_forward_blocks, dynamic=False) if compile_blocks else _forward_blocks
        # once here, not in every block's matmuls: the model passes [s, b, heads, d] tensors permuted to heads-first
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        threshold, keep_scale = drop_threshold(dropout_p), 1.0 / (1.0 - dropout_p)
        out, lse = forward_blocks(query, key, value, *_hash_halves(query, key, seed, threshold), threshold,
                                  keep_scale, scale)
        ctx.save_for_backward(query, key, value, None if threshold else out, lse, seed)  # out: for delta
        ctx.threshold, ctx.keep_scale, ctx.compile_blocks, ctx.scale = threshold, keep_scale, compile_blocks, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, seed = ctx.saved_tensors
        backward_blocks = compiled(_backward_blocks, dynamic=False) if ctx.compile_blocks else _backward_blocks
        grads = backward_blocks(query, key, value, out, grad_out, lse,
                                *_hash_halves(query, key, seed, ctx.threshold), ctx.threshold, ctx.keep_scale,
                                ctx.scale)
        return (*grads, None, None, None, None)


def _check(query, key, value):
    if query.dim() != 4 or key.dim() != 4 or key.shape[:-1] != value.shape[:-1] or query.size(0) != key.size(0) \
            or query.size(1) % key.size(1) or query.size(-1) != key.size(-1) or query.size(-2) > key.size(-2):
        raise ValueError(f"flash_attention expects query [b, heads, sq, d], key [b, groups, sk, d] and value "
                         f"[b, groups, sk, dv] with groups dividing heads and sq <= sk; got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")


def _scale_of(query, scale):
    return 1.0 / math.sqrt(query.size(-1)) if scale is None else float(scale)


def flash_attention_reference(query, key, value, dropout_p: float, seed, scale=None):
    """Blocked causal attention with hashed dropout, in eager PyTorch."""
    _check(query, key, value)
    return _BlockedAttention.apply(query, key, value, dropout_p, seed, False, _scale_of(query, scale))


def flash_attention_compile(query, key, value, dropout_p: float, seed, scale=None):
    """The same blocks through torch.compile, all of a call's blocks in one graph for forward and one for
    backward (one fused loop for the mask, the softmax and the dropout between the matmuls; a graph per block
    cost ~0.5 ms of guard checks per call and per block, and the blocks' results were copied into place)."""
    _check(query, key, value)
    return _BlockedAttention.apply(query, key, value, dropout_p, seed, True, _scale_of(query, scale))


class _KernelFootprint(torch.autograd.Function):
    """Shapes only: what the GPU's flash kernels (torch's scaled_dot_product_attention, this module's triton
    ones) keep for backward - q, k, v, the output and the fp32 log-sum-exp per query row - and the gradients
    they allocate, without the math."""

    @staticmethod
    def forward(ctx, query, key, value):
        out = query.new_empty((*query.shape[:-1], value.size(-1)))
        lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def flash_attention_footprint(query, key, value, copies=False):
    """For fake tensors (tools/dry_run.py), which have no values for the blocks' math to work on: the memory a
    GPU's flash attention holds, whose blocks stay on chip (the CPU's math path would keep fp32 s x s scores).
    copies: the flash_attention op's triton kernel, which saves contiguous copies of q, k and v, grouped key and
    value heads repeated to one per query head as it takes them; else sdpa's kernels, which save the tensors they
    are given, views included, and grouped heads as they are (enable_gqa: attention.sdpa_takes_grouped_heads)."""
    _check(query, key, value)
    if not copies:
        return _KernelFootprint.apply(query, key, value)
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    return _KernelFootprint.apply(query, *_per_query_head(query, key, value))


def _per_query_head(query, key, value):
    """Key and value with one head per query head (grouped ones repeated), as the kernels take them."""
    per_group = query.size(1) // key.size(1)
    if per_group > 1:
        return key.repeat_interleave(per_group, dim=1), value.repeat_interleave(per_group, dim=1)
    return key, value


@device_function
def _load_tile(ptr, rows, n_rows, channels, d):
    """Rows of a contiguous [n_rows, d] matrix, zero outside it."""
    inside = (rows < n_rows)[:, None] & (channels < d)[None, :]
    return tl.load(ptr + rows[:, None] * d + channels[None, :], mask=inside, other=0.0)


@device_function
def _store_tile(ptr, value, rows, n_rows, channels, d):
    inside = (rows < n_rows)[:, None] & (channels < d)[None, :]
    tl.store(ptr + rows[:, None] * d + channels[None, :], value.to(ptr.dtype.element_ty), mask=inside)


@device_function
def _dot(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32; fp32 inputs multiply in full precision ("ieee", not tf32), as torch.matmul's
    default. UPCAST (the interpreter): its tl.dot multiplies bf16 bit patterns as integers (triton-lang/triton#11584),
    so operands go to fp32 first, which is exact for the products."""
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@device_function
def _scores(q, k, queries, keys, sq, sk, scale, UPCAST: tl.constexpr):
    """Scaled fp32 scores of a tile, -inf past sk and in a query's causal future."""
    scores = _dot(q, tl.trans(k), UPCAST) * scale
    visible = (keys[None, :] <= queries[:, None] + (sk - sq)) & (keys < sk)[None, :]
    return tl.where(visible, scores, float("-inf"))


@device_function
def _tile_gradients(q, k, v, do, lse, delta, queries, keys, rows, sq, sk, scale, SEED, threshold, keep_scale,
                    DROPOUT: tl.constexpr, UPCAST: tl.constexpr):
    """The recomputed probabilities after dropout, and the scores' gradient dS, of one [queries, keys] tile."""
    probs = tl.exp(_scores(q, k, queries, keys, sq, sk, scale, UPCAST) - lse[:, None])
    grad_probs = _dot(do, tl.trans(v), UPCAST)
    dropped = probs
    if DROPOUT:
        keep = keep_tile(SEED, rows, keys, threshold)
        dropped = tl.where(keep, probs * keep_scale, 0.0)
        grad_probs = tl.where(keep, grad_probs * keep_scale, 0.0)
    return dropped, probs * (grad_probs - delta[:, None]) * scale


@kernel
def _attention_forward(Q, K, V, OUT, LSE, SEED, sq, sk, d, e, scale, threshold, keep_scale, DROPOUT: tl.constexpr,
                       UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_E: tl.constexpr):
    """One block of queries of one (batch, head): online softmax over the key blocks it can see (d: the query's
    and key's head dim, e: the value's)."""
    head = tl.program_id(1).to(tl.int64)  # over b * heads
    queries = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = head * sq + queries
    channels = tl.arange(0, BLOCK_D)
    value_channels = tl.arange(0, BLOCK_E)
    q = _load_tile(Q + head * sq * d, queries, sq, channels, d)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    # every row sees key 0 (rows past sq see every key), so row_max is finite from the first block on
    for start in range(0, tl.minimum(sk, (tl.program_id(0) + 1) * BLOCK_M + sk - sq), BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k = _load_tile(K + head * sk * d, keys, sk, channels, d)
        v = _load_tile(V + head * sk * e, keys, sk, value_channels, e)
        scores = _scores(q, k, queries, keys, sq, sk, scale, UPCAST)
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        correction = tl.exp(row_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        if DROPOUT:  # after the sum: the softmax normalises over every key, dropped or not
            probs = tl.where(keep_tile(SEED, rows, keys, threshold), probs * keep_scale, 0.0)
        acc = acc * correction[:, None] + _dot(probs.to(v.dtype), v, UPCAST)
        row_max = new_max
    _store_tile(OUT + head * sq * e, acc / row_sum[:, None], queries, sq, value_channels, e)
    tl.store(LSE + rows, row_max + tl.log(row_sum), mask=queries < sq)


@kernel
def _attention_backward_q(Q, K, V, OUT, DO, LSE, DELTA, DQ, SEED, sq, sk, d, e, scale, threshold, keep_scale,
                          DROPOUT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
    """dQ of one block of queries over the key blocks it can see. Also stores its rows' delta = rowsum(dO * O),
    which _attention_backward_kv, launched after it, reads."""
    head = tl.program_id(1).to(tl.int64)
    queries = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = head * sq + queries
    channels = tl.arange(0, BLOCK_D)
    value_channels = tl.arange(0, BLOCK_E)
    q = _load_tile(Q + head * sq * d, queries, sq, channels, d)
    do = _load_tile(DO + head * sq * e, queries, sq, value_channels, e)
    out = _load_tile(OUT + head * sq * e, queries, sq, value_channels, e)
    delta = tl.sum(do.to(tl.float32) * out.to(tl.float32), axis=1)
    tl.store(DELTA + rows, delta, mask=queries < sq)
    lse = tl.load(LSE + rows, mask=queries < sq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, tl.minimum(sk, (tl.program_id(0) + 1) * BLOCK_M + sk - sq), BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k = _load_tile(K + head * sk * d, keys, sk, channels, d)
        v = _load_tile(V + head * sk * e, keys, sk, value_channels, e)
        _, grad_scores = _tile_gradients(q, k, v, do, lse, delta, queries, keys, rows, sq, sk, scale, SEED,
                                         threshold, keep_scale, DROPOUT, UPCAST)
        dq += _dot(grad_scores.to(k.dtype), k, UPCAST)
    _store_tile(DQ + head * sq * d, dq, queries, sq, channels, d)


@kernel
def _attention_backward_kv(Q, K, V, DO, LSE, DELTA, DK, DV, SEED, sq, sk, d, e, scale, threshold, keep_scale,
                           DROPOUT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
    """dK and dV of one block of keys over the query blocks that can see it."""
    head = tl.program_id(1).to(tl.int64)
    keys = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    channels = tl.arange(0, BLOCK_D)
    value_channels = tl.arange(0, BLOCK_E)
    k = _load_tile(K + head * sk * d, keys, sk, channels, d)
    v = _load_tile(V + head * sk * e, keys, sk, value_channels, e)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    first_query = tl.maximum(tl.program_id(0) * BLOCK_N - (sk - sq), 0) // BLOCK_M * BLOCK_M
    # rows past sq load dO = 0 and delta = 0: they add nothing
    for start in range(first_query, sq, BLOCK_M):
        queries = start + tl.arange(0, BLOCK_M)
        rows = head * sq + queries
        q = _load_tile(Q + head * sq * d, queries, sq, channels, d)
        do = _load_tile(DO + head * sq * e, queries, sq, value_channels, e)
        lse = tl.load(LSE + rows, mask=queries < sq, other=0.0)
        delta = tl.load(DELTA + rows, mask=queries < sq, other=0.0)
        dropped, grad_scores = _tile_gradients(q, k, v, do, lse, delta, queries, keys, rows, sq, sk, scale, SEED,
                                               threshold, keep_scale, DROPOUT, UPCAST)
        dv += _dot(tl.trans(dropped.to(do.dtype)), do, UPCAST)
        dk += _dot(tl.trans(grad_scores.to(q.dtype)), q, UPCAST)
    _store_tile(DK + head * sk * d, dk, keys, sk, channels, d)
    _store_tile(DV + head * sk * e, dv, keys, sk, value_channels, e)


def _meta(threshold: int, device: torch.device, d: int, e: int = None) -> dict:
    """The kernels' constexpr arguments (d: the query's and key's head dim, e: the value's, default d). The
    interpreter (any device but CUDA) gets tl.dot's smallest tiles (16), which keeps tests quick."""
    interpreter = device.type != "cuda"
    block_d, block_e = max(16, next_power_of_2(d)), max(16, next_power_of_2(e or d))
    block = 16 if interpreter else 64 if max(block_d, block_e) <= 128 else 32
    return dict(DROPOUT=threshold > 0, UPCAST=interpreter, BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d,
                BLOCK_E=block_e)


def _backward_kv_meta(meta):
    """_attention_backward_kv's constexprs: its two fp32 accumulators (dK, dV: 2 x BLOCK_N x BLOCK_D) took 128
    registers a thread at head dim 128 in tiles of 64 x 64, and it spilled on sm_90 (bench/triton_sm90.py: 428 bytes
    a thread; 8 warps or fewer stages still spilled); at head dims over 64 it takes tiles of 32 x 32 (162 registers,
    no spill, on Triton 3.6 and 3.9)."""
    if max(meta["BLOCK_D"], meta["BLOCK_E"]) <= 64 or meta["BLOCK_N"] <= 32:
        return meta
    return {**meta, "BLOCK_M": 32, "BLOCK_N": 32}


def _launch_args(query, key, value, seed, threshold, keep_scale, scale):
    """The kernels' arguments from SEED to keep_scale. Without dropout the kernels never read SEED, and seed may
    be None: any pointer will do."""
    sq, d = query.shape[-2:]
    return (query if seed is None else seed, sq, key.size(-2), d, value.size(-1), scale, threshold, keep_scale)


class _TritonAttention(torch.autograd.Function):
    """Forward: _attention_forward. Backward: _attention_backward_q (dQ, delta), then _attention_backward_kv."""

    @staticmethod
    def forward(ctx, query, key, value, dropout_p, seed, scale):
        check_device(query, key, value, seed, op="flash_attention")
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        b, heads, sq, d = query.shape
        ctx.threshold, ctx.keep_scale, ctx.scale = drop_threshold(dropout_p), 1.0 / (1.0 - dropout_p), scale
        out = query.new_empty((b, heads, sq, value.size(-1)))
        lse = torch.empty((b, heads, sq), dtype=torch.float32, device=query.device)
        if out.numel():
            meta = _meta(ctx.threshold, query.device, d, value.size(-1))
            _attention_forward[(cdiv(sq, meta["BLOCK_M"]), b * heads)](
                query, key, value, out, lse, *_launch_args(query, key, value, seed, ctx.threshold, ctx.keep_scale,
                                                           scale), **meta)
        ctx.save_for_backward(query, key, value, out, lse, seed)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, seed = ctx.saved_tensors
        if not out.numel():
            return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value), None, None, None
        grad_out = grad_out.contiguous()
        b, heads, sq, d = query.shape
        grad_q, grad_k, grad_v = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        delta = torch.empty_like(lse)
        args = _launch_args(query, key, value, seed, ctx.threshold, ctx.keep_scale, ctx.scale)
        meta = _meta(ctx.threshold, query.device, d, value.size(-1))
        _attention_backward_q[(cdiv(sq, meta["BLOCK_M"]), b * heads)](
            query, key, value, out, grad_out, lse, delta, grad_q, *args, **meta)
        kv_meta = _backward_kv_meta(meta)
        _attention_backward_kv[(cdiv(key.size(-2), kv_meta["BLOCK_N"]), b * heads)](
            query, key, value, grad_out, lse, delta, grad_k, grad_v, *args, **kv_meta)
        return grad_q, grad_k, grad_v, None, None, None


def flash_attention_triton(query, key, value, dropout_p: float, seed, scale=None):
    """Triton kernels, forward and backward (seed may be None when dropout_p is 0). The kernels take a key and
    value head per query head: grouped ones are repeated (and their gradients summed by autograd)."""
    _check(query, key, value)
    return _TritonAttention.apply(query, *_per_query_head(query, key, value), dropout_p, seed,
                                  _scale_of(query, scale))


# On CUDA, `auto` leaves attention to scaled_dot_product_attention (flash and cuDNN kernels, with dropout)
OPS = (FusedOp("flash_attention", {"reference": flash_attention_reference, "triton": flash_attention_triton,
                                   "compile": flash_attention_compile},
               faster_compiled_on_cpu=True, cuda_preference=("reference",)),)
