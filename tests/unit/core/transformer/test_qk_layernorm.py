"""--qk-layernorm and --add-qkv-bias in the attention: the layer computes what a plain computation written here
does (QKV with its bias, per query group [q heads, k, v]; each query and key head normalised over its channels by
one weight shared by the heads; then RoPE, causal GQA attention, the projection); at TP 2, with and without
sequence parallelism, a layer's outputs and every gradient equal TP 1's, and the norms' gradients, summed over the
TP ranks' heads, are the same on both ranks."""
import math

import pytest
import torch
import torch.distributed as dist

from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.tensor_parallel.random import initialize_deterministically
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer
from megatron_ds.core.transformer.attention import SelfAttention
from tests.support.distributed import run_distributed
from tests.support.transformer_layers import layer_results_on_this_rank

S, B, HEADS, GROUPS, D, HIDDEN, EPS = 6, 2, 4, 2, 8, 16, 1e-6  # head dim 8: 4 x 8 != hidden 16
QWEN = dict(normalization="RMSNorm", gated_linear_unit=True, bias=False, add_qkv_bias=True, qk_layernorm=True,
            position_embedding_type="rope", rotary_base=1e6, num_query_groups=GROUPS, kv_channels=D,
            ffn_hidden_size=24, layernorm_epsilon=EPS, hidden_dropout=0.0, attention_dropout=0.0)


def _plain_norm(x, weight, bias, normalization):
    if normalization == "LayerNorm":
        x = x - x.mean(-1, keepdim=True)
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight + bias
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _plain_rope(x, positions):
    """Rotate-half RoPE of x [s, heads, d] (base 1e6)."""
    inverse = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    angles = torch.cat([positions[:, None] * inverse] * 2, dim=-1)[:, None, :]
    rotated = torch.cat([-x[..., D // 2:], x[..., :D // 2]], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def _plain_attention(layer, hidden, normalization):
    """The layer's output for hidden [s, b, h], computed here from its weights, one batch row at a time."""
    norm_of = lambda module: (module.weight, getattr(module, "bias", None))  # noqa: E731
    qkv = hidden @ layer.linear_qkv.weight.T + layer.linear_qkv.bias
    grouped = qkv.view(S, B, GROUPS, HEADS // GROUPS + 2, D)
    query = _plain_norm(grouped[:, :, :, :-2], *norm_of(layer.q_layernorm), normalization).reshape(S, B, HEADS, D)
    key = _plain_norm(grouped[:, :, :, -2], *norm_of(layer.k_layernorm), normalization)
    value = grouped[:, :, :, -1]
    positions = torch.arange(S, dtype=torch.float32)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    rows = []
    for row in range(B):
        q, k = _plain_rope(query[:, row], positions), _plain_rope(key[:, row], positions)
        heads = []
        for head in range(HEADS):
            group = head // (HEADS // GROUPS)
            scores = (q[:, head] @ k[:, group].T / math.sqrt(D)).masked_fill(~causal, float("-inf"))
            heads.append(scores.softmax(-1) @ value[:, row, group])
        rows.append(torch.cat(heads, dim=-1))
    return torch.stack(rows, dim=1) @ layer.linear_proj.weight.T


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_attention_with_qk_layernorm_and_qkv_bias_equals_a_plain_computation(normalization):
    model_parallel_cuda_manual_seed(3)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               **{**QWEN, "normalization": normalization})
    layer = SelfAttention(config, 1)
    initialize_deterministically(layer, "attention", 3)
    assert tuple(layer.q_layernorm.weight.shape) == tuple(layer.k_layernorm.weight.shape) == (D,)
    assert tuple(layer.linear_qkv.bias.shape) == ((HEADS + 2 * GROUPS) * D,) and layer.linear_proj.bias is None
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights and biases away from 1 and 0, so that a dropped one shows
        for param in (layer.linear_qkv.bias, *layer.q_layernorm.parameters(), *layer.k_layernorm.parameters()):
            param.add_(torch.randn(param.shape, generator=generator))
    hidden = torch.randn(S, B, HIDDEN, generator=generator)
    output, bias = layer(hidden)
    assert bias is None
    torch.testing.assert_close(output, _plain_attention(layer, hidden, normalization), rtol=1e-5, atol=1e-5)


def _layer_results(tp, sequence_parallel, path):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(5)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, init_seed=5,
                               sequence_parallel=sequence_parallel, **QWEN)
    layer = TransformerLayer(config, layer_number=1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in (layer.self_attention.q_layernorm, layer.self_attention.k_layernorm):
            module.weight.add_(torch.randn(D, generator=generator))
    hidden, output_grad = torch.randn(S * 2, B, HIDDEN, generator=generator), torch.randn(S * 2, B, HIDDEN,
                                                                                          generator=generator)
    results = layer_results_on_this_rank(layer, hidden, output_grad, sequence_parallel,
                                         lambda name, _: "_layernorm" in name and "self_attention" in name)
    if dist.get_rank() == 0:
        torch.save(results, path)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_layer_with_qk_layernorm_and_qkv_bias_matches_tp1(sequence_parallel, tmp_path):
    run_distributed(_layer_results, 1, 1, False, tmp_path / "tp1.pt", timeout=60)
    run_distributed(_layer_results, 2, 2, sequence_parallel, tmp_path / "tp2.pt", timeout=60)
    expected, observed = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    norms = [key for key in observed if key.startswith("on every rank:")]
    assert len(norms) == 2 and all(observed[key] for key in norms), {key: observed[key] for key in norms}
    for key, value in expected.items():
        if not key.startswith("on every rank:"):
            torch.testing.assert_close(observed[key], value, rtol=1e-5, atol=1e-6, msg=key)
