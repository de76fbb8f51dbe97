"""Triton's interpreter runs the triton kernels on CPU tensors only when TRITON_INTERPRET=1 is set before
triton is first imported (triton jits its own standard library at import). Any test module importing
megatron_ds imports triton, so the variable is set here, before any test module is collected, on machines
without CUDA (tests/unit/core/fusions/conftest.py uses it).

The tier of a test is its folder: tests/e2e/conftest.py marks every test under tests/e2e/ e2e, and a test elsewhere
that carries the e2e marker fails the run."""
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

E2E = Path(__file__).parent / "e2e"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects any test
def pytest_collection_modifyitems(items):
    misplaced = [item.nodeid for item in items
                 if item.get_closest_marker("e2e") and not item.path.is_relative_to(E2E)]
    if misplaced:
        raise pytest.UsageError("the e2e marker outside tests/e2e/: the folder is what makes a test e2e "
                                "(tests/e2e/conftest.py marks every test there); move these tests there and drop "
                                "their marker:\n  " + "\n  ".join(misplaced))
