"""Ring attention (context parallelism, p2p) against plain single-process attention: the load-balanced layout and
its inverse, the visible part of each key/value block against the global causal mask, one block's math, and the
ring itself at CP 1, 2 and 4 on gloo processes (forward and the gradients of q, k and v, gathered back to the
sequence's order; fp32 and fp64; causal and not; multi-head, grouped-query with key/value heads sent unexpanded,
multi-query with a wider value head)."""
import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_ds.core.transformer import ring_attention as ring
from tests.support.distributed import run_distributed

BATCH, SEQ, HEAD_DIM, SCALE = 2, 32, 8, 0.3
HEADS = [(4, 4, HEAD_DIM), (4, 2, HEAD_DIM), (4, 1, 12)]  # (query heads, key/value heads, value head dim)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def reference_attention(query, key, value, scale, causal):
    """softmax(Q K^T scale + causal mask) V on whole sequences, key/value heads repeated for their query heads."""
    per_group = query.size(1) // key.size(1)
    key, value = key.repeat_interleave(per_group, dim=1), value.repeat_interleave(per_group, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), value)


def _inputs(heads, groups, value_dim, dtype, seq=SEQ):
    generator = torch.Generator().manual_seed(1234)
    shapes = [(BATCH, heads, seq, HEAD_DIM), (BATCH, groups, seq, HEAD_DIM), (BATCH, groups, seq, value_dim),
              (BATCH, heads, seq, value_dim)]
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in shapes]


def _reference_results(query, key, value, grad_out, causal):
    """Output and input gradients of the reference, in fp64."""
    leaves = [t.double().requires_grad_() for t in (query, key, value)]
    out = reference_attention(*leaves, SCALE, causal)
    out.backward(grad_out.double())
    return [out.detach(), *(t.grad for t in leaves)]


# --- the layout ---------------------------------------------------------------------------------------------------


def test_load_balanced_chunks_pair_head_and_tail():
    assert ring.load_balanced_chunks(8, 2, 0) == (slice(0, 2), slice(6, 8))
    assert ring.load_balanced_chunks(8, 2, 1) == (slice(2, 4), slice(4, 6))
    assert ring.load_balanced_chunks(16, 4, 3) == (slice(6, 8), slice(8, 10))
    assert ring.load_balanced_chunks(6, 1, 0) == (slice(0, 3), slice(3, 6))
    assert ring.context_parallel_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("arguments, message", [
    ((12, 4, 0), "sequence_length 12 is not divisible by 2 x cp_size = 8"),
    ((8, 0, 0), "cp_size must be at least 1, got 0"),
    ((8, 2, 2), r"cp_rank must be in \[0, cp_size=2\), got 2"),
])
def test_load_balanced_chunks_names_bad_input(arguments, message):
    with pytest.raises(ValueError, match=message):
        ring.load_balanced_chunks(*arguments)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 2, -1])
def test_split_and_join_are_inverse(cp_size, dim):
    tensor = torch.randn(16, 3, 16, 16)
    parts = [ring.split_for_context_parallel(tensor, cp_size, rank, dim=dim) for rank in range(cp_size)]
    for rank, part in enumerate(parts):
        positions = ring.context_parallel_positions(16, cp_size, rank)
        assert torch.equal(part, tensor.index_select(dim, positions))
    assert torch.equal(ring.join_context_parallel_parts(parts, dim=dim), tensor)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_visible_parts_are_the_global_causal_mask(cp_size):
    seq = 4 * cp_size
    local = seq // cp_size
    for rank, owner in itertools.product(range(cp_size), repeat=2):
        query_positions = ring.context_parallel_positions(seq, cp_size, rank)
        key_positions = ring.context_parallel_positions(seq, cp_size, owner)
        expected = query_positions[:, None] >= key_positions[None, :]
        part = ring.visible_part(rank, owner, local, causal=True)
        observed = torch.zeros(local, local, dtype=torch.bool)
        queries, keys = torch.arange(local)[part.queries], torch.arange(local)[part.keys]
        block = torch.ones(len(queries), len(keys), dtype=torch.bool)
        observed[queries[:, None], keys[None, :]] = block.tril() if part.causal else block
        assert torch.equal(observed, expected), (rank, owner)


# --- one block, and blocks merged by their log-sum-exp ------------------------------------------------------------


