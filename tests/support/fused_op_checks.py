"""Forward + backward of a fused op against its reference."""
import torch

# bf16: the references run PyTorch's kernels in the input dtype and round after each op (bias-add, dropout,
# residual-add; a norm's weight gradient summed from bf16 products), the fused paths round once from fp32
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


def leaf(shape, dtype, device, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(device=device, dtype=dtype).requires_grad_()


def forward_backward(fn, inputs, grad_seed=1):
    """Outputs and input gradients of fn(*inputs) for fixed random output gradients."""
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    generator = torch.Generator().manual_seed(grad_seed)
    grads = [torch.randn(out.shape, generator=generator).to(out) for out in outputs]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    input_grads = torch.autograd.grad(outputs, leaves, grads)
    return [out.detach() for out in outputs], list(input_grads)


def assert_matches(fn, reference, inputs, dtype=None, tolerances=None):
    """fn and reference agree in outputs, input gradients and their dtypes (tolerance by dtype)."""
    outputs, grads = forward_backward(fn, inputs)
    ref_outputs, ref_grads = forward_backward(reference, inputs)
    dtype = dtype or next(t.dtype for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point())
    tolerance = tolerances or TOLERANCES[dtype]
    for name, got, want in [("output", o, r) for o, r in zip(outputs, ref_outputs)] + \
            [("grad", g, r) for g, r in zip(grads, ref_grads)]:
        assert got.dtype == want.dtype, f"{name} dtype {got.dtype} != reference {want.dtype}"
        assert got.shape == want.shape, f"{name} shape {tuple(got.shape)} != reference {tuple(want.shape)}"
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **tolerance, msg=lambda m: f"{name}: {m}")


def saved_tensors(fn, *args):
    """The tensors autograd saves for backward while running fn(*args)."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args)
    return saved
