"""LayerNorm and RMSNorm, chosen by TransformerConfig.normalization: the parameters here, the math in
core/fusions (the backend's implementation, or the reference: statistics in fp32; the 16-bit input and
per-row statistics saved for backward). Under sequence parallelism their parameters see only this rank's tokens,
so their gradients are summed over TP; so are those of the query and key norms, which see only its heads."""
import torch
from torch._subclasses.fake_tensor import is_fake

from megatron_ds.core.fusions import layer_norm_reference, rms_norm_reference
from megatron_ds.core.fusions.fused_layer_norm import rms_norm_footprint
from megatron_ds.core.tensor_parallel.layers import mark_sequence_parallel_parameter
from megatron_ds.core.transformer.fused_ops import op_implementation


class RMSNorm(torch.nn.Module):
    """implementation(x, weight, bias, eps): a core.fusions rms_norm, the reference by default."""

    def __init__(self, hidden_size, eps=1e-5, dtype=torch.float32, implementation=rms_norm_reference):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.implementation = implementation

    def forward(self, x):
        if is_fake(x):  # the dry run: a GPU kernel's memory, not the reference's fp32 temporaries
            return rms_norm_footprint(x, self.weight)
        return self.implementation(x, self.weight, None, self.eps)


class LayerNorm(torch.nn.Module):
    """implementation(x, weight, bias, eps): a core.fusions layer_norm, the reference by default."""

    def __init__(self, hidden_size, eps=1e-5, dtype=torch.float32, implementation=layer_norm_reference):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.implementation = implementation

    def forward(self, x):
        return self.implementation(x, self.weight, self.bias, self.eps)


def build_norm(config, hidden_size=None, partial_gradients=None):
    """config.normalization over hidden_size channels (default the model's). partial_gradients: each TP rank's
    gradient of its parameters is a share of theirs, summed over TP (default: under sequence parallelism)."""
    cls, op = (RMSNorm, "rms_norm") if config.normalization == "RMSNorm" else (LayerNorm, "layer_norm")
    norm = cls(hidden_size or config.hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype,
               implementation=op_implementation(config, op))
    if config.sequence_parallel if partial_gradients is None else partial_gradients:
        for param in norm.parameters():
            mark_sequence_parallel_parameter(param)
    return norm
