"""Multi-latent attention in the planner: its parameters per TP rank are those of the layer built (with and without a
query latent, with biases or not), its FLOPs per token those torch's FlopCounterMode counts in the layer's matmuls,
and DeepSeek-V3's attention parameters per layer the hand count from its published sizes."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_ds.core import parallel_state
from megatron_ds.core.models.gpt.flops import attention_gemm_flops_per_token, attention_score_flops_per_token
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer
from megatron_ds.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron_ds.planning.parameters import layer_parameters, mla_parameters
from tests.support.planning_specs import count_parameters

MLA = dict(multi_latent_attention=True, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=10,
           normalization="RMSNorm", position_embedding_type="rope", gated_linear_unit=True, ffn_hidden_size=40,
           hidden_dropout=0.0, attention_dropout=0.0)


def _config(q_lora_rank, bias=False, **extra):
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, q_lora_rank=q_lora_rank, bias=bias,
                             **MLA, **extra)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("q_lora_rank, bias", [(None, False), (16, False), (16, True)])
def test_parameters_per_tp_rank_are_the_layer_s(tp, q_lora_rank, bias):
    config = _config(q_lora_rank, bias)
    for rank in (0, tp - 1):
        with parallel_state.simulated_model_parallel(tp, rank, 1, 0):
            built = TransformerLayer(config, layer_number=1)
        assert count_parameters(built) == layer_parameters(config, tp)
        assert count_parameters(built.self_attention) == mla_parameters(config, tp)


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_flops_per_token_are_the_layer_s_matmuls(q_lora_rank):
    s, b = 9, 2
    config = _config(q_lora_rank, attention_backend="local")
    model_parallel_cuda_manual_seed(1)
    with parallel_state.simulated_model_parallel(1, 0, 1, 0):
        layer = MultiLatentAttention(config, 1)
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(s, b, config.hidden_size))
    per_token = attention_gemm_flops_per_token(config) + attention_score_flops_per_token(config, s)
    assert counter.get_total_flops() == s * b * per_token


def test_deepseek_v3_attention_parameters_by_hand():
    """h 7168, 128 heads, q rank 1536, kv rank 512, qk 128 + rope 64, v 128 (arXiv 2412.19437, section 4.2)."""
    config = TransformerConfig(num_layers=1, hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
                               kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                               multi_latent_attention=True, normalization="RMSNorm", position_embedding_type="rope",
                               bias=False)
    by_hand = (7168 * 1536 + 1536 + 1536 * 128 * 192      # query: down, norm, up
               + 7168 * (512 + 64) + 512 + 512 * 128 * 256  # key-value: down, norm, up
               + 128 * 128 * 7168)                          # output
    assert mla_parameters(config) == by_hand == 187_107_328
