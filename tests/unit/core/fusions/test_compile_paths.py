"""The torch.compile path of every op against its reference, forward and backward.

A cold compile costs 5-50 s on a small, shared CPU, so: one awkward shape per op, fp32 for every op, bf16
(with fp32 weights) for the norms only. The compiled function is the reference's own math, whose bf16
behaviour the triton tests already check; bf16 for the other ops: FUSIONS_COMPILE_BF16=1."""
import os

import pytest
import torch

from megatron_ds.core import fusions
from megatron_ds.core.transformer.rotary import RotaryEmbedding
from tests.support.fused_op_checks import assert_matches, leaf, saved_tensors
from tests.support.oracles import textbook_vocab_parallel_cross_entropy

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not fusions.is_available("swiglu", "compile", DEVICE),
                                 reason=str(fusions.unavailable_reason("swiglu", "compile", DEVICE)))]
DTYPES = [torch.float32] + ([torch.bfloat16] if os.environ.get("FUSIONS_COMPILE_BF16") == "1" else [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_mask_softmax(dtype):
    scores = leaf((2, 3, 5, 7), dtype, DEVICE, scale=3.0)
    mask = (torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(2)) < 0.3).to(DEVICE)
    assert_matches(fusions.scale_mask_softmax_compile, fusions.scale_mask_softmax_reference,
                   [scores, mask, 0.37, True])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_norms(norm, dtype):
    x = leaf((3, 2, 72), dtype, DEVICE, scale=2.0)
    weight = (1 + 0.1 * leaf((72,), torch.float32, DEVICE, seed=3)).detach().requires_grad_()
    bias = leaf((72,), torch.float32, DEVICE, seed=4)
    assert_matches(getattr(fusions, f"{norm}_compile"), getattr(fusions, f"{norm}_reference"),
                   [x, weight, bias, 1e-5], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_pos_emb(dtype):
    cos, sin = RotaryEmbedding(72)(3, DEVICE)
    q, k = leaf((3, 2, 4, 72), dtype, DEVICE), leaf((3, 2, 1, 72), dtype, DEVICE, seed=5)
    assert_matches(fusions.rotary_pos_emb_compile, fusions.rotary_pos_emb_reference, [q, k, cos, sin])


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu(dtype):
    x, bias = leaf((3, 5, 200), dtype, DEVICE, scale=2.0), leaf((200,), dtype, DEVICE, seed=6)
    assert_matches(fusions.bias_gelu_compile, fusions.bias_gelu_reference, [x, bias, "none"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_add(dtype):
    x, bias = leaf((3, 5, 72), dtype, DEVICE), leaf((72,), dtype, DEVICE, seed=7)
    residual = leaf((3, 5, 72), dtype, DEVICE, seed=8)

    def seeded(fn):
        def run(x, bias, residual):
            torch.manual_seed(11)
            return fn(x, bias, residual, 0.3, True)
        return run

    assert_matches(seeded(fusions.bias_dropout_add_compile), seeded(fusions.bias_dropout_add_reference),
                   [x, bias, residual])
    saved = saved_tensors(fusions.bias_dropout_add_compile, x, bias, residual, 0.3, True)
    assert [(t.dtype, t.dim()) for t in saved] == [(torch.int64, 0)]  # the seed: backward hashes the mask again


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    assert_matches(fusions.swiglu_compile, fusions.swiglu_reference, [leaf((3, 5, 2 * 72), dtype, DEVICE, 2.0)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy(dtype):
    logits = leaf((5, 3, 1000), dtype, DEVICE, scale=4.0)
    target = torch.randint(0, 1000, (5, 3), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    assert_matches(lambda x: fusions.cross_entropy_compile(x, target, chunk_rows=4),
                   lambda x: textbook_vocab_parallel_cross_entropy(x, target), [logits], dtype=dtype)


def test_flash_attention_with_dropout():
    """Blocks of 64 queries and a shorter last one, two heads sharing a key and value head (GQA); the
    compiled blocks draw the reference's mask."""
    query = leaf((1, 2, 140, 8), torch.float32, DEVICE)
    key, value = (leaf((1, 1, 140, 8), torch.float32, DEVICE, seed=seed) for seed in (1, 2))
    assert_matches(fusions.flash_attention_compile, fusions.flash_attention_reference,
                   [query, key, value, 0.5, torch.tensor(2024, device=DEVICE)])
