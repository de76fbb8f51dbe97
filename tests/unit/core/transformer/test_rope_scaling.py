"""RoPE scaling (--use-rope-scaling: LLaMA-3.1's; --rope-type yarn: YaRN, DeepSeek-V3's): the attention layer's
rotary embedding, built from the TransformerConfig, has transformers' own inverse frequencies and attention factor
(its ROPE_INIT_FUNCTIONS "llama3" and "yarn") bit for bit, and LlamaRotaryEmbedding's cos and sin at positions
beyond the original context; without scaling it is plain RoPE, as before."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.core.transformer.rotary import RotaryEmbedding, inverse_frequencies

# name: (head dim, theta, our TransformerConfig fields, transformers' rope parameters, a position past the original)
CASES = {
    "llama3.1-8b": (128, 500000.0, dict(use_rope_scaling=True, rope_scaling_factor=8.0),
                    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192), 9000),
    "llama3.2-1b": (64, 500000.0, dict(use_rope_scaling=True, rope_scaling_factor=32.0),
                    dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192), 20000),
    "deepseek-v3": (64, 10000.0, dict(rope_type="yarn", rotary_scaling_factor=40.0,
                                      original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                      mscale=1.0, mscale_all_dim=1.0),
                    dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
                         beta_slow=1, mscale=1.0, mscale_all_dim=1.0), 5000),
    "qwen2.5-yarn": (128, 1000000.0, dict(rope_type="yarn", rotary_scaling_factor=4.0,
                                          original_max_position_embeddings=32768),
                     dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768), 40000),
    "yarn-mscales": (32, 10000.0, dict(rope_type="yarn", rotary_scaling_factor=8.0,
                                       original_max_position_embeddings=64, beta_fast=8.0, beta_slow=0.5,
                                       mscale=0.9, mscale_all_dim=0.4),
                     dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=8.0,
                          beta_slow=0.5, mscale=0.9, mscale_all_dim=0.4), 100),
    "yarn-zero-width-ramp": (8, 10000.0, dict(rope_type="yarn", rotary_scaling_factor=2.0,
                                              original_max_position_embeddings=4, beta_fast=2.0, beta_slow=1.0),
                             dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=4, beta_fast=2.0,
                                  beta_slow=1.0), 10),
}


def _ours(head_dim, theta, fields):
    heads = 4
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               position_embedding_type="rope", rotary_base=theta, **fields)
    return RotaryEmbedding.from_config(config)


def _hf_config(head_dim, theta, parameters):
    return LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=1 << 18, rope_parameters={**parameters, "rope_theta": theta})


@pytest.mark.parametrize("case", CASES)
def test_inverse_frequencies_and_attention_factor_are_transformers(case):
    head_dim, theta, fields, parameters, _ = CASES[case]
    ours = _ours(head_dim, theta, fields)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](_hf_config(head_dim, theta, parameters),
                                                                              "cpu")
    assert torch.equal(ours.inv_freq, inv_freq)
    assert ours.attention_factor == attention_factor
    assert not torch.equal(ours.inv_freq, inverse_frequencies(head_dim, theta))  # it is scaled


@pytest.mark.parametrize("case", CASES)
def test_cos_and_sin_are_llama_rotary_embeddings_beyond_the_original_context(case):
    head_dim, theta, fields, parameters, offset = CASES[case]
    positions = torch.arange(offset, offset + 12)
    hf_cos, hf_sin = LlamaRotaryEmbedding(_hf_config(head_dim, theta, parameters))(
        torch.zeros(1, 12, head_dim), positions[None])
    cos, sin = _ours(head_dim, theta, fields)(12, "cpu", offset=offset)
    torch.testing.assert_close(cos[:, 0, 0], hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0, 0], hf_sin[0], rtol=0, atol=1e-6)


def test_the_attention_factor_multiplies_cos_and_sin():
    head_dim, theta, fields, _, _ = CASES["yarn-mscales"]
    scaled = _ours(head_dim, theta, fields)
    assert scaled.attention_factor == pytest.approx((0.1 * 0.9 * 2.0794415 + 1) / (0.1 * 0.4 * 2.0794415 + 1))
    cos, sin = scaled(5, "cpu", offset=3)
    angles = torch.outer(torch.arange(3, 8, dtype=torch.float32), scaled.inv_freq).repeat(1, 2)
    torch.testing.assert_close(cos[:, 0, 0], angles.cos() * scaled.attention_factor)
    torch.testing.assert_close(sin[:, 0, 0], angles.sin() * scaled.attention_factor)


def test_without_scaling_it_is_plain_rope_bit_for_bit():
    plain = _ours(16, 5000.0, {})
    assert plain.attention_factor == 1.0 and torch.equal(plain.inv_freq, inverse_frequencies(16, 5000.0))
    angles = torch.outer(torch.arange(4, dtype=torch.float32), plain.inv_freq).repeat(1, 2)
    cos, sin = plain(4, "cpu")
    assert torch.equal(cos[:, 0, 0], angles.cos()) and torch.equal(sin[:, 0, 0], angles.sin())


@pytest.mark.parametrize("fields, message", [
    (dict(rope_type="yarn"), "--rope-type yarn needs --original-max-position-embeddings"),
    (dict(rope_type="yarn", original_max_position_embeddings=16, rotary_scaling_factor=0.0),
     "--rotary-scaling-factor 0: YaRN's factor must be > 0"),
    (dict(rope_type="yarn", original_max_position_embeddings=16, beta_fast=1.0),
     "--beta-fast 1, --beta-slow 1: YaRN needs 0 < beta-slow < beta-fast"),
    (dict(use_rope_scaling=True, rope_scaling_factor=-2.0), "--rope-scaling-factor -2 must be > 0"),
    (dict(rope_type="linear"), "--rope-type linear: one of ('rope', 'yarn')"),
])
def test_the_config_refuses_a_bad_scaling(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _ours(16, 10000.0, fields)
