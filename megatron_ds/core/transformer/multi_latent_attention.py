"""Multi-latent attention (MLA: DeepSeek-V2 and V3's attention; Megatron-Core's MLASelfAttention). For each token's
hidden state x, with r = qk_pos_emb_head_dim channels of each query and key rotated:

    queries      q = W_q_up norm(W_q_down x)   (no --q-lora-rank: q = W_q x)     heads x (qk_head_dim + r)
    latent       [c, k_r] = W_kv_down x                                          kv_lora_rank + r
    keys, values [k_nope, v] = W_kv_up norm(c)                                   heads x (qk_head_dim + v_head_dim)
    query = [q_nope, rope(q_r)], key = [k_nope, rope(k_r)]: one rotary key k_r shared by every head
    output       W_proj softmax(query key^T x scale) v, scale = m^2 / sqrt(qk_head_dim + r)

m is YaRN's get_mscale(--rotary-scaling-factor, --mscale-all-dim) with --rope-type yarn (1 without); YaRN's other
factor, get_mscale(factor, --mscale) / m, is already in the rotary angles (rotary.py), so each enters once, as in
Megatron-Core and DeepSeek-V3. The rotary channels leave the projections interleaved (pairs 2i, 2i + 1) and are
taken apart into halves before the rotate-half rotation, as Megatron-Core and DeepSeek-V3's weights have them.

Tensor parallelism splits the heads: the query and the up projections are column-parallel, linear_proj
row-parallel. The down projections and their norms are whole on every TP rank (Megatron-Core's placement). With
sequence parallelism they run on this rank's tokens, so their gradients are summed over TP as the layer norms'
are, and the up projections gather the latents along the sequence; the rotary key, which only this rank's heads
read, is gathered along the sequence (SP) or copied (TP) so that its gradient sums every rank's heads. Ulysses,
selective recompute and the core-attention backends: attention.AttentionHeads.
"""
import torch

from megatron_ds.core.parallel_state import get_tensor_model_parallel_world_size
from megatron_ds.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    divide,
    fp8_recipe_of,
    mark_sequence_parallel_parameter,
)
from megatron_ds.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron_ds.core.tensor_parallel.random import init_method_normal
from megatron_ds.core.transformer.attention import AttentionHeads
from megatron_ds.core.transformer.norms import build_norm
from megatron_ds.core.transformer.rotary import apply_rotary, yarn_get_mscale


def mla_softmax_scale(config):
    """m^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim), m = YaRN's get_mscale(factor, mscale_all_dim) (1 without)."""
    mscale = yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim) if config.rope_type == "yarn" \
        else 1.0
    return mscale * mscale / (config.qk_head_dim + config.qk_pos_emb_head_dim) ** 0.5


def deinterleave(x):
    """The last dim's channel pairs (2i, 2i + 1) taken apart: [x0, x2, x4, ..., x1, x3, x5, ...]."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MultiLatentAttention(AttentionHeads):
    """Takes and returns what SelfAttention does: [s, b, h] in ([s/t, b, h] with SP), (output, bias) out."""

    def __init__(self, config, layer_number):
        super().__init__(config, layer_number, softmax_scale=mla_softmax_scale(config))
        heads, hidden = config.num_attention_heads, config.hidden_size
        self.num_heads = divide(heads, get_tensor_model_parallel_world_size(), "--num-attention-heads over TP:")
        self.query_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        init_method = init_method_normal(config.init_method_std)
        self.linear_q_proj = self.linear_q_down_proj = self.q_layernorm = self.linear_q_up_proj = None
        if config.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(hidden, heads * self.query_head_dim, config=config, bias=False,
                                                      init_method=init_method)
        else:
            self.linear_q_down_proj = _replicated_linear(config, hidden, config.q_lora_rank)
            self.q_layernorm = build_norm(config, config.q_lora_rank)
            self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank, heads * self.query_head_dim,
                                                         config=config, bias=False, init_method=init_method)
        self.linear_kv_down_proj = _replicated_linear(config, hidden, config.kv_lora_rank + config.qk_pos_emb_head_dim)
        self.kv_layernorm = build_norm(config, config.kv_lora_rank)
        self.linear_kv_up_proj = ColumnParallelLinear(config.kv_lora_rank,
                                                      heads * (config.qk_head_dim + config.v_head_dim),
                                                      config=config, bias=False, init_method=init_method)
        self.linear_proj = RowParallelLinear(heads * config.v_head_dim, hidden, config=config, bias=config.bias,
                                             input_is_parallel=True, skip_bias_add=True,
                                             init_method=init_method_normal(config.output_layer_init_std))

    def forward(self, hidden_states, attention_mask=None):
        query, key, value = self.query_key_value(hidden_states, self.rotary_angles)
        context = self.attend(query, key, value, attention_mask)
        return self.linear_proj(context.flatten(2))

    def query_key_value(self, hidden_states, rotary_angles):
        """This rank's heads: query and key [s, b, heads, qk_head_dim + qk_pos_emb_head_dim], their rotary channels
        turned by rotary_angles(s, device) -> (cos, sin) (the sequence's positions; generation's are past its cached
        ones), and value [s, b, heads, v_head_dim]."""
        config = self.config
        query = self._query_heads(hidden_states)
        latent, rotary_key = self._kv_latent(hidden_states)
        key_value, _ = self.linear_kv_up_proj(self.kv_layernorm(latent))
        s, b = key_value.shape[:2]
        key_nope, value = key_value.view(s, b, self.num_heads, -1).split([config.qk_head_dim, config.v_head_dim],
                                                                         dim=-1)
        query_nope, query_rotary = query.split([config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1)
        query_rotary, rotary_key = apply_rotary(deinterleave(query_rotary), deinterleave(rotary_key),
                                                *rotary_angles(s, query.device), self.rotary_pos_emb)
        query = torch.cat((query_nope, query_rotary), dim=-1)
        key = torch.cat((key_nope, rotary_key.expand(s, b, self.num_heads, -1)), dim=-1)
        return query, key, value

    def _query_heads(self, hidden_states):
        """[s, b, heads on this rank, qk_head_dim + qk_pos_emb_head_dim]."""
        if self.linear_q_proj is not None:
            query, _ = self.linear_q_proj(hidden_states)
        else:
            query, _ = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(hidden_states)[0]))
        return query.view(*query.shape[:2], self.num_heads, self.query_head_dim)

    def _kv_latent(self, hidden_states):
        """The key-value latent [s (SP: s/t), b, kv_lora_rank] and the rotary key [s, b, 1, qk_pos_emb_head_dim]
        (not rotated yet), whose gradient is summed over the TP ranks' heads."""
        combined, _ = self.linear_kv_down_proj(hidden_states)
        latent, rotary_key = combined.split([self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim], dim=-1)
        if self.config.sequence_parallel:
            rotary_key = gather_from_sequence_parallel_region(rotary_key.contiguous())
        else:
            rotary_key = copy_to_tensor_model_parallel_region(rotary_key)
        return latent, rotary_key.unsqueeze(2)


def _replicated_linear(config, input_size, output_size):
    """A down projection: whole on every TP rank, without bias; under sequence parallelism it sees this rank's
    tokens only, so its gradient is summed over TP, and so are its FP8 amaxes that span the tokens."""
    linear = ColumnParallelLinear(input_size, output_size, config=config, bias=False, tensor_parallel=False,
                                  init_method=init_method_normal(config.init_method_std))
    if config.sequence_parallel:
        mark_sequence_parallel_parameter(linear.weight)
        linear.fp8_recipe = fp8_recipe_of(config, "tokens")
    return linear
