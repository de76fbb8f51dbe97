"""Fusion tests run the triton kernels natively on CUDA when present, else on CPU through Triton's
interpreter. The interpreter must be switched on before triton is first imported (triton jits its own
standard library at import), so this file sets TRITON_INTERPRET=1 when it is loaded, on machines without
CUDA, if nothing imported triton earlier in this pytest process. If something did, the in-process CPU
kernel tests skip and test_triton_kernels.py::test_interpreter_in_fresh_process reruns them in a new
process.
"""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megatron_ds.core.fusions._triton import interpreter_problem, interpreting  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a torch.compile test (a cold compile costs 10-30 s on a CPU)")


@pytest.fixture(params=DEVICES)
def triton_device(request):
    """Device for a triton-kernel test: CPU tensors run under the interpreter, CUDA ones compiled."""
    if request.param == "cpu" and interpreter_problem():
        pytest.skip(f"no triton interpreter in this process ({interpreter_problem()})")
    if request.param == "cuda" and interpreting():
        pytest.skip("TRITON_INTERPRET=1: this process interprets kernels instead of compiling them")
    return torch.device(request.param)
