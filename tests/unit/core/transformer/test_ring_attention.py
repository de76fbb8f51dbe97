"""Context parallel attention (ring_attention, p2p, and all_gather_attention) against plain single-process
attention: the load-balanced layout and its inverse, the visible part of each key/value block and the all-gather's
parts against the global causal mask, one block's math and torch's flash kernels against it, and both variants at
CP 1, 2 and 4 on gloo processes (forward and the gradients of q, k and v, gathered back to the sequence's order;
fp64 with the plain-math blocks, fp32 with the kernels; causal and not; multi-head, grouped-query with key/value
heads sent unexpanded, multi-query with a wider value head); with dropout, the mask of the flash op on the whole
sequence at the same seed (against flash_attention_reference, and in fp64 against the dense attention with that
op's keep mask)."""
import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_ds.core import sequence_split
from megatron_ds.core.fusions import counter_hash
from megatron_ds.core.fusions.flash_attention import flash_attention_reference
from megatron_ds.core.transformer import ring_attention as ring
from tests.support.distributed import run_distributed

BATCH, SEQ, HEAD_DIM, SCALE = 2, 32, 8, 0.3
HEADS = [(4, 4, HEAD_DIM), (4, 2, HEAD_DIM), (4, 1, 12)]  # (query heads, key/value heads, value head dim)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
DROPOUT_P, SEED = 0.1, torch.tensor(20240611)
# the flash op computes its softmax in fp32 whatever the inputs' dtype
FLASH_TOLERANCE = 2e-6


def flash_keep_mask(b, heads, s, seed, p):
    """The flash op's keep mask [b, heads, s, s] of a whole sequence: row (batch x heads + head) x s + query."""
    rows = torch.arange(b * heads * s)
    return counter_hash.keep_mask(seed, rows, torch.arange(s), counter_hash.drop_threshold(p)).view(b, heads, s, s)


def reference_attention(query, key, value, scale, causal, dropout_p=0.0, seed=None):
    """softmax(Q K^T scale + causal mask) V on whole sequences, key/value heads repeated for their query heads;
    with dropout, the probabilities masked by flash_keep_mask and the kept ones scaled by 1 / (1 - p)."""
    per_group = query.size(1) // key.size(1)
    key, value = key.repeat_interleave(per_group, dim=1), value.repeat_interleave(per_group, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p:
        keep = flash_keep_mask(query.size(0), query.size(1), query.size(2), seed, dropout_p)
        probs = torch.where(keep, probs / (1 - dropout_p), 0.0)
    return torch.matmul(probs, value)


def _inputs(heads, groups, value_dim, dtype, seq=SEQ):
    generator = torch.Generator().manual_seed(1234)
    shapes = [(BATCH, heads, seq, HEAD_DIM), (BATCH, groups, seq, HEAD_DIM), (BATCH, groups, seq, value_dim),
              (BATCH, heads, seq, value_dim)]
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in shapes]


def _reference_results(query, key, value, grad_out, causal, dropout_p=0.0, attention=None):
    """Output and input gradients of the reference, in fp64 (attention: reference_attention's arguments after
    the scale)."""
    leaves = [t.double().detach().requires_grad_() for t in (query, key, value)]
    out = reference_attention(*leaves, SCALE, causal, dropout_p, SEED) if attention is None else attention(*leaves)
    out.backward(grad_out.double())
    return [out.detach(), *(t.grad for t in leaves)]


# --- the layout ---------------------------------------------------------------------------------------------------


def test_load_balanced_chunks_pair_head_and_tail():
    assert sequence_split.load_balanced_chunks(8, 2, 0) == (slice(0, 2), slice(6, 8))
    assert sequence_split.load_balanced_chunks(8, 2, 1) == (slice(2, 4), slice(4, 6))
    assert sequence_split.load_balanced_chunks(16, 4, 3) == (slice(6, 8), slice(8, 10))
    assert sequence_split.load_balanced_chunks(6, 1, 0) == (slice(0, 3), slice(3, 6))
    assert sequence_split.context_parallel_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("arguments, message", [
    ((12, 4, 0), "sequence_length 12 is not divisible by 2 x cp_size = 8"),
    ((8, 0, 0), "cp_size must be at least 1, got 0"),
    ((8, 2, 2), r"cp_rank must be in \[0, cp_size=2\), got 2"),
])
def test_load_balanced_chunks_names_bad_input(arguments, message):
    with pytest.raises(ValueError, match=message):
        sequence_split.load_balanced_chunks(*arguments)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 2, -1])
