"""residual + dropout(x + bias): bias optional, output in the promoted dtype of x and residual; the reference
runs PyTorch's kernels in that dtype, the compiled and triton paths compute in fp32.

Every backend keeps the elements the model's one dropout mask keeps (dropout.py: the counter hash of a seed
drawn per call and the element's index), so the mask is the same for the same generator state whatever the
backend, and activation recompute and the TP RNG tracker replay it. The reference saves that mask (bool, 1 byte
per element) for backward; the compiled path makes it inside its graph from the seed's row hashes and column
mixes, computed before it; the Triton kernels make it in registers in forward and again in backward, and keep only
the seed.
Not training, or p == 0: residual + x + bias, no mask and no draw. `rows` numbers the rows of x (viewed as
[numel / last dim, last dim]) for the mask where the caller numbers them (dropout.py), in every backend.
"""
import torch

from megatron_ds.core.fusions._triton import cdiv, check_device, elementwise_tiles, kernel, row_programs, tl
from megatron_ds.core.fusions.backends import FusedOp, compiled
from megatron_ds.core.fusions.counter_hash import draw_seed, drop_threshold, keep_tile
from megatron_ds.core.fusions.dropout import dropout, element_mixes, tensor_keep_mask


def _bda_math(x, bias, residual, mixes, threshold: int, scale: float):
    """residual + keep * (x + bias) * scale in fp32, in the promoted dtype; mixes (dropout.element_mixes) None
    means no dropout."""
    out_dtype = torch.promote_types(x.dtype, residual.dtype)
    y = x.float() if bias is None else x.float() + bias.float()
    if mixes is not None:
        y = torch.where(tensor_keep_mask(x, mixes, threshold), y * scale, 0.0)
    return (residual.float() + y).to(out_dtype)


def _dropout_args(x, p, training):
    """(seed, threshold, keep scale) of one call; seed None without dropout."""
    if training and p > 0.0:
        return draw_seed(x.device), drop_threshold(p), 1.0 / (1.0 - p)
    return None, 0, 1.0


def bias_dropout_add_reference(x, bias, residual, p: float, training: bool, rows=None):
    """residual + dropout(x + bias) with the model's one dropout mask."""
    if bias is not None:
        x = x + bias.to(x.dtype)
    return residual + dropout(x, p, training, rows)


def _bda_input_grad(grad_output, mixes, threshold: int, scale: float, x_dtype: torch.dtype, with_bias: bool):
    """(dx, db or None) of _bda_math: the mask hashed again from the seed's mixes."""
    dx = torch.where(tensor_keep_mask(grad_output, mixes, threshold), grad_output.float() * scale, 0.0)
    db = dx.reshape(-1, dx.size(-1)).sum(0) if with_bias else None
    return dx.to(x_dtype), db


class _CompiledBiasDropoutAdd(torch.autograd.Function):
    """Forward and backward each one compiled graph run without autograd, so that neither stores the mask: on a
    CPU, inductor writing the hashed mask out as bool costs 4x the fused forward that uses it in place."""

    @staticmethod
    def forward(ctx, x, bias, residual, seed, threshold, scale, rows):
        ctx.save_for_backward(seed, rows)
        ctx.threshold, ctx.scale, ctx.x_dtype = threshold, scale, x.dtype
        ctx.bias_dtype, ctx.residual_dtype = getattr(bias, "dtype", None), residual.dtype
        return compiled(_bda_math)(x, bias, residual, element_mixes(x, seed, rows), threshold, scale)

    @staticmethod
    def backward(ctx, grad_output):
        seed, rows = ctx.saved_tensors
        with_bias = ctx.bias_dtype is not None
        dx, db = compiled(_bda_input_grad)(grad_output, element_mixes(grad_output, seed, rows), ctx.threshold,
                                           ctx.scale, ctx.x_dtype, with_bias)
        return (dx, db.to(ctx.bias_dtype) if with_bias else None, grad_output.to(ctx.residual_dtype), None, None,
                None, None)


def bias_dropout_add_compile(x, bias, residual, p: float, training: bool, rows=None):
    """torch.compile of the reference math, the mask hashed inside the compiled graphs (forward and backward);
    without dropout and bias, residual + x."""
    seed, threshold, scale = _dropout_args(x, p, training)
    if seed is None and bias is None and x.dtype == residual.dtype:
        # the reference is then one PyTorch add, which rounds the fp32 sum once as the graph would, and whose
        # backward passes the gradient on where the graph's copies it (bf16 -> fp32 -> bf16) for x and residual
        return bias_dropout_add_reference(x, bias, residual, p, training)
    if seed is None:
        return compiled(_bda_math)(x, bias, residual, None, 0, 1.0)
    return _CompiledBiasDropoutAdd.apply(x, bias, residual, seed, threshold, scale, rows)


