"""Scale + mask + softmax over the last dim of attention scores [b, heads, sq, sk] (the `local` attention path).

Masks are bool, True = masked, broadcastable to the scores ([b or 1, 1, sq, sk]); `causal=True` masks keys
after the query (aligned to the bottom right when sq < sk, so a query attends to the first sk - sq + q + 1
keys). Math in fp32, probabilities in the input dtype. A row with every key masked gives zeros, not NaN
(as Megatron's fused softmax does). The reference and the triton kernel save only the probabilities, in
the input dtype; backward is scale * y * (dy - sum(dy * y)).
"""
import torch

from megatron_ds.core.fusions._triton import check_device, kernel, next_power_of_2, num_warps_for, tl
from megatron_ds.core.fusions.backends import FusedOp, compiled


def causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """[sq, sk] bool, True where query q may not see key k (k > q + sk - sq)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=1 + sk - sq)


def _scale_mask_softmax_fp32(scores, mask=None, scale: float = 1.0, causal: bool = False):
    """softmax(scale * scores, masked positions excluded) in fp32, returned in scores' dtype."""
    x = scores.float() * scale
    if causal:
        causal_part = causal_mask(x.size(-2), x.size(-1), x.device)
        mask = causal_part if mask is None else mask | causal_part
    if mask is None:
        return torch.softmax(x, dim=-1).to(scores.dtype)
    # the lowest finite value, not -inf: a fully masked row then gives a finite (uniform) softmax, zeroed
    # below, where -inf would give NaN in forward and backward; elsewhere exp underflows to exactly 0 either way
    probs = torch.softmax(x.masked_fill(mask, torch.finfo(torch.float32).min), dim=-1).to(scores.dtype)
    fully_masked = mask.all(dim=-1, keepdim=True)
    if torch.compiler.is_compiling() or fully_masked.any():  # eager skips the pass when no row needs it
        probs = probs.masked_fill(fully_masked, 0.0)
    return probs


class _SoftmaxSavingProbabilities(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, mask, scale, causal):
        probs = _scale_mask_softmax_fp32(scores, mask, scale, causal)
        ctx.save_for_backward(probs)
        ctx.scale = float(scale)
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        (probs,) = ctx.saved_tensors
        # y * (dy - sum(dy * y)) by PyTorch's one-pass kernel (fp32 accumulation), then the scale
        grad_scores = torch._softmax_backward_data(grad_probs.contiguous(), probs, -1, probs.dtype)
        return grad_scores.mul_(ctx.scale), None, None, None


def scale_mask_softmax_reference(scores, mask=None, scale: float = 1.0, causal: bool = False):
    """softmax(scale * scores, masked positions excluded) in fp32, returned in scores' dtype; saves the
    probabilities alone for backward."""
    return _SoftmaxSavingProbabilities.apply(scores, mask, scale, causal)


def scale_mask_softmax_compile(scores, mask=None, scale: float = 1.0, causal: bool = False):
    """torch.compile of the reference math."""
    return compiled(_scale_mask_softmax_fp32)(scores, mask, scale, causal)


@kernel
def _softmax_forward(X, Y, MASK, heads, sq, sk, mask_sb, mask_sh, mask_sq, mask_sk, scale,
                     HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # over b * heads * sq, contiguous rows of length sk
    q = row % sq
    h = (row // sq) % heads
    b = row // (sq * heads)
    cols = tl.arange(0, BLOCK)
    masked = cols >= sk
    x = tl.load(X + row * sk + cols, mask=cols < sk, other=0.0).to(tl.float32) * scale
    if CAUSAL:
        masked = masked | (cols > q + sk - sq)
    if HAS_MASK:
        user = tl.load(MASK + b * mask_sb + h * mask_sh + q * mask_sq + cols * mask_sk, mask=cols < sk, other=1)
        masked = masked | (user != 0)
    x = tl.where(masked, float("-inf"), x)
    row_max = tl.max(x, axis=0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    exp = tl.exp(x - row_max)
    total = tl.sum(exp, axis=0)
    y = exp / tl.maximum(total, 1.0)
    tl.store(Y + row * sk + cols, y.to(Y.dtype.element_ty), mask=cols < sk)


@kernel
def _softmax_backward(DY, Y, DX, sk, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < sk
    dy = tl.load(DY + row * sk + cols, mask=inside, other=0.0).to(tl.float32)
    y = tl.load(Y + row * sk + cols, mask=inside, other=0.0).to(tl.float32)
    dot = tl.sum(dy * y, axis=0)
    tl.store(DX + row * sk + cols, (scale * y * (dy - dot)).to(DX.dtype.element_ty), mask=inside)


class _ScaleMaskSoftmax(torch.autograd.Function):
    """Forward: fused scale, mask, softmax (one program per row). Backward: scale * y * (dy - sum(dy * y))."""

    @staticmethod
    def forward(ctx, scores, mask, scale, causal):
        check_device(scores, mask, op="scale_mask_softmax")
        if not 1 <= scores.dim() <= 4:
            raise ValueError(f"scale_mask_softmax expects [b, heads, sq, sk] scores, got shape {tuple(scores.shape)}")
        shape = scores.shape
        x = scores.reshape((1,) * (4 - scores.dim()) + tuple(shape)).contiguous()
        b, heads, sq, sk = x.shape
        y = torch.empty_like(x)
        if mask is not None:
            mask_view = mask.expand(x.shape).view(torch.uint8)
            mask_arg, mask_strides = mask_view, mask_view.stride()
        else:
            mask_arg, mask_strides = x, (0, 0, 0, 0)
        block = next_power_of_2(sk)
        if x.numel():
            _softmax_forward[(b * heads * sq,)](x, y, mask_arg, heads, sq, sk, *mask_strides, float(scale),
                                                HAS_MASK=mask is not None, CAUSAL=bool(causal), BLOCK=block,
                                                num_warps=num_warps_for(block))
        ctx.save_for_backward(y)
        ctx.scale, ctx.shape = float(scale), shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, grad_output):
        (y,) = ctx.saved_tensors
        sk = y.size(-1)
        dy = grad_output.reshape(y.shape).contiguous()
        dx = torch.empty_like(y)
        block = next_power_of_2(sk)
        if y.numel():
            _softmax_backward[(y.numel() // sk,)](dy, y, dx, sk, ctx.scale, BLOCK=block,
                                                  num_warps=num_warps_for(block))
        return dx.view(ctx.shape), None, None, None


def scale_mask_softmax_triton(scores, mask=None, scale: float = 1.0, causal: bool = False):
    """Triton kernels, forward and backward."""
    return _ScaleMaskSoftmax.apply(scores, mask, scale, causal)


OPS = (FusedOp("scale_mask_softmax",
               {"reference": scale_mask_softmax_reference, "triton": scale_mask_softmax_triton,
                "compile": scale_mask_softmax_compile}, faster_compiled_on_cpu=True),)
