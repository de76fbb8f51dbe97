"""Autograd that saves an op's inputs alone, for a reference that autograd would make keep more than the fused
kernels do: RMSNorm's fp32 math (fp32 copies of its input and intermediates, five times the bytes of a bf16
input). The fused kernels and the paper's accounting keep only the input.
Here backward recomputes the math from the saved inputs and differentiates it (on CPU as fast as autograd's
saved-tensor path)."""
import torch


class _RecomputedInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, math, *args):
        tensors = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
        ctx.save_for_backward(*(args[i] for i in tensors))
        ctx.math, ctx.tensor_positions = math, tensors
        ctx.constants = [None if i in tensors else arg for i, arg in enumerate(args)]
        return math(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        args, wanted = list(ctx.constants), []
        for position, tensor in zip(ctx.tensor_positions, ctx.saved_tensors):
            needs_grad = ctx.needs_input_grad[1 + position]
            args[position] = tensor.detach().requires_grad_(needs_grad)
            if needs_grad:
                wanted.append(position)
        with torch.enable_grad():
            outputs = ctx.math(*args)
        grads = torch.autograd.grad(outputs, [args[i] for i in wanted], grad_outputs, allow_unused=True)
        input_grads = dict(zip(wanted, grads))
        return (None, *(input_grads.get(i) for i in range(len(args))))


def recomputed_in_backward(math, *args):
    """math(*args) whose backward keeps only the tensors in args and recomputes math to differentiate it;
    math returns one tensor."""
    return _RecomputedInBackward.apply(math, *args)