@kernel
def _bda_forward(X, B, R, SEED, ROWS, OUT, rows, n, threshold, scale, HAS_BIAS: tl.constexpr,
                 HAS_MASK: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (r < rows)[:, None] & (c < n)[None, :]
    offsets = r[:, None] * n + c[None, :]
    y = tl.load(X + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + c, mask=c < n, other=0.0).to(tl.float32)[None, :]
    if HAS_MASK:
        numbers = r
        if HAS_ROWS:  # the caller's numbers of the rows
            numbers = tl.load(ROWS + r, mask=r < rows, other=0).to(tl.int64)
        y = tl.where(keep_tile(SEED, numbers, c, threshold), y * scale, 0.0)
    y += tl.load(R + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, y.to(OUT.dtype.element_ty), mask=inside)


@kernel
def _bda_backward(DY, SEED, ROWS, DX, DB_PARTIAL, rows, n, threshold, scale, HAS_BIAS: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx = dy * keep * scale, the mask hashed again from the seed; program (i, j) also sums its rows' dx into a
    db partial for column block j."""
    pid_m = tl.program_id(0)
    programs_m = tl.num_programs(0)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside_c = c < n
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row0 in range(pid_m * BLOCK_M, rows, programs_m * BLOCK_M):
        r = tl.cast(row0, tl.int64) + tl.arange(0, BLOCK_M)
        inside = (r < rows)[:, None] & inside_c[None, :]
        offsets = r[:, None] * n + c[None, :]
        dx = tl.load(DY + offsets, mask=inside, other=0.0).to(tl.float32)
        if HAS_MASK:
            numbers = r
            if HAS_ROWS:
                numbers = tl.load(ROWS + r, mask=r < rows, other=0).to(tl.int64)
            dx = tl.where(keep_tile(SEED, numbers, c, threshold), dx * scale, 0.0)
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=inside)
        if HAS_BIAS:
            db += tl.sum(tl.where(inside, dx, 0.0), axis=0)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid_m * n + c, db, mask=inside_c)


class _BiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, seed, threshold, scale, row_numbers):
        check_device(x, bias, residual, seed, op="bias_dropout_add")
        if residual.shape != x.shape:
            raise ValueError(f"bias_dropout_add: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        n = x.size(-1)
        x2d = x.reshape(-1, n).contiguous()
        rows = x2d.size(0)
        out = torch.empty(x2d.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        block_m, block_n = elementwise_tiles(n)
        if x2d.numel():
            _bda_forward[(cdiv(rows, block_m), cdiv(n, block_n))](
                x2d, bias if bias is not None else x2d, residual.reshape(rows, n).contiguous(),
                seed if seed is not None else x2d, row_numbers if row_numbers is not None else x2d, out, rows, n,
                threshold, float(scale), HAS_BIAS=bias is not None, HAS_MASK=seed is not None,
                HAS_ROWS=row_numbers is not None, BLOCK_M=block_m, BLOCK_N=block_n)
        ctx.save_for_backward(seed, row_numbers)
        ctx.threshold, ctx.scale, ctx.shape, ctx.x_dtype = threshold, float(scale), x.shape, x.dtype
        ctx.bias_dtype, ctx.residual_dtype = getattr(bias, "dtype", None), residual.dtype
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_output):
        seed, row_numbers = ctx.saved_tensors
        n = ctx.shape[-1]
        dy = grad_output.reshape(-1, n).contiguous()
        rows = dy.size(0)
        has_bias = ctx.bias_dtype is not None
        dx = torch.empty(dy.shape, dtype=ctx.x_dtype, device=dy.device)
        block_m, block_n = elementwise_tiles(n)
        programs = row_programs(rows, block_m, dy.device)
        db_partial = torch.zeros(programs, n, dtype=torch.float32, device=dy.device) if has_bias else dx
        if dy.numel():
            _bda_backward[(programs, cdiv(n, block_n))](
                dy, seed if seed is not None else dy, row_numbers if row_numbers is not None else dy, dx, db_partial,
                rows, n, ctx.threshold, ctx.scale, HAS_BIAS=has_bias, HAS_MASK=seed is not None,
                HAS_ROWS=row_numbers is not None, BLOCK_M=block_m, BLOCK_N=block_n)
        db = db_partial.sum(0).to(ctx.bias_dtype) if has_bias else None
        return dx.view(ctx.shape), db, grad_output.to(ctx.residual_dtype), None, None, None, None


def bias_dropout_add_triton(x, bias, residual, p: float, training: bool, rows=None):
    """Triton kernels, forward and backward; the mask is hashed in both, only the seed (and rows) is saved."""
    return _BiasDropoutAdd.apply(x, bias, residual, *_dropout_args(x, p, training), rows)


OPS = (FusedOp("bias_dropout_add",
               {"reference": bias_dropout_add_reference, "triton": bias_dropout_add_triton,
                "compile": bias_dropout_add_compile}, faster_compiled_on_cpu=True),)
