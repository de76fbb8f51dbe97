"""SwiGLU: silu(gate) * up from fc1's output [..., 2f], first half the gate and second half the up projection
(the layout of mlp.py's fc1, stride 2 over TP); output [..., f] in the input dtype. The reference is
PyTorch's SiLU and product in the input dtype, saving the input alone as the fused kernels do (left to autograd
it would also keep silu(gate), half as much again), its backward writing the gradients in place into the one
tensor it returns (autograd's would make four more of the output's size on the way); the compiled and triton
paths compute in fp32 and save the input alone; the kernels write both halves' gradients into one [..., 2f]
tensor.
"""
import torch
import torch.nn.functional as F

from megatron_ds.core.fusions._triton import cdiv, check_device, elementwise_tiles, kernel, tl
from megatron_ds.core.fusions.backends import FusedOp, compiled


def _swiglu_fp32(x):
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def _write_swiglu_gradients(gate, up, grad, gate_grad, up_grad):
    """silu(gate) * up's gradients written into gate_grad and up_grad, no other tensor made: up's is grad silu(gate),
    gate's grad up (s + silu(gate) (1 - s)) with s = sigmoid(gate)."""
    torch.sigmoid(gate, out=gate_grad)
    torch.mul(gate, gate_grad, out=up_grad)
    gate_grad.addcmul_(gate_grad, up_grad, value=-1).add_(up_grad).mul_(up).mul_(grad)
    up_grad.mul_(grad)


class _SwiGLUReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x_grad = torch.empty_like(x)
        _write_swiglu_gradients(*x.chunk(2, dim=-1), grad, *x_grad.chunk(2, dim=-1))
        return x_grad


class _SwiGLUOfHalves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        gate_grad, up_grad = torch.empty_like(gate), torch.empty_like(up)
        _write_swiglu_gradients(gate, up, grad, gate_grad, up_grad)
        return gate_grad, up_grad


def swiglu_reference(x):
    """silu(gate) * up with gate, up = x.chunk(2, -1), by PyTorch's kernels in x's dtype; saves x alone, and its
    backward makes the input's gradient alone, as the fused kernels do."""
    return _SwiGLUReference.apply(x)


def swiglu_of_halves_reference(gate, up):
    """swiglu_reference with the gate and up projections as two tensors (the MoE experts' grouped GEMMs)."""
    return _SwiGLUOfHalves.apply(gate, up)


def swiglu_compile(x):
    """torch.compile of the reference math."""
    return compiled(_swiglu_fp32)(x)


@kernel
def _swiglu_forward(X, Y, rows, f, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (r < rows)[:, None] & (c < f)[None, :]
    src = X + r[:, None] * (2 * f) + c[None, :]
    gate = tl.load(src, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(src + f, mask=inside, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(Y + r[:, None] * f + c[None, :], y.to(Y.dtype.element_ty), mask=inside)


@kernel
def _swiglu_backward(DY, X, DX, rows, f, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (r < rows)[:, None] & (c < f)[None, :]
    src = X + r[:, None] * (2 * f) + c[None, :]
    gate = tl.load(src, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(src + f, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(DY + r[:, None] * f + c[None, :], mask=inside, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    dst = DX + r[:, None] * (2 * f) + c[None, :]
    tl.store(dst, d_gate.to(DX.dtype.element_ty), mask=inside)
    tl.store(dst + f, (dy * silu).to(DX.dtype.element_ty), mask=inside)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        check_device(x, op="swiglu")
        if x.size(-1) % 2:
            raise ValueError(f"swiglu needs an even last dim (gate and up halves), got {x.size(-1)}")
        f = x.size(-1) // 2
        x2d = x.reshape(-1, 2 * f).contiguous()
        rows = x2d.size(0)
        y = torch.empty(rows, f, dtype=x.dtype, device=x.device)
        block_m, block_n = elementwise_tiles(f)
        if y.numel():
            _swiglu_forward[(cdiv(rows, block_m), cdiv(f, block_n))](x2d, y, rows, f, BLOCK_M=block_m,
                                                                     BLOCK_N=block_n)
        ctx.save_for_backward(x2d)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], f)

    @staticmethod
    def backward(ctx, grad_output):
        (x2d,) = ctx.saved_tensors
        rows, f = x2d.size(0), x2d.size(1) // 2
        dy = grad_output.reshape(rows, f).contiguous()
        dx = torch.empty_like(x2d)
        block_m, block_n = elementwise_tiles(f)
        if dy.numel():
            _swiglu_backward[(cdiv(rows, block_m), cdiv(f, block_n))](dy, x2d, dx, rows, f, BLOCK_M=block_m,
                                                                      BLOCK_N=block_n)
        return dx.view(ctx.shape)


def swiglu_triton(x):
    """Triton kernels, forward and backward."""
    return _SwiGLU.apply(x)


OPS = (FusedOp("swiglu", {"reference": swiglu_reference, "triton": swiglu_triton, "compile": swiglu_compile},
               faster_compiled_on_cpu=True),)
