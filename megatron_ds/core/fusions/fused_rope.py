"""Rotary position embedding applied to the query and the key in one call, rotate-half convention:
x [s, b, heads, d] (q and k may have different head counts), cos and sin [s, 1, 1, d]; rotation in fp32,
results in the inputs' dtype. cos and sin get no gradient. `apply_rotary_pos_emb` is the reference's
rotation of one tensor (transformer/rotary.py re-exports it; its `apply_rotary` runs these ops on the
leading channels for partial rotary).

y = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1); its adjoint (the backward) is
dx = dy * cos + cat(dy2 * sin2, -dy1 * sin1). The triton kernel reads cos/sin once per token for all
its heads and saves nothing but cos and sin.
"""
import torch

from megatron_ds.core.fusions._triton import check_device, kernel, next_power_of_2, tl
from megatron_ds.core.fusions.backends import FusedOp, compiled


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(x, cos, sin):
    """x: [s, b, heads, d]; rotation in fp32, result in x's dtype."""
    x32 = x.float()
    return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)


def _check_shapes(q, k, cos, sin):
    d = q.size(-1)
    if q.dim() != 4 or k.dim() != 4 or k.size(-1) != d or q.shape[:2] != k.shape[:2] or d % 2:
        raise ValueError(f"rotary embedding expects q, k [s, b, heads, d] with the same s, b and even d; got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if cos.shape != sin.shape or cos.size(0) != q.size(0) or cos.size(-1) != d or cos[0].numel() != d:
        raise ValueError(f"rotary embedding expects cos and sin [s, 1, 1, d] = [{q.size(0)}, 1, 1, {d}]; got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")


def rotary_pos_emb_reference(q, k, cos, sin):
    """(rope(q), rope(k))."""
    _check_shapes(q, k, cos, sin)
    return _rope_pair(q, k, cos, sin)


def _rope_pair(q, k, cos, sin):
    return apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)


def rotary_pos_emb_compile(q, k, cos, sin):
    """torch.compile of the reference."""
    _check_shapes(q, k, cos, sin)
    return compiled(_rope_pair)(q, k, cos, sin)


@kernel
def _rope_kernel(X, OUT, COS, SIN, batch, heads, x_ss, x_sb, x_sh, cos_ss, half,
                 BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token (s, b) rotates all its heads; OUT is contiguous [s, b, heads, d]."""
    token = tl.program_id(0).to(tl.int64)  # s_index * batch + b_index
    position = token // batch
    b = token % batch
    d = tl.arange(0, BLOCK_D)
    inside_d = d < half
    cos1 = tl.load(COS + position * cos_ss + d, mask=inside_d, other=0.0).to(tl.float32)
    cos2 = tl.load(COS + position * cos_ss + half + d, mask=inside_d, other=0.0).to(tl.float32)
    sin1 = tl.load(SIN + position * cos_ss + d, mask=inside_d, other=0.0).to(tl.float32)
    sin2 = tl.load(SIN + position * cos_ss + half + d, mask=inside_d, other=0.0).to(tl.float32)
    if BACKWARD:  # the adjoint rotation: the sines swap halves and change sign
        sin_a = -sin2
        sin_b = -sin1
    else:
        sin_a = sin1
        sin_b = sin2
    for head0 in range(0, heads, BLOCK_H):
        h = head0 + tl.arange(0, BLOCK_H)
        inside = (h < heads)[:, None] & inside_d[None, :]
        src = X + position * x_ss + b * x_sb + h[:, None] * x_sh + d[None, :]
        dst = OUT + (token * heads + h[:, None]) * (2 * half) + d[None, :]
        x1 = tl.load(src, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=inside, other=0.0).to(tl.float32)
        tl.store(dst, (x1 * cos1 - x2 * sin_a).to(OUT.dtype.element_ty), mask=inside)
        tl.store(dst + half, (x2 * cos2 + x1 * sin_b).to(OUT.dtype.element_ty), mask=inside)


def _rotate(x, cos2d, sin2d, backward):
    """A rotated (backward: adjoint-rotated) contiguous copy of x [s, b, heads, d]."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    s, b, heads, d = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        _rope_kernel[(s * b,)](x, out, cos2d, sin2d, b, heads, *x.stride()[:3], cos2d.stride(0), d // 2,
                               BACKWARD=backward, BLOCK_H=min(next_power_of_2(heads), 16),
                               BLOCK_D=next_power_of_2(d // 2))
    return out


class _RotaryQK(torch.autograd.Function):
    """Forward: rotate q and k (one launch each). Backward: the adjoint rotation of dq and dk."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        check_device(q, k, cos, op="rotary_pos_emb")
        _check_shapes(q, k, cos, sin)
        s, d = q.size(0), q.size(-1)
        cos2d, sin2d = cos.reshape(s, d).contiguous(), sin.reshape(s, d).contiguous()
        ctx.save_for_backward(cos2d, sin2d)
        return _rotate(q, cos2d, sin2d, False), _rotate(k, cos2d, sin2d, False)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos2d, sin2d = ctx.saved_tensors
        return _rotate(grad_q, cos2d, sin2d, True), _rotate(grad_k, cos2d, sin2d, True), None, None


def rotary_pos_emb_triton(q, k, cos, sin):
    """Triton kernel, forward and backward."""
    return _RotaryQK.apply(q, k, cos, sin)


OPS = (FusedOp("rotary_pos_emb",
               {"reference": rotary_pos_emb_reference, "triton": rotary_pos_emb_triton,
                "compile": rotary_pos_emb_compile}, faster_compiled_on_cpu=True),)
