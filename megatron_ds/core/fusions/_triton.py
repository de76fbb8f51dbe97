"""Triton import shim shared by the fused ops.

Kernels are written as plain functions decorated with `kernel`; they are handed to `triton.jit` on their
first launch, not at import (without triton installed this module still imports: `tl.constexpr`
annotations and constants resolve to a stub and `TRITON_IMPORT_ERROR` says why the backend is missing).

Triton's CPU interpreter (`TRITON_INTERPRET=1`, for tests) must be switched on before triton is first
imported: triton's own standard library (tl.sum, tl.max, tl.sigmoid) is jitted at import, in the mode
set then. `interpreter_ready()` tells whether this process can interpret kernels.
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
        @staticmethod
        def constexpr(value):
            return value

    tl = _LanguageStub()


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def interpreter_ready() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1, so its kernels can run on CPU tensors."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.max, InterpretedFunction)


def interpreter_problem():
    """Why kernels cannot run on CPU tensors in this process, or None."""
    if TRITON_IMPORT_ERROR:
        return TRITON_IMPORT_ERROR
    if not interpreting():
        return "triton kernels need a CUDA device (TRITON_INTERPRET=1 runs them on CPU, for tests only)"
    if not interpreter_ready():
        return "TRITON_INTERPRET=1 was set after triton was imported; set it before the first import of triton"
    return None


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


def elementwise_tiles(n: int):
    """(rows, columns) per program of the 2-D elementwise kernels over [rows, n]: 16 rows, up to 256 columns."""
    return 16, min(next_power_of_2(n), 256)


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
        if tensor is not None and tensor.device.type != "cuda":
            problem = interpreter_problem()
            if problem:
                raise RuntimeError(f"the triton {op} kernel got a {tensor.device.type} tensor: {problem}; use "
                                   f"--fusion-backend compile or reference on this device")
