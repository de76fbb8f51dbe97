"""flash_attention's blocked reference: the textbook attention's outputs and gradients, with the dropout mask
of its counter hash (checked against a plain-Python murmur3 finaliser), the keep rate 1 - p, one mask per
seed, and activation recompute replaying the mask because the seed is drawn from the generator."""
import pytest
import torch
import torch.nn.functional as F

from megatron_ds.core.fusions import counter_hash
from megatron_ds.core.fusions import flash_attention as fa
from megatron_ds.core.tensor_parallel.random import checkpoint
from tests.support.fused_op_checks import assert_matches, leaf
from tests.support.oracles import fmix32, textbook_causal_attention


def _qkv(b, heads, sq, sk, d, dtype=torch.float32):
    return (leaf((b, heads, sq, d), dtype, "cpu"), leaf((b, heads, sk, d), dtype, "cpu", seed=1),
            leaf((b, heads, sk, d), dtype, "cpu", seed=2))


def _mask(b, heads, sq, sk, seed, p):
    rows = torch.arange(b * heads * sq)
    return counter_hash.keep_mask(seed, rows, torch.arange(sk), counter_hash.drop_threshold(p)).view(b, heads, sq, sk)


def test_keep_mask_is_the_murmur_hash_of_seed_row_and_key():
    seed, threshold = 0xDEADBEEF, counter_hash.drop_threshold(0.3)
    rows, keys = torch.tensor([0, 1, 77, 2 ** 31 - 1]), torch.tensor([0, 5, 4095, 2 ** 20])
    mask = counter_hash.keep_mask(torch.tensor(seed), rows, keys, threshold)
    expected = [[fmix32((fmix32(row ^ seed) + key * 0x9E3779B9) & 0xFFFFFFFF) >= threshold for key in keys.tolist()]
                for row in rows.tolist()]
    assert mask.tolist() == expected


def test_keep_rate_is_one_minus_p_and_each_seed_gives_its_own_mask():
    first = _mask(4, 8, 256, 256, torch.tensor(12345), 0.1)
    assert abs(first.float().mean().item() - 0.9) < 0.003  # 2M draws: the standard error is 2e-4
    assert not torch.equal(first, _mask(4, 8, 256, 256, torch.tensor(12346), 0.1))
    assert _mask(1, 1, 4, 4, torch.tensor(1), 0.0).all()


@pytest.mark.parametrize("b, heads, sq, sk, d", [(2, 3, 300, 300, 16), (1, 1, 600, 600, 4), (1, 2, 5, 141, 8),
                                                 (1, 1, 1, 1, 4)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_reference_is_the_textbook_attention(b, heads, sq, sk, d, dropout_p):
    """Blocks of 64 queries (300 = 4 x 64 + 44), of 128 past 8 blocks of 64 (600 = 4 x 128 + 88), queries fewer
    than keys, a single token."""
    query, key, value = _qkv(b, heads, sq, sk, d)
    seed = torch.tensor(987654321)
    keep = _mask(b, heads, sq, sk, seed, dropout_p) if dropout_p else None
    assert_matches(fa.flash_attention_reference,
                   lambda q, k, v, p, s: textbook_causal_attention(q, k, v, keep, p),
                   [query, key, value, dropout_p, seed])


def test_blocks_are_multiples_of_64_queries_and_at_most_8_per_call():
    assert [fa.queries_per_block(sq) for sq in (1, 64, 512, 513, 2048, 2049)] == [64, 64, 64, 128, 256, 320]


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_grouped_keys_and_values_are_the_textbook_attention_of_the_repeated_ones(dropout_p):
    """GQA: 6 heads over 2 key/value groups; the mask is the one of the expanded layout (rows by query head)."""
    query, key, value = leaf((2, 6, 150, 8), torch.float32, "cpu"), *_qkv(2, 2, 150, 150, 8)[1:]
    seed = torch.tensor(77)
    keep = _mask(2, 6, 150, 150, seed, dropout_p) if dropout_p else None
    assert_matches(fa.flash_attention_reference,
                   lambda q, k, v, p, s: textbook_causal_attention(q, k.repeat_interleave(3, 1),
                                                                   v.repeat_interleave(3, 1), keep, p),
                   [query, key, value, dropout_p, seed])


def test_reference_in_bf16_tracks_sdpa_without_dropout():
    query, key, value = _qkv(2, 4, 200, 200, 32, torch.bfloat16)
    assert_matches(fa.flash_attention_reference,
                   lambda q, k, v, p, s: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                   [query, key, value, 0.0, torch.tensor(0)])


@pytest.mark.parametrize("op", [fa.flash_attention_reference, fa.flash_attention_compile], ids=["reference", "compile"])
def test_output_is_stored_sequence_first_so_the_projection_input_is_a_view(op):
    """The model permutes the output to [s, b, heads, d] and flattens the heads for the output projection: no
    copy, so the output the op saves for backward is the projection's input itself."""
    query, key, value = _qkv(2, 3, 40, 40, 8)
    out = op(query, key, value, 0.0, torch.tensor(0))
    projection_input = out.permute(2, 0, 1, 3).reshape(40, 2, 3 * 8)
    assert projection_input.data_ptr() == out.data_ptr() and projection_input._base is not None


def test_recompute_replays_the_mask_through_the_seed_draw():
    query, key, value = _qkv(1, 2, 64, 64, 8)

    def attention(q, k, v):
        return fa.flash_attention_reference(q, k, v, 0.5, counter_hash.draw_seed(q.device))

    torch.manual_seed(3)
    direct = torch.autograd.grad(attention(query, key, value).sum(), (query, key, value))
    torch.manual_seed(3)
    recomputed = torch.autograd.grad(checkpoint(attention, False, query, key, value).sum(), (query, key, value))
    for got, want in zip(recomputed, direct):
        assert torch.equal(got, want)
    torch.manual_seed(4)
    assert not torch.equal(torch.autograd.grad(attention(query, key, value).sum(), query)[0], direct[0])


def test_bad_shapes_and_probabilities_are_refused():
    query, key, value = _qkv(1, 1, 8, 4, 4)
    with pytest.raises(ValueError, match=r"sq <= sk; got \(1, 1, 8, 4\), \(1, 1, 4, 4\)"):
        fa.flash_attention_reference(query, key, value, 0.0, torch.tensor(0))
    with pytest.raises(ValueError, match="dropout probability must be in \\[0, 1\\), got 1.0"):
        counter_hash.drop_threshold(1.0)
