"""Partial rotary embeddings (--rotary-percent): the attention layer's RoPE of q and k rotates the leading
int(head_dim x percent) channels of each head like the textbook per-pair (complex) rotation and like Hugging Face
GPT-NeoX's partial rotary, the other channels pass through untouched; at percent 1.0 it is the full rotation as
before, bit for bit, with no slicing."""
import pytest
import torch

from megatron_ds.core import fusions
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.core.transformer.attention import SelfAttention
from megatron_ds.core.transformer.rotary import RotaryEmbedding, apply_rotary
from tests.support.fused_op_checks import assert_matches, leaf
from tests.support.oracles import textbook_partial_rope

S, B, HIDDEN, HEADS, BASE = 7, 2, 64, 4, 5000.0  # head dim 16
FP32 = dict(atol=1e-6, rtol=1e-6)


def _config(rotary_percent, **overrides):
    options = dict(hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope", rotary_base=BASE,
                   bias=False)
    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             rotary_percent=rotary_percent, **{**options, **overrides})


def _attention_qk(config):
    """(q, k before RoPE, q, k after it) [s, b, heads or groups, d], as SelfAttention.forward computes them."""
    model_parallel_cuda_manual_seed(1234)
    attention = SelfAttention(config, layer_number=1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in attention.parameters():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    seen = {}

    def core_attention(query, key, value, *rest, scale=None):  # [b, heads, s, d]
        seen["query"], seen["key"] = query.permute(2, 0, 1, 3), key.permute(2, 0, 1, 3)
        return query

    attention.core_attention = core_attention
    hidden = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        attention(hidden)
        # GQA's key heads as grouped as the attention gets them
        query, key, _ = attention._split_qkv(attention.linear_qkv(hidden)[0], expand=False)
    return query, key, seen["query"], seen["key"]


@pytest.mark.parametrize("rotary_percent, rotary_dim", [(0.25, 4), (0.5, 8)])
@pytest.mark.parametrize("num_query_groups", [None, 2])
def test_attention_rotates_the_leading_channels_like_the_textbook(rotary_percent, rotary_dim, num_query_groups):
    config = _config(rotary_percent, num_query_groups=num_query_groups)
    assert config.rotary_dim == rotary_dim
    query, key, rotated_query, rotated_key = _attention_qk(config)
    positions = torch.arange(S)
    for before, after in ((query, rotated_query), (key, rotated_key)):
        torch.testing.assert_close(after, textbook_partial_rope(before, positions, rotary_dim, BASE), **FP32)
        assert torch.equal(after[..., rotary_dim:], before[..., rotary_dim:])  # passed through untouched
        assert not torch.allclose(after[1:, ..., :rotary_dim], before[1:, ..., :rotary_dim])  # really rotated


@pytest.mark.parametrize("rotary_percent", [0.25, 0.5])
def test_apply_rotary_matches_the_textbook_forward_and_backward(rotary_percent):
    rotary_dim = int(16 * rotary_percent)
    cos, sin = RotaryEmbedding(rotary_dim, BASE)(S, "cpu", offset=3)
    q, k = leaf((S, B, HEADS, 16), torch.float32, "cpu"), leaf((S, B, 1, 16), torch.float32, "cpu", seed=1)
    positions = torch.arange(3, 3 + S)
    assert_matches(lambda q, k: apply_rotary(q, k, cos, sin),
                   lambda q, k: (textbook_partial_rope(q, positions, rotary_dim, BASE),
                                 textbook_partial_rope(k, positions, rotary_dim, BASE)), [q, k])


@pytest.mark.parametrize("rotary_percent", [0.25, 0.5, 1.0])
def test_matches_hugging_face_gpt_neox_partial_rotary(rotary_percent):
    neox = pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")
    from transformers import GPTNeoXConfig
    hf_config = GPTNeoXConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=1,
                              intermediate_size=4 * HIDDEN, max_position_embeddings=64, rotary_pct=rotary_percent,
                              rotary_emb_base=BASE)
    query, key, rotated_query, rotated_key = _attention_qk(_config(rotary_percent))
    hf_rope = neox.GPTNeoXRotaryEmbedding(hf_config)
    hf_query, hf_key = (t.permute(1, 2, 0, 3) for t in (query, key))  # HF's [b, heads, s, d]
    cos, sin = hf_rope(hf_query, torch.arange(S)[None].expand(B, S))
    assert cos.size(-1) == int(HIDDEN // HEADS * rotary_percent)
    hf_query, hf_key = neox.apply_rotary_pos_emb(hf_query, hf_key, cos, sin)
    torch.testing.assert_close(rotated_query, hf_query.permute(2, 0, 1, 3), **FP32)
    torch.testing.assert_close(rotated_key, hf_key.permute(2, 0, 1, 3), **FP32)


def test_full_rotary_is_the_plain_rotation_bit_for_bit():
    config = _config(1.0)
    assert config.rotary_dim == config.kv_channels == 16
    query, key, rotated_query, rotated_key = _attention_qk(config)
    cos, sin = RotaryEmbedding(16, BASE)(S, "cpu")  # what the attention ran before partial rotary
    expected = fusions.rotary_pos_emb_reference(query, key, cos, sin)
    assert torch.equal(rotated_query, expected[0]) and torch.equal(rotated_key, expected[1])
    calls = []

    def spy(q, k, cos, sin):
        calls.append((q, k))
        return fusions.rotary_pos_emb_reference(q, k, cos, sin)

    assert all(torch.equal(a, b) for a, b in zip(apply_rotary(query, key, cos, sin, spy), expected))
    assert calls[0][0] is query and calls[0][1] is key  # the op gets the tensors themselves: no slice, no copy


@pytest.mark.parametrize("rotary_percent, message", [
    (0.0, r"rotary_percent must be in \(0, 1\], got 0.0"),
    (1.5, r"rotary_percent must be in \(0, 1\], got 1.5"),
    (0.1875, r"16 x 0.1875 = 3 channels of each head: that must be an even integer >= 2"),
    (0.3, r"16 x 0.3 = 4.8 channels"),
    (0.0625, r"16 x 0.0625 = 1 channels"),
])
def test_config_refuses_a_rotary_percent_without_an_even_rotary_dim(rotary_percent, message):
    with pytest.raises(ValueError, match=message):
        _config(rotary_percent)
    if 0.0 < rotary_percent <= 1.0:  # without RoPE the rotary dimension does not matter
        _config(rotary_percent, position_embedding_type="learned_absolute")
