"""apex's fused norms against the references (CUDA with apex only; apex is optional and not on PyPI)."""
import pytest
import torch

from megatron_ds.core import fusions
from tests.support.fused_op_checks import assert_matches, leaf

pytestmark = pytest.mark.skipif(fusions.APEX_IMPORT_ERROR is not None or not torch.cuda.is_available(),
                                reason=fusions.APEX_IMPORT_ERROR or "apex kernels need CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm, with_bias", [("layer_norm", True), ("layer_norm", False), ("rms_norm", False),
                                             ("rms_norm", True)])
def test_apex_norms(norm, with_bias, dtype):
    x = leaf((3, 2, 200), dtype, "cuda", scale=2.0)
    weight = (1 + 0.1 * leaf((200,), dtype, "cuda", seed=3)).detach().requires_grad_()
    bias = leaf((200,), dtype, "cuda", seed=4) if with_bias else None
    assert_matches(getattr(fusions, f"{norm}_apex"), getattr(fusions, f"{norm}_reference"), [x, weight, bias, 1e-5])
