"""The one dropout mask of the model: every dropout (embedding, attention probabilities, bias-dropout-add in
every backend) draws its keep-mask with `dropout_keep_mask`, in PyTorch, before any kernel runs. So for a
given generator state the pattern does not depend on --fusion-backend, and activation recompute (which
restores the generator and TP RNG tracker states) replays it.

The draw is `bernoulli_` straight into a bool tensor: 1 byte per element, what backward keeps. `rand >= p`
would first materialize a 4-byte uniform per element (on CUDA, for attention dropout, twice the bytes of
the bf16 probabilities it masks). On a CPU, bernoulli_ costs up to twice as much as rand >= p per element.
"""
import torch


def dropout_keep_mask(x, p: float):
    """Bool keep-mask shaped like x (True = keep, probability 1 - p) from the current device's generator."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - p)


class _MaskedScale(torch.autograd.Function):
    """x * keep * scale, saving only the bool mask (PyTorch's CPU dropout keeps its mask in x's dtype)."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return (x * keep).mul_(scale)  # in place: one temporary of x's size, not two

    @staticmethod
    def backward(ctx, grad_output):
        (keep,) = ctx.saved_tensors
        return grad_output * keep * ctx.scale, None, None


def dropout(x, p: float, training: bool):
    """Inverted dropout with the keep-mask of dropout_keep_mask; the identity (no random draw) when not
    training or p == 0."""
    if not training or p == 0.0:
        return x
    return _MaskedScale.apply(x, dropout_keep_mask(x, p), 1.0 / (1.0 - p))
