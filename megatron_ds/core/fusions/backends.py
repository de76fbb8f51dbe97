"""Which implementation serves each fused op: `reference` (plain PyTorch, the definition of correct),
`triton` (hand-written kernels, forward and backward), `compile` (torch.compile of the reference math),
`apex` (NVIDIA apex's norm kernels). `select_backend` resolves a `--fusion-backend` value per op once, at
start-up (transformer/fused_ops.py does it for the model and logs the choices).

`auto` prefers, on CUDA: triton, then apex (norms only), then compile, then reference, unless an op names
its own CUDA order. On CPU it compiles the ops that bench/ops.py measured faster compiled on one CPU thread
(`FusedOp.faster_compiled_on_cpu`) once the model is wide enough (`CPU_COMPILE_MIN_HIDDEN`): compilation
costs seconds per op and process, which a small model's iterations never earn back. Triton never runs on
CPU outside tests (its interpreter checks numerics; it is not a kernel).
"""
import functools
import importlib
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from megatron_ds.core.fusions._triton import TRITON_IMPORT_ERROR, interpreter_problem

FLAG = "--fusion-backend"
BACKENDS = ("auto", "triton", "compile", "apex", "reference")
CUDA_PREFERENCE = ("triton", "apex", "compile", "reference")
CPU_COMPILE_MIN_HIDDEN = 512

# op modules, imported on first use of the registry (they import this module)
_OP_MODULES = ("fused_softmax", "fused_layer_norm", "fused_rope", "fused_bias_gelu", "fused_bias_dropout_add",
               "fused_swiglu", "fused_cross_entropy", "flash_attention")


@dataclass(frozen=True)
class FusedOp:
    """One fused operation: its implementations (same signature each). `checks` adds op-specific
    availability tests: backend -> fn(device_type) -> reason or None."""
    name: str
    implementations: Mapping[str, Callable]
    checks: Mapping[str, Callable[[str], Optional[str]]] = field(default_factory=dict)
    faster_compiled_on_cpu: bool = False
    cuda_preference: Tuple[str, ...] = CUDA_PREFERENCE


class _State:
    """The package's only mutable state: compiled callables and the warnings already given."""

    def __init__(self):
        self.compiled: Dict[Tuple[Callable, bool], Callable] = {}
        self.warned = set()


_STATE = _State()


def compiled(fn: Callable, dynamic: bool = True) -> Callable:
    """torch.compile(fn), built once per function: with dynamic shapes, so new sizes reuse the compiled code, or
    (dynamic False) specialised to each call's sizes, for a function whose Python loops depend on them."""
    if (fn, dynamic) not in _STATE.compiled:
        _STATE.compiled[fn, dynamic] = torch.compile(fn, dynamic=dynamic)
    return _STATE.compiled[fn, dynamic]


@functools.lru_cache(maxsize=None)
def registered_ops() -> Dict[str, FusedOp]:
    """{op name: FusedOp} for every fused op."""
    ops = {}
    for module_name in _OP_MODULES:
        module = importlib.import_module(f"megatron_ds.core.fusions.{module_name}")
        for op in module.OPS:
            ops[op.name] = op
    return ops


def _device_type(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


@functools.lru_cache(maxsize=None)
def _cxx_compiler() -> Optional[str]:
    return next((cc for cc in ("g++", "c++", "clang++") if shutil.which(cc)), None)


def _generic_reason(backend: str, device_type: str) -> Optional[str]:
    """Why `backend` cannot run on this device, or None when it can."""
    if backend == "triton":
        if TRITON_IMPORT_ERROR:
            return TRITON_IMPORT_ERROR
        if device_type != "cuda":
            return interpreter_problem()
    elif backend == "compile":
        if not hasattr(torch, "compile"):
            return f"torch {torch.__version__} has no torch.compile"
        if device_type == "cpu" and _cxx_compiler() is None:
            return "torch.compile on CPU needs a C++ compiler (g++ or clang++) on PATH"
        if device_type == "cuda" and TRITON_IMPORT_ERROR:
            return f"torch.compile on CUDA generates triton code: {TRITON_IMPORT_ERROR}"
    elif backend == "apex" and device_type != "cuda":
        return "apex kernels need a CUDA device"
    return None


def unavailable_reason(op_name: str, backend: str, device=None) -> Optional[str]:
    """Why `backend` cannot serve `op_name` on `device` (default: CUDA if present, else CPU); None if it can."""
    op = _op(op_name)
    if backend not in op.implementations:
        return f"{op_name} has no {backend} implementation (it has: {', '.join(op.implementations)})"
    device_type = _device_type(device)
    reason = _generic_reason(backend, device_type)
    if reason is None and backend in op.checks:
        reason = op.checks[backend](device_type)
    return reason


def is_available(op_name: str, backend: str, device=None) -> bool:
    return unavailable_reason(op_name, backend, device) is None


def _op(op_name: str) -> FusedOp:
    ops = registered_ops()
    if op_name not in ops:
        raise ValueError(f"unknown fused op {op_name!r}; known: {', '.join(ops)}")
    return ops[op_name]


def auto_order(op_name: str, device=None, hidden_size: Optional[int] = None) -> Tuple[str, ...]:
    """The backends `auto` tries for op_name on device, best first, for a model of hidden_size (None: unknown,
    which on CPU means the reference)."""
    op = _op(op_name)
    if _device_type(device) == "cuda":
        return tuple(backend for backend in op.cuda_preference if backend in op.implementations)
    if op.faster_compiled_on_cpu and hidden_size is not None and hidden_size >= CPU_COMPILE_MIN_HIDDEN:
        return ("compile", "reference")
    return ("reference",)


def select_backend(op_name: str, requested: str = "auto", device=None, hidden_size: Optional[int] = None) -> str:
    """The backend that serves op_name for a --fusion-backend value. An explicit backend that cannot run
    raises ValueError saying why; `auto` takes the best available one and warns once when it falls back."""
    if requested not in BACKENDS:
        raise ValueError(f"{FLAG} {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested != "auto":
        reason = unavailable_reason(op_name, requested, device)
        if reason:
            raise ValueError(f"{FLAG} {requested}: cannot use {requested} for {op_name}: {reason}")
        return requested
    order = auto_order(op_name, device, hidden_size)
    for backend in order:
        reason = unavailable_reason(op_name, backend, device)
        if reason is None:
            break
        if backend == order[0]:
            first_reason = reason
    if backend != order[0]:
        key = (order[0], first_reason)
        if key not in _STATE.warned:
            _STATE.warned.add(key)
            warnings.warn(f"{FLAG} auto: {order[0]} unavailable ({first_reason}); {op_name} uses {backend}"
                          f" (and other ops fall back likewise)", RuntimeWarning, stacklevel=2)
    return backend


def get_fused_op(op_name: str, requested: str = "auto", device=None, hidden_size: Optional[int] = None) -> Callable:
    """The callable implementing op_name under select_backend(op_name, requested, device, hidden_size)."""
    return _op(op_name).implementations[select_backend(op_name, requested, device, hidden_size)]


def compile_statistics() -> Tuple[int, float]:
    """(graphs torch.compile has built in this process, seconds it spent building them)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if dynamo_utils is None:
        return 0, 0.0
    return (dynamo_utils.counters["stats"]["unique_graphs"],
            sum(dynamo_utils.compilation_time_metrics.get("_compile.compile_inner", [])))
