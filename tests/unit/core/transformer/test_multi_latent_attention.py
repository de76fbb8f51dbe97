"""Multi-latent attention: the layer computes what a plain fp64 computation written here does (the down
projections, their RMSNorms, the up projections, the interleaved rotary channels taken apart and rotated, with
YaRN's frequencies and both of its factors, one rotary key for every head, causal softmax at mscale^2 / sqrt(d),
the output projection), outputs and every weight's gradient, with and without a query latent, through each
core-attention backend (local, sdpa, the flash op) with a value head dim other than the query's; at TP 2, with and
without sequence parallelism, a layer's outputs and gradients equal TP 1's and the replicated down projections'
and norms' gradients are the same on both ranks."""
import math

import pytest
import torch
import torch.distributed as dist

from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.tensor_parallel.random import initialize_deterministically
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer
from megatron_ds.core.transformer.multi_latent_attention import MultiLatentAttention
from tests.support.distributed import run_distributed
from tests.support.transformer_layers import layer_results_on_this_rank

S, B, HIDDEN, HEADS, EPS = 7, 2, 24, 4, 1e-6
QK, ROPE, V, KV_RANK, Q_RANK = 6, 8, 10, 12, 16   # v head dim 10 != query head dim 6 + 8
BASE, FACTOR, ORIGINAL, MSCALE, MSCALE_ALL_DIM = 10000.0, 4.0, 2000, 1.0, 0.8
MLA = dict(multi_latent_attention=True, kv_lora_rank=KV_RANK, qk_head_dim=QK, qk_pos_emb_head_dim=ROPE,
           v_head_dim=V, normalization="RMSNorm", layernorm_epsilon=EPS, position_embedding_type="rope",
           rotary_base=BASE, bias=False, hidden_dropout=0.0, attention_dropout=0.0, gated_linear_unit=True,
           ffn_hidden_size=32)
YARN = dict(rope_type="yarn", rotary_scaling_factor=FACTOR, original_max_position_embeddings=ORIGINAL,
            mscale=MSCALE, mscale_all_dim=MSCALE_ALL_DIM)


def _get_mscale(scale, m):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_inverse_frequencies():
    """DeepSeek-V3's YaRN: frequencies between the interpolated (base's / factor) and the extrapolated (base's),
    a linear ramp between the ones turning 32 and 1 times over the original context."""
    powers = BASE ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    turning = lambda turns: ROPE * math.log(ORIGINAL / (turns * 2 * math.pi)) / (2 * math.log(BASE))  # noqa: E731
    low, high = max(math.floor(turning(32.0)), 0), min(math.ceil(turning(1.0)), ROPE - 1)
    kept = 1 - torch.clamp((torch.arange(ROPE // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    return (1 / (FACTOR * powers)) * (1 - kept) + (1 / powers) * kept


def _angles(yarn):
    inverse = _yarn_inverse_frequencies() if yarn else 1.0 / BASE ** (torch.arange(0, ROPE, 2).double() / ROPE)
    angles = torch.outer(torch.arange(S, dtype=torch.float64), inverse)
    factor = _get_mscale(FACTOR, MSCALE) / _get_mscale(FACTOR, MSCALE_ALL_DIM) if yarn else 1.0
    return angles.cos() * factor, angles.sin() * factor  # [s, rope / 2]


def _rope(x, cos, sin):
    """x [s, b, heads, rope] with interleaved pairs (x0, x1), (x2, x3), ... rotated as the pairs (x_2i, x_2i+1)
    become (x_i, x_i+rope/2) of the rotate-half convention."""
    evens, odds = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]
    return torch.cat((evens * cos - odds * sin, odds * cos + evens * sin), dim=-1)


def _rms(x, weight):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _plain_mla(layer, x, yarn):
    """The layer's output for x [s, b, h], from its weights, written out."""
    if layer.linear_q_proj is not None:
        q = x @ layer.linear_q_proj.weight.T
    else:
        q = _rms(x @ layer.linear_q_down_proj.weight.T, layer.q_layernorm.weight) @ layer.linear_q_up_proj.weight.T
    q = q.view(S, B, HEADS, QK + ROPE)
    combined = x @ layer.linear_kv_down_proj.weight.T
    latent, rotary_key = combined[..., :KV_RANK], combined[..., KV_RANK:]
    kv = (_rms(latent, layer.kv_layernorm.weight) @ layer.linear_kv_up_proj.weight.T).view(S, B, HEADS, QK + V)
    cos, sin = _angles(yarn)
    query = torch.cat((q[..., :QK], _rope(q[..., QK:], cos, sin)), dim=-1)
    shared_key = _rope(rotary_key[:, :, None, :], cos, sin)
    scale = (_get_mscale(FACTOR, MSCALE_ALL_DIM) ** 2 if yarn else 1.0) / math.sqrt(QK + ROPE)
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    rows = []
    for row in range(B):
        heads = []
        for head in range(HEADS):
            key = torch.cat((kv[:, row, head, :QK], shared_key[:, row, 0]), dim=-1)
            scores = (query[:, row, head] @ key.T * scale).masked_fill(future, float("-inf"))
            heads.append(scores.softmax(-1) @ kv[:, row, head, QK:])
        rows.append(torch.cat(heads, dim=-1))
    return torch.stack(rows, dim=1) @ layer.linear_proj.weight.T


def _layer(q_lora_rank, yarn, backend):
    model_parallel_cuda_manual_seed(3)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=q_lora_rank,
                               attention_backend=backend, params_dtype=torch.float64,
                               **MLA, **(YARN if yarn else {}))
    layer = MultiLatentAttention(config, 1)
    initialize_deterministically(layer, "attention", 3)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norm weights away from 1, so that a norm left out shows
        for norm in (layer.q_layernorm, layer.kv_layernorm):
            if norm is not None:
                norm.weight.add_(torch.randn(norm.weight.shape, generator=generator, dtype=torch.float64))
    return layer


@pytest.mark.parametrize("backend", ["sdpa", "local", "flash"])
@pytest.mark.parametrize("q_lora_rank", [None, Q_RANK], ids=["no-q-latent", "q-latent"])
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_layer_equals_a_plain_fp64_computation(backend, q_lora_rank, yarn):
    layer = _layer(q_lora_rank, yarn, backend)
    assert (layer.flash_attention is not None) == (backend == "flash")
    assert (layer.linear_q_proj is None) == (q_lora_rank is not None)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, HIDDEN, generator=generator, dtype=torch.float64)
    output_grad = torch.randn(S, B, HIDDEN, generator=generator, dtype=torch.float64)
    output, bias = layer(x)
    assert bias is None and output.shape == (S, B, HIDDEN)
    weights = [param for param in layer.parameters()]
    got = torch.autograd.grad(output, weights, output_grad)
    expected_output = _plain_mla(layer, x, yarn)
    expected = torch.autograd.grad(expected_output, weights, output_grad)
    torch.testing.assert_close(output, expected_output, rtol=0, atol=1e-6)
    for (name, _), grad, want in zip(layer.named_parameters(), got, expected):
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-6, msg=name)


