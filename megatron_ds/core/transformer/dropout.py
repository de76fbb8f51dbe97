"""Dropout that keeps a 1-byte mask for backward (PyTorch's CPU dropout keeps it in the input dtype:
2 bytes in bf16, 4 in fp32), so the saved activations match the paper's accounting."""
import torch


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, p):
        keep = torch.rand(input_.shape, device=input_.device) >= p
        ctx.save_for_backward(keep)
        ctx.scale = 1.0 / (1.0 - p)
        return input_ * keep * ctx.scale

    @staticmethod
    def backward(ctx, grad_output):
        (keep,) = ctx.saved_tensors
        return grad_output * keep * ctx.scale, None


def dropout(input_, p, training):
    """Inverted dropout drawing its mask from the current torch generator (so the RNG tracker and
    activation recompute control it)."""
    if not training or p == 0.0:
        return input_
    return _Dropout.apply(input_, p)
