"""Fusion tests run the triton kernels natively on CUDA when present, else on CPU through Triton's
interpreter, which tests/conftest.py switches on before triton is first imported. If something imported
triton earlier anyway (a pytest plugin), the in-process CPU kernel tests skip and
test_triton_kernels.py::test_interpreter_in_fresh_process reruns them in a new process.
"""
import pytest
import torch

from megatron_ds.core.fusions._triton import interpreter_problem, interpreting

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def triton_device(request):
    """Device for a triton-kernel test: CPU tensors run under the interpreter, CUDA ones compiled."""
    if request.param == "cpu" and interpreter_problem():
        pytest.skip(f"no triton interpreter in this process ({interpreter_problem()})")
    if request.param == "cuda" and interpreting():
        pytest.skip("TRITON_INTERPRET=1: this process interprets kernels instead of compiling them")
    return torch.device(request.param)
