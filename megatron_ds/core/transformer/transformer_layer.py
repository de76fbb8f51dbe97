"""Pre-norm transformer layer on sequence-first tensors [s, b, h]:
x + dropout(attn(norm(x))), then + dropout(mlp(norm(.))). One TP all-reduce in each of the attention
output projection and fc2 in forward, and one in the backward of each column-parallel input."""
import torch
import torch.nn.functional as F

from megatron_ds.core.tensor_parallel.random import initialize_deterministically
from megatron_ds.core.transformer.attention import SelfAttention
from megatron_ds.core.transformer.mlp import MLP
from megatron_ds.core.transformer.norms import build_norm


def bias_dropout_add(x, bias, residual, p, training):
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)


class TransformerLayer(torch.nn.Module):
    """layer_number is 1-based and global (across pipeline stages), as in Megatron."""

    def __init__(self, config, layer_number=1):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config, layer_number)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = MLP(config)
        initialize_deterministically(self, f"decoder.layers.{layer_number - 1}", config.init_seed)

    def forward(self, hidden_states, attention_mask=None):
        p, training = self.config.hidden_dropout, self.training
        attention_out, attention_bias = self.self_attention(self.input_layernorm(hidden_states), attention_mask)
        hidden_states = bias_dropout_add(attention_out, attention_bias, hidden_states, p, training)
        mlp_out, mlp_bias = self.mlp(self.pre_mlp_layernorm(hidden_states))
        return bias_dropout_add(mlp_out, mlp_bias, hidden_states, p, training)
