"""LayerNorm and RMSNorm over the last dim: weight, optional bias, eps; statistics in fp32, output in the
input dtype (the weight may be fp32 while the input is bf16). The LayerNorm reference is PyTorch's kernel
(input plus per-row statistics saved); the RMSNorm reference saves the input alone and recomputes its fp32
math in backward (as fast here as autograd through the fp32 math, which would save fp32 copies); the triton
kernels save the input plus fp32 mean and 1/std per row.
"""
import torch
import torch.nn.functional as F

from megatron_ds.core.fusions._recompute import recomputed_in_backward
from megatron_ds.core.fusions._triton import check_device, kernel, next_power_of_2, num_warps_for, parallel_programs, tl
from megatron_ds.core.fusions.backends import FusedOp, compiled

try:  # NVIDIA apex (not on PyPI); optional, detected once at import
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine
    APEX_IMPORT_ERROR = None
except Exception as error:  # ImportError, or apex built without its CUDA extensions
    fused_layer_norm_affine = fused_rms_norm_affine = None
    APEX_IMPORT_ERROR = f"apex.normalization is not importable ({type(error).__name__}: {error})"


def _layer_norm_fp32(x, weight, bias=None, eps: float = 1e-5):
    bias32 = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias32, eps).to(x.dtype)


def _rms_norm_fp32(x, weight, bias=None, eps: float = 1e-5):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def layer_norm_reference(x, weight, bias=None, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, by PyTorch's kernel in x's dtype."""
    bias = bias.to(x.dtype) if bias is not None else None
    return F.layer_norm(x, x.shape[-1:], weight.to(x.dtype), bias, eps)


def rms_norm_reference(x, weight, bias=None, eps: float = 1e-5):
    """x / sqrt(mean(x^2) + eps) * weight + bias over the last dim, in fp32."""
    return recomputed_in_backward(_rms_norm_fp32, x, weight, bias, eps)


class _NormFootprint(torch.autograd.Function):
    """Shapes only: what the GPU's fused norm kernels keep for backward (the input and fp32 mean and 1/std per
    row) and the gradients they make, without the math."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        statistics = torch.empty((2, *x.shape[:-1]), dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, statistics)
        ctx.has_bias = bias is not None
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, _ = ctx.saved_tensors
        weight_grad = x.new_empty(x.shape[-1:])
        return torch.empty_like(x), weight_grad, torch.empty_like(weight_grad) if ctx.has_bias else None


def rms_norm_footprint(x, weight, bias=None):
    """For fake tensors (tools/dry_run.py): the memory a GPU's fused RMSNorm holds, where the CPU's reference
    recomputes its fp32 math in backward (several fp32 copies of the input at once)."""
    return _NormFootprint.apply(x, weight, bias)


def layer_norm_compile(x, weight, bias=None, eps: float = 1e-5):
    """torch.compile of the reference math."""
    return compiled(_layer_norm_fp32)(x, weight, bias, eps)


def rms_norm_compile(x, weight, bias=None, eps: float = 1e-5):
    """torch.compile of the reference math."""
    return compiled(_rms_norm_fp32)(x, weight, bias, eps)


def layer_norm_apex(x, weight, bias=None, eps: float = 1e-5):
    """apex's fused LayerNorm (CUDA); weight and bias cast to the input dtype, statistics in fp32."""
    weight = weight.to(x.dtype)
    if bias is None:
        bias = torch.zeros_like(weight)
    return fused_layer_norm_affine(x, weight, bias.to(x.dtype), x.shape[-1:], eps)


def rms_norm_apex(x, weight, bias=None, eps: float = 1e-5):
    """apex's fused RMSNorm (CUDA); a bias, which apex's RMSNorm lacks, is added afterwards."""
    y = fused_rms_norm_affine(x, weight.to(x.dtype), x.shape[-1:], eps)
    return y if bias is None else y + bias.to(x.dtype)