@pytest.mark.parametrize("heads, groups, value_dim", HEADS)
def test_blocks_merged_by_log_sum_exp_equal_whole_attention(heads, groups, value_dim):
    """A rank's own block (causal) merged with an earlier block seen by the second half of its queries, as a
    later owner's block is under the load-balanced layout: the merged output, and each block's backward given
    the merged log-sum-exp, equal attention over both blocks' keys at once with that mask."""
    query, key, value, grad_out = _inputs(heads, groups, value_dim, torch.float64, seq=8)
    out, lse = ring.attention_block(query, key, value, SCALE, causal=True)
    earlier_key, earlier_value = key.flip(2), value.flip(2)  # any other keys will do
    later = slice(4, 8)
    block_out, block_lse = ring.attention_block(query[:, :, later], earlier_key, earlier_value, SCALE, causal=False)
    ring.merge_block(out[:, :, later], lse[:, :, later], block_out, block_lse)

    whole_key, whole_value = torch.cat([earlier_key, key], dim=2), torch.cat([earlier_value, value], dim=2)
    visible = torch.ones(8, 16, dtype=torch.bool)
    visible[:, 8:] = torch.ones(8, 8, dtype=torch.bool).tril()
    visible[:4, :8] = False
    leaves = [t.clone().requires_grad_() for t in (query, whole_key, whole_value)]
    per_group = heads // groups
    scores = torch.matmul(leaves[0], leaves[1].repeat_interleave(per_group, 1).transpose(-1, -2)) * SCALE
    expected = torch.matmul(torch.softmax(scores.masked_fill(~visible, float("-inf")), -1),
                            leaves[2].repeat_interleave(per_group, 1))
    torch.testing.assert_close(out, expected.detach(), rtol=1e-12, atol=1e-12)

    expected.backward(grad_out)
    delta = (grad_out * out).sum(-1)
    dq, dk, dv = ring.attention_block_backward(query, key, value, grad_out, lse, delta, SCALE, causal=True)
    dq_later, dk_earlier, dv_earlier = ring.attention_block_backward(
        query[:, :, later], earlier_key, earlier_value, grad_out[:, :, later], lse[:, :, later],
        delta[:, :, later], SCALE, causal=False)
    dq[:, :, later] += dq_later
    torch.testing.assert_close(dq, leaves[0].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([dk_earlier, dk], 2), leaves[1].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([dv_earlier, dv], 2), leaves[2].grad, rtol=1e-12, atol=1e-12)


# --- bad input, named before any process group --------------------------------------------------------------------


def test_dropout_is_refused_by_name():
    query, key, value, _ = _inputs(4, 2, HEAD_DIM, torch.float32, seq=4)
    with pytest.raises(NotImplementedError, match="dropout_p must be 0, got 0.1"):
        ring.ring_attention(query, key, value, dropout_p=0.1)


@pytest.mark.parametrize("key_shape, message", [
    ((BATCH, 3, 4, HEAD_DIM), r"key/value heads \(3\) must divide the query heads \(4\)"),
    ((BATCH, 2, 6, HEAD_DIM), "key must be"),
    ((BATCH, 2, 4, HEAD_DIM + 1), "key must be"),
])
def test_bad_shapes_are_named(key_shape, message):
    query = torch.zeros(BATCH, 4, 4, HEAD_DIM)
    key = value = torch.zeros(key_shape)
    with pytest.raises(ValueError, match=message):
        ring.ring_attention(query, key, value)


def test_causal_needs_an_even_local_length():
    query = key = value = torch.zeros(BATCH, 2, 5, HEAD_DIM)
    with pytest.raises(ValueError, match="local sequence length must be even, got 5"):
        ring.ring_attention(query, key, value)


# --- the ring on real processes -----------------------------------------------------------------------------------


class _RecordedExchange(ring._RingExchange):
    shapes = []

    def __init__(self, tensors, group):
        _RecordedExchange.shapes.append([tuple(t.shape) for t in tensors])
        super().__init__(tensors, group)


def _ring_matches_reference(causal):
    ring._RingExchange = _RecordedExchange  # this forked process only
    cp, rank = dist.get_world_size(), dist.get_rank()
    for dtype, (heads, groups, value_dim) in itertools.product(TOLERANCE, HEADS):
        query, key, value, grad_out = _inputs(heads, groups, value_dim, dtype)
        local = [ring.split_for_context_parallel(t, cp, rank, dim=2).requires_grad_() for t in (query, key, value)]
        _RecordedExchange.shapes.clear()
        out = ring.ring_attention(*local, causal=causal, softmax_scale=SCALE)
        sent_blocks = list(_RecordedExchange.shapes)
        out.backward(ring.split_for_context_parallel(grad_out, cp, rank, dim=2))
        assert out.dtype == dtype and all(t.grad.dtype == dtype for t in local)

        unexpanded = [(BATCH, groups, SEQ // cp, HEAD_DIM), (BATCH, groups, SEQ // cp, value_dim)]
        assert sent_blocks == [unexpanded] * (cp - 1), sent_blocks
        observed = [ring.gather_from_context_parallel(t, dim=2)
                    for t in (out.detach(), *(t.grad for t in local))]
        expected = _reference_results(query, key, value, grad_out, causal)
        for name, got, want in zip(("output", "dq", "dk", "dv"), observed, expected):
            torch.testing.assert_close(got.double(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype],
                                       msg=lambda text: f"{name} {dtype} heads {heads}/{groups}: {text}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_attention_matches_single_process_attention(cp, causal):
    run_distributed(_ring_matches_reference, cp, causal, timeout=120)
