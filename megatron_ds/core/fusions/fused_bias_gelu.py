"""bias + GeLU: gelu(x + bias), exact erf form by default, or approximate='tanh'; output in x's dtype, bias
optional. The reference is PyTorch's add and GeLU kernels in x's dtype (x + bias saved); the compiled and
triton paths compute in fp32 and save x and bias only; the kernels reduce the bias gradient as fp32 partial
sums.
"""
import torch
import torch.nn.functional as F

from megatron_ds.core.fusions._triton import cdiv, check_device, elementwise_tiles, kernel, row_programs, tl
from megatron_ds.core.fusions.backends import FusedOp, compiled

_APPROXIMATIONS = ("none", "tanh")


def _check(approximate):
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"bias_gelu approximate must be one of {_APPROXIMATIONS}, got {approximate!r}")


def _bias_gelu_fp32(x, bias=None, approximate: str = "none"):
    z = x.float() if bias is None else x.float() + bias.float()
    return F.gelu(z, approximate=approximate).to(x.dtype)


def bias_gelu_reference(x, bias=None, approximate: str = "none"):
    """gelu(x + bias) by PyTorch's kernels in x's dtype."""
    _check(approximate)
    return F.gelu(x if bias is None else x + bias.to(x.dtype), approximate=approximate)


def bias_gelu_compile(x, bias=None, approximate: str = "none"):
    """torch.compile of the reference math."""
    _check(approximate)
    return compiled(_bias_gelu_fp32)(x, bias, approximate)


# constants: sqrt(2/pi) = 0.79788..., 1/sqrt(2) = 0.70710..., 1/sqrt(2*pi) = 0.39894..., 3 * 0.044715 = 0.134145
@kernel
def _gelu_forward(X, B, Y, rows, n, HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (r < rows)[:, None] & (c < n)[None, :]
    offsets = r[:, None] * n + c[None, :]
    z = tl.load(X + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + c, mask=c < n, other=0.0).to(tl.float32)[None, :]
    if TANH:
        inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # tanh(inner), saturates cleanly at +-1
        y = 0.5 * z * (1.0 + t)
    else:
        y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=inside)


@kernel
def _gelu_backward(DY, X, B, DX, DB_PARTIAL, rows, n, HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (i, j) handles column block j of row blocks i, i + P, ...; it writes dx and its db partial."""
    pid_m = tl.program_id(0)
    programs_m = tl.num_programs(0)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside_c = c < n
    if HAS_BIAS:
        bias = tl.load(B + c, mask=inside_c, other=0.0).to(tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row0 in range(pid_m * BLOCK_M, rows, programs_m * BLOCK_M):
        r = tl.cast(row0, tl.int64) + tl.arange(0, BLOCK_M)
        inside = (r < rows)[:, None] & inside_c[None, :]
        offsets = r[:, None] * n + c[None, :]
        z = tl.load(X + offsets, mask=inside, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += bias[None, :]
        if TANH:
            inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
            t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
            slope = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
        else:
            slope = (0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
                     + z * 0.3989422804014327 * tl.exp(-0.5 * z * z))
        dx = tl.load(DY + offsets, mask=inside, other=0.0).to(tl.float32) * slope
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=inside)
        if HAS_BIAS:
            db += tl.sum(tl.where(inside, dx, 0.0), axis=0)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid_m * n + c, db, mask=inside_c)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, tanh):
        check_device(x, bias, op="bias_gelu")
        n = x.size(-1)
        x2d = x.reshape(-1, n).contiguous()
        rows = x2d.size(0)
        y = torch.empty_like(x2d)
        block_m, block_n = elementwise_tiles(n)
        if x2d.numel():
            grid = (cdiv(rows, block_m), cdiv(n, block_n))
            _gelu_forward[grid](x2d, bias if bias is not None else x2d, y, rows, n, HAS_BIAS=bias is not None,
                                TANH=tanh, BLOCK_M=block_m, BLOCK_N=block_n)
        ctx.save_for_backward(x2d, bias)
        ctx.tanh, ctx.shape = tanh, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_output):
        x2d, bias = ctx.saved_tensors
        rows, n = x2d.shape
        dy = grad_output.reshape(rows, n).contiguous()
        dx = torch.empty_like(x2d)
        block_m, block_n = elementwise_tiles(n)
        programs = row_programs(rows, block_m, x2d.device)
        db_partial = torch.zeros(programs, n, dtype=torch.float32, device=x2d.device) if bias is not None else dx
        if x2d.numel():
            _gelu_backward[(programs, cdiv(n, block_n))](
                dy, x2d, bias if bias is not None else x2d, dx, db_partial, rows, n, HAS_BIAS=bias is not None,
                TANH=ctx.tanh, BLOCK_M=block_m, BLOCK_N=block_n)
        db = db_partial.sum(0).to(bias.dtype) if bias is not None else None
        return dx.view(ctx.shape), db, None


def bias_gelu_triton(x, bias=None, approximate: str = "none"):
    """Triton kernels, forward and backward."""
    _check(approximate)
    return _BiasGelu.apply(x, bias, approximate == "tanh")


OPS = (FusedOp("bias_gelu",
               {"reference": bias_gelu_reference, "triton": bias_gelu_triton, "compile": bias_gelu_compile}),)
