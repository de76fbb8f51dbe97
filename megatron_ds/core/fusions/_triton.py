"""Triton import shim shared by the fused ops.

Kernels are written as plain functions decorated with `kernel`; they are handed to `triton.jit` on their
first launch, not at import. Triton decides at `jit` time whether a kernel is compiled for the GPU or run by
its CPU interpreter (`TRITON_INTERPRET=1`), so deferring it lets tests set the variable after this package
was imported. Without triton installed the module still imports (`tl.constexpr` annotations resolve to a
stub) and `TRITON_IMPORT_ERROR` says why the backend is missing.
"""
import os

import torch

try:
    import triton
    import triton.language as tl
    TRITON_IMPORT_ERROR = None
except ImportError as error:  # the backend registry reports this; nothing here is required
    triton = None
    TRITON_IMPORT_ERROR = f"triton is not installed ({error})"

    class _LanguageStub:
        constexpr = object

    tl = _LanguageStub()


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


class kernel:  # noqa: N801 - used as a decorator, like triton.jit
    """A Triton kernel jitted on first launch (once per interpreter mode): `kernel_fn[grid](*args)`."""

    def __init__(self, fn):
        self.fn = fn
        self._jitted = {}

    def __getitem__(self, grid):
        mode = interpreting()
        if mode not in self._jitted:
            self._jitted[mode] = triton.jit(self.fn)
        return self._jitted[mode][grid]


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_warps_for(block: int) -> int:
    """Warps for a one-row-per-program kernel with `block` elements in flight."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def parallel_programs(device: torch.device, per_sm: int = 4) -> int:
    """How many persistent programs to launch for reductions across rows (partial sums per program)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count * per_sm
    return 4  # the interpreter runs programs one after another; a few partials keep tests quick


def row_programs(rows: int, block_m: int, device: torch.device) -> int:
    """Row-block programs for a 2-D kernel that reduces a bias gradient over rows (fp32 partials each)."""
    return max(1, min(cdiv(rows, block_m), 64 if device.type == "cuda" else 2))


def check_device(*tensors, op: str):
    """Triton kernels need CUDA tensors, or CPU tensors under the interpreter."""
    for tensor in tensors:
        if tensor is not None and tensor.device.type != "cuda" and not interpreting():
            raise RuntimeError(f"the triton {op} kernel got a {tensor.device.type} tensor; triton needs CUDA "
                               f"tensors (or TRITON_INTERPRET=1 for tests): use --fusion-backend compile or "
                               f"reference on this device")