@kernel
def _norm_forward(X, Y, W, B, MEAN, RSTD, n, eps,
                  RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(X + row * n + cols, mask=inside, other=0.0).to(tl.float32)
    if RMS:
        centered = x
    else:
        mean = tl.sum(x, axis=0) / n
        centered = tl.where(inside, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n + eps)
    y = centered * rstd * tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + row * n + cols, y.to(Y.dtype.element_ty), mask=inside)
    if not RMS:
        tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@kernel
def _norm_backward(DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, rows, n,
                   RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Each program handles rows pid, pid + programs, ...; it writes dx per row and its partial dw, db."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(pid, rows, programs):
        offset = tl.cast(row, tl.int64) * n
        x = tl.load(X + offset + cols, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(DY + offset + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(inside, (x - tl.load(MEAN + row)) * rstd, 0.0)
        wdy = w * dy
        dx = wdy - xhat * (tl.sum(xhat * wdy, axis=0) / n)
        if not RMS:
            dx -= tl.sum(wdy, axis=0) / n
        tl.store(DX + offset + cols, (dx * rstd).to(DX.dtype.element_ty), mask=inside)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW_PARTIAL + pid * n + cols, dw, mask=inside)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid * n + cols, db, mask=inside)


class _FusedNorm(torch.autograd.Function):
    """Forward: one program per row (fp32 statistics saved). Backward: dx per row, dw/db as fp32 partial
    sums per program, added up in torch."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        check_device(x, weight, bias, op="rms_norm" if rms else "layer_norm")
        n = x.size(-1)
        if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
            raise ValueError(f"norm weight/bias must have shape ({n},)")
        x2d = x.reshape(-1, n).contiguous()
        rows = x2d.size(0)
        y = torch.empty_like(x2d)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        block = next_power_of_2(n)
        if rows:
            _norm_forward[(rows,)](x2d, y, weight.contiguous(), bias if bias is not None else weight, mean, rstd,
                                   n, float(eps), RMS=rms, HAS_BIAS=bias is not None, BLOCK=block,
                                   num_warps=num_warps_for(block))
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.rms, ctx.has_bias, ctx.bias_dtype, ctx.shape = rms, bias is not None, getattr(bias, "dtype", None), x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_output):
        x2d, weight, mean, rstd = ctx.saved_tensors
        rows, n = x2d.shape
        dy = grad_output.reshape(rows, n).contiguous()
        dx = torch.empty_like(x2d)
        programs = max(1, min(rows, parallel_programs(x2d.device)))
        dw_partial = torch.zeros(programs, n, dtype=torch.float32, device=x2d.device)
        db_partial = torch.zeros_like(dw_partial) if ctx.has_bias else dw_partial
        block = next_power_of_2(n)
        if rows:
            _norm_backward[(programs,)](dy, x2d, weight.contiguous(), mean, rstd, dx, dw_partial, db_partial,
                                        rows, n, RMS=ctx.rms, HAS_BIAS=ctx.has_bias, BLOCK=block,
                                        num_warps=num_warps_for(block))
        dw = dw_partial.sum(0).to(weight.dtype)
        db = db_partial.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dw, db, None, None


def layer_norm_triton(x, weight, bias=None, eps: float = 1e-5):
    """Triton kernels, forward and backward."""
    return _FusedNorm.apply(x, weight, bias, eps, False)


def rms_norm_triton(x, weight, bias=None, eps: float = 1e-5):
    """Triton kernels, forward and backward."""
    return _FusedNorm.apply(x, weight, bias, eps, True)


def _apex_reason(device_type):
    return APEX_IMPORT_ERROR


OPS = (
    FusedOp("layer_norm", {"reference": layer_norm_reference, "triton": layer_norm_triton,
                           "compile": layer_norm_compile, "apex": layer_norm_apex}, checks={"apex": _apex_reason}),
    FusedOp("rms_norm", {"reference": rms_norm_reference, "triton": rms_norm_triton,
                         "compile": rms_norm_compile, "apex": rms_norm_apex}, checks={"apex": _apex_reason},
            faster_compiled_on_cpu=True),
)
