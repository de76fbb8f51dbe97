"""LayerNorm and RMSNorm, chosen by TransformerConfig.normalization; statistics in fp32."""
import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-5, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class LayerNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-5, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x):
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


def build_norm(config):
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return cls(config.hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