def test_split_and_join_are_inverse(cp_size, dim):
    tensor = torch.randn(16, 3, 16, 16)
    parts = [ring.split_for_context_parallel(tensor, cp_size, rank, dim=dim) for rank in range(cp_size)]
    for rank, part in enumerate(parts):
        positions = sequence_split.context_parallel_positions(16, cp_size, rank)
        assert torch.equal(part, tensor.index_select(dim, positions))
    assert torch.equal(ring.join_context_parallel_parts(parts, dim=dim), tensor)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_visible_parts_are_the_global_causal_mask(cp_size):
    seq = 4 * cp_size
    local = seq // cp_size
    for rank, owner in itertools.product(range(cp_size), repeat=2):
        query_positions = sequence_split.context_parallel_positions(seq, cp_size, rank)
        key_positions = sequence_split.context_parallel_positions(seq, cp_size, owner)
        expected = query_positions[:, None] >= key_positions[None, :]
        part = ring.visible_part(rank, owner, local, causal=True)
        observed = torch.zeros(local, local, dtype=torch.bool)
        queries, keys = torch.arange(local)[part.queries], torch.arange(local)[part.keys]
        block = torch.ones(len(queries), len(keys), dtype=torch.bool)
        observed[queries[:, None], keys[None, :]] = block.tril() if part.causal else block
        assert torch.equal(observed, expected), (rank, owner)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_gathered_parts_cover_the_global_mask_once(cp_size, causal):
    seq = 4 * cp_size
    local = seq // cp_size
    for rank in range(cp_size):
        query_positions = sequence_split.context_parallel_positions(seq, cp_size, rank)
        expected = query_positions[:, None] >= torch.arange(seq)[None, :] if causal else torch.ones(local, seq)
        covered = torch.zeros(local, seq, dtype=torch.int64)
        for part in ring.gathered_parts(rank, cp_size, local, causal):
            block = covered[part.queries, part.keys]
            covered[part.queries, part.keys] += torch.ones_like(block).tril() if part.causal else 1
        assert torch.equal(covered, expected.long()), rank


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
    dq, dk, dv = ring.attention_block_backward(query, key, value, out, grad_out, lse, SCALE, causal=True)
    dq_later, dk_earlier, dv_earlier = ring.attention_block_backward(
        query[:, :, later], earlier_key, earlier_value, out[:, :, later], grad_out[:, :, later], lse[:, :, later],
        SCALE, causal=False)
    dq[:, :, later] += dq_later
    torch.testing.assert_close(dq, leaves[0].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([dk_earlier, dk], 2), leaves[1].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([dv_earlier, dv], 2), leaves[2].grad, rtol=1e-12, atol=1e-12)


KERNEL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", list(KERNEL_TOLERANCE), ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (4, 1)])
def test_kernel_block_is_the_math_block(heads, groups, causal, dtype):
    """torch's flash kernels (the CPU's) against the plain math on the same inputs: a block's output and
    log-sum-exp, and its gradients given another output and log-sum-exp (as a merged one is), in fp32 or
    bf16; fp64, dropout and a wider value head stay with the math."""
    query, key, value, grad_out = (t.to(dtype) for t in _inputs(heads, groups, HEAD_DIM, torch.float64, seq=16))
    assert ring.kernel_serves(query, value)
    dropout = ring.HashedDropout(0.1, SEED, 16).block(query, torch.arange(16), torch.arange(16))
    for fallback in ((query.double(), value.double(), None), (query, value[..., :4], None), (query, value, dropout)):
        assert not ring.kernel_serves(*fallback)
    tolerance = KERNEL_TOLERANCE[dtype]
    kernel, math = (block(query, key, value, SCALE, causal) for block in (ring.kernel_block, ring.math_block))
    for got, want in zip(kernel, math):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    out, lse = math[0] * 0.7 + 0.1, math[1] + 0.5  # as if another block had been merged
    kernel, math = (backward(query, key, value, out, grad_out, lse, SCALE, causal)
                    for backward in (ring.kernel_block_backward, ring.math_block_backward))
    for got, want in zip(kernel, math):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


# --- bad input, named before any process group --------------------------------------------------------------------


@pytest.mark.parametrize("dropout_p, seed, message", [
    (0.1, None, "dropout_p 0.1 needs a seed"),
    (1.0, SEED, r"dropout probability must be in \[0, 1\), got 1.0"),
])
def test_bad_dropout_is_named(dropout_p, seed, message):
    query, key, value, _ = _inputs(4, 2, HEAD_DIM, torch.float32, seq=4)
    with pytest.raises(ValueError, match=message):
        ring.ring_attention(query, key, value, dropout_p=dropout_p, seed=seed)


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


