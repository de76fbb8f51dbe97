"""Triton's interpreter runs the triton kernels on CPU tensors only when TRITON_INTERPRET=1 is set before
triton is first imported (triton jits its own standard library at import). Any test module importing
megatron_ds imports triton, so the variable is set here, before any test module is collected, on machines
without CUDA (tests/core/fusions/conftest.py uses it)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
