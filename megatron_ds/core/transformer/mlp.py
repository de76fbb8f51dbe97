"""MLP: fc1 column-parallel, activation (GeLU, or SwiGLU with a gated linear unit), fc2 row-parallel."""
import torch
import torch.nn.functional as F

from megatron_ds.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_ds.core.tensor_parallel.random import init_method_normal
from megatron_ds.core.transformer.fused_ops import fused_op


class MLP(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gated = config.gated_linear_unit
        self.fused_activation = (fused_op(config, "swiglu", config.bias_swiglu_fusion) if self.gated
                                 else fused_op(config, "bias_gelu", config.bias_gelu_fusion))
        fc1_size = config.ffn_hidden_size * (2 if self.gated else 1)
        # stride 2: each TP rank holds its slice of the gate and its slice of the up projection
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, fc1_size, config=config, bias=config.bias,
                                               stride=2 if self.gated else 1,
                                               skip_bias_add=self.fused_activation is not None and not self.gated,
                                               init_method=init_method_normal(config.init_method_std))
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, config=config,
                                            bias=config.bias, input_is_parallel=True, skip_bias_add=True,
                                            init_method=init_method_normal(config.output_layer_init_std))

    def forward(self, hidden_states):
        intermediate, bias = self.linear_fc1(hidden_states)
        if self.fused_activation is not None:
            intermediate = (self.fused_activation(intermediate) if self.gated
                            else self.fused_activation(intermediate, bias))
        elif self.gated:
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = F.silu(gate) * up
        else:
            intermediate = F.gelu(intermediate)
        return self.linear_fc2(intermediate)