def test_yarn_here_moves_the_frequencies_and_both_factors_differ_from_one():
    """The YaRN case above tests something: the ramp lies inside the rotary channels, and the softmax scale and
    the rotary angles each carry a factor of their own."""
    plain = 1.0 / BASE ** (torch.arange(0, ROPE, 2).double() / ROPE)
    yarn = _yarn_inverse_frequencies()
    assert yarn[0] == plain[0] and yarn[-1] == plain[-1] / FACTOR and plain[1] / FACTOR < yarn[1] < plain[1]
    assert _get_mscale(FACTOR, MSCALE_ALL_DIM) != 1.0 and _get_mscale(FACTOR, MSCALE) != _get_mscale(FACTOR,
                                                                                                      MSCALE_ALL_DIM)


def test_selective_recompute_gives_the_same_gradients():
    results = []
    for granularity in (None, "selective"):
        model_parallel_cuda_manual_seed(3)
        config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=Q_RANK,
                                   recompute_granularity=granularity, **MLA)
        layer = MultiLatentAttention(config, 1)
        initialize_deterministically(layer, "attention", 3)
        x = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(0), requires_grad=True)
        layer(x)[0].square().sum().backward()
        results.append([x.grad] + [param.grad for param in layer.parameters()])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _layer_results(tp, sequence_parallel, path):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(5)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, init_seed=5,
                               q_lora_rank=Q_RANK, sequence_parallel=sequence_parallel, **MLA, **YARN)
    layer = TransformerLayer(config, layer_number=1)
    assert isinstance(layer.self_attention, MultiLatentAttention)
    generator = torch.Generator().manual_seed(0)
    hidden, output_grad = (torch.randn(S * 2, B, HIDDEN, generator=generator) for _ in range(2))
    results = layer_results_on_this_rank(layer, hidden, output_grad, sequence_parallel,
                                         lambda _, param: not getattr(param, "tensor_model_parallel", False))
    if dist.get_rank() == 0:
        torch.save(results, path)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_layer_matches_tp1(sequence_parallel, tmp_path):
    run_distributed(_layer_results, 1, 1, False, tmp_path / "tp1.pt", timeout=60)
    run_distributed(_layer_results, 2, 2, sequence_parallel, tmp_path / "tp2.pt", timeout=60)
    expected, observed = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    replicated = [key for key in observed if key.startswith("on every rank:")]
    assert any("linear_kv_down_proj" in key for key in replicated) and any("q_layernorm" in key for key in replicated)
    assert all(observed[key] for key in replicated), {key: observed[key] for key in replicated}
    for key, value in expected.items():
        if not key.startswith("on every rank:"):
            torch.testing.assert_close(observed[key], value, rtol=1e-5, atol=1e-6, msg=key)
