"""LayerNorm and RMSNorm, chosen by TransformerConfig.normalization; statistics in fp32. Under sequence
parallelism their parameters see only this rank's tokens, so their gradients are summed over TP."""
import torch
import torch.nn.functional as F

from megatron_ds.core.tensor_parallel.layers import mark_sequence_parallel_parameter
from megatron_ds.core.transformer.fused_ops import fused_op


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-5, dtype=torch.float32, fused=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.fused = fused

    def forward(self, x):
        if self.fused is not None:
            return self.fused(x, self.weight, None, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class LayerNorm(torch.nn.Module):
    """Saves only its input for backward (2 bytes per element in 16-bit), as the paper counts."""

    def __init__(self, hidden_size, eps=1e-5, dtype=torch.float32, fused=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.fused = fused

    def forward(self, x):
        if self.fused is not None:
            return self.fused(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


def build_norm(config):
    cls, op = (RMSNorm, "rms_norm") if config.normalization == "RMSNorm" else (LayerNorm, "layer_norm")
    norm = cls(config.hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype,
               fused=fused_op(config, op, config.persist_layer_norm))
    if config.sequence_parallel:
        for param in norm.parameters():
            mark_sequence_parallel_parameter(param)
    return norm
