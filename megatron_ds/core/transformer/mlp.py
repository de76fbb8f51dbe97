"""MLP: fc1 column-parallel, activation (bias + GeLU, or SwiGLU with a gated linear unit), fc2 row-parallel."""
import torch

from megatron_ds.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_ds.core.tensor_parallel.random import init_method_normal
from megatron_ds.core.transformer.fused_ops import op_backend, op_implementation


class MLP(torch.nn.Module):
    """tensor_parallel=False: the whole MLP on this rank, no TP communication (an MoE expert replicated over TP,
    Megatron-DeepSpeed's experts without --enable-expert-tensor-parallelism)."""

    def __init__(self, config, tensor_parallel=True):
        super().__init__()
        self.gated = config.gated_linear_unit
        self.activation = op_implementation(config, "swiglu" if self.gated else "bias_gelu")
        fc1_size = config.ffn_hidden_size * (2 if self.gated else 1)
        # stride 2: each TP rank holds its slice of the gate and its slice of the up projection. A fused
        # bias-GeLU takes fc1's bias itself; otherwise (the reference, or SwiGLU) fc1's GEMM adds it, which
        # costs nothing there, where a separate add would cost a pass over fc1's output and its gradient.
        activation_takes_bias = not self.gated and op_backend(config, "bias_gelu") != "reference"
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, fc1_size, config=config, bias=config.bias,
                                               stride=2 if self.gated else 1, skip_bias_add=activation_takes_bias,
                                               init_method=init_method_normal(config.init_method_std),
                                               tensor_parallel=tensor_parallel)
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, config=config,
                                            bias=config.bias, input_is_parallel=True, skip_bias_add=True,
                                            init_method=init_method_normal(config.output_layer_init_std),
                                            tensor_parallel=tensor_parallel)

    def forward(self, hidden_states):
        intermediate, bias = self.linear_fc1(hidden_states)  # bias: None when fc1 added it
        intermediate = self.activation(intermediate) if self.gated else self.activation(intermediate, bias)
        return self.linear_fc2(intermediate)