# --- the ring and the all-gather on real processes ----------------------------------------------------------------

VARIANTS = ["ring_attention", "all_gather_attention"]


class _RecordedExchange(ring._RingExchange):
    shapes = []

    def __init__(self, tensors, group):
        _RecordedExchange.shapes.append([tuple(t.shape) for t in tensors])
        super().__init__(tensors, group)


_gathered_shapes = []


def _recorded_gather(tensor, group=None, dim=0, gather=ring.gather_from_context_parallel):
    _gathered_shapes.append(tuple(tensor.shape))
    return gather(tensor, group, dim)


def _record_communication():
    """The ring's sends and the all-gather's gathers recorded (in this forked process only)."""
    ring._RingExchange = _RecordedExchange
    ring.gather_from_context_parallel = _recorded_gather
    _RecordedExchange.shapes.clear()
    _gathered_shapes.clear()


def _run_variant(variant, local, grad_out, **arguments):
    """The variant's output and the gradients of its inputs, gathered back into the whole sequence."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    out = getattr(ring, variant)(*local, softmax_scale=SCALE, **arguments)
    out.backward(ring.split_for_context_parallel(grad_out, cp, rank, dim=2))
    return out, [ring.gather_from_context_parallel(t, dim=2) for t in (out.detach(), *(t.grad for t in local))]


def _matches_reference(variant, causal):
    cp, rank = dist.get_world_size(), dist.get_rank()
    for dtype, (heads, groups, value_dim) in itertools.product(TOLERANCE, HEADS):
        query, key, value, grad_out = _inputs(heads, groups, value_dim, dtype)
        local = [ring.split_for_context_parallel(t, cp, rank, dim=2).requires_grad_() for t in (query, key, value)]
        _record_communication()
        out, observed = _run_variant(variant, local, grad_out, causal=causal)
        assert out.dtype == dtype and all(t.grad.dtype == dtype for t in local)
        # fp32 blocks run torch's flash kernels where the value head is the query's
        assert ring.kernel_serves(local[0], local[2]) == (dtype == torch.float32 and value_dim == HEAD_DIM)

        unexpanded = [(BATCH, groups, SEQ // cp, HEAD_DIM), (BATCH, groups, SEQ // cp, value_dim)]
        if variant == "ring_attention":  # the forward's sends (the backward's are their gradients)
            assert _RecordedExchange.shapes[:cp - 1] == [unexpanded] * (cp - 1), _RecordedExchange.shapes
        else:  # forward and backward each gather the keys and values, and only those
            assert _gathered_shapes[:4] == unexpanded * 2 and not _RecordedExchange.shapes, _gathered_shapes
        expected = _reference_results(query, key, value, grad_out, causal)
        for name, got, want in zip(("output", "dq", "dk", "dv"), observed, expected):
            torch.testing.assert_close(got.double(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype],
                                       msg=lambda text: f"{name} {dtype} heads {heads}/{groups}: {text}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_context_parallel_attention_matches_single_process_attention(variant, cp, causal):
    run_distributed(_matches_reference, cp, variant, causal, timeout=120)


def _dropout_matches_flash_op(variant):
    """Dropout: the flash op's mask of the whole sequence, against flash_attention_reference (its softmax in
    fp32) and, causal and not, against the dense fp64 attention with that mask."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    flash = lambda q, k, v: flash_attention_reference(q, k, v, DROPOUT_P, SEED, scale=SCALE)  # noqa: E731
    for causal, (heads, groups, value_dim) in itertools.product((True, False), HEADS):
        query, key, value, grad_out = _inputs(heads, groups, value_dim, torch.float64)
        local = [ring.split_for_context_parallel(t, cp, rank, dim=2).requires_grad_() for t in (query, key, value)]
        _, observed = _run_variant(variant, local, grad_out, causal=causal, dropout_p=DROPOUT_P, seed=SEED)
        references = [(_reference_results(query, key, value, grad_out, causal, DROPOUT_P), TOLERANCE[torch.float64])]
        if causal:
            references.append((_reference_results(query, key, value, grad_out, causal, attention=flash),
                               FLASH_TOLERANCE))
        for expected, tolerance in references:
            for name, got, want in zip(("output", "dq", "dk", "dv"), observed, expected):
                torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance,
                                           msg=lambda text: f"{name} causal {causal} heads {heads}/{groups}: {text}")


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_dropout_is_the_flash_ops_on_the_whole_sequence(variant, cp):
    run_distributed(_dropout_matches_flash_op, cp, variant, timeout=120)
