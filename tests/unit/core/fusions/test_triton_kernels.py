"""Every triton kernel (forward and backward) against its reference: fp32 and bf16, odd sizes, hidden sizes
that are not powers of two, sequence length 1. On CPU through Triton's interpreter (conftest)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ds.core import fusions
from megatron_ds.core.fusions._triton import TRITON_IMPORT_ERROR, interpreter_problem
from megatron_ds.core.fusions.counter_hash import drop_threshold, keep_mask
from megatron_ds.core.fusions.flash_attention import flash_attention_reference, flash_attention_triton
from megatron_ds.core.transformer.rotary import RotaryEmbedding, apply_rotary
from tests.support.fused_op_checks import assert_matches, leaf
from tests.support.launch import assert_succeeded
from tests.support.oracles import textbook_vocab_parallel_cross_entropy

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, mask_shape, causal", [
    ((2, 3, 5, 5), None, True),              # causal only
    ((2, 2, 3, 7), (2, 1, 3, 7), False),     # padding mask per batch, sq != sk
    ((1, 2, 1, 1), (1, 1, 1, 1), True),      # sequence 1
    ((1, 1, 3, 200), (1, 1, 3, 200), True),  # non-power-of-two keys, causal and a mask together
])
def test_scale_mask_softmax(triton_device, dtype, shape, mask_shape, causal):
    scores = leaf(shape, dtype, triton_device, scale=3.0)
    mask = None
    if mask_shape:
        mask = (torch.rand(mask_shape, generator=torch.Generator().manual_seed(2)) < 0.3).to(triton_device)
    assert_matches(fusions.scale_mask_softmax_triton, fusions.scale_mask_softmax_reference,
                   [scores, mask, 0.37, causal])


def test_scale_mask_softmax_fully_masked_rows_are_zero(triton_device):
    scores = leaf((1, 2, 3, 4), torch.float32, triton_device)
    mask = torch.zeros(1, 1, 3, 4, dtype=torch.bool, device=triton_device)
    mask[..., 1, :] = True
    probs = fusions.scale_mask_softmax_triton(scores, mask, 1.0, False)
    assert torch.equal(probs[:, :, 1], torch.zeros_like(probs[:, :, 1]))
    assert_matches(fusions.scale_mask_softmax_triton, fusions.scale_mask_softmax_reference, [scores, mask, 1.0, False])


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("shape, with_bias", [((3, 2, 72), True), ((1, 1, 200), False), ((5, 7), True)])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_norms(triton_device, norm, dtype, weight_dtype, shape, with_bias):
    x = leaf(shape, dtype, triton_device, scale=2.0)
    weight = (1 + 0.1 * leaf(shape[-1:], weight_dtype, triton_device, seed=3)).detach().requires_grad_()
    bias = leaf(shape[-1:], weight_dtype, triton_device, seed=4) if with_bias else None
    fused, reference = getattr(fusions, f"{norm}_triton"), getattr(fusions, f"{norm}_reference")
    assert_matches(fused, reference, [x, weight, bias, 1e-5], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s, b, q_heads, k_heads, d", [(5, 2, 3, 1, 8), (1, 1, 2, 2, 72), (3, 2, 4, 4, 200)])
def test_rotary_pos_emb(triton_device, dtype, s, b, q_heads, k_heads, d):
    cos, sin = RotaryEmbedding(d)(s, triton_device)
    q = leaf((s, b, q_heads, d), dtype, triton_device)
    k = leaf((s, b, k_heads, d), dtype, triton_device, seed=5)
    assert_matches(fusions.rotary_pos_emb_triton, fusions.rotary_pos_emb_reference, [q, k, cos, sin])


def test_rotary_pos_emb_strided_input(triton_device):
    """q and k as views of a fused QKV projection (strided heads) rotate like contiguous copies."""
    s, b, heads, d = 3, 2, 2, 12
    qkv = leaf((s, b, heads, 3 * d), torch.float32, triton_device)
    cos, sin = RotaryEmbedding(d)(s, triton_device)

    def split(fn):
        return lambda fused: fn(fused[..., :d], fused[..., d:2 * d], cos, sin)

    assert_matches(split(fusions.rotary_pos_emb_triton), split(fusions.rotary_pos_emb_reference), [qkv])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_pos_emb_partial(triton_device, dtype):
    """Partial rotary (--rotary-percent 0.25): the kernel rotates the leading 6 of 24 channels of each head (strided
    slices of q and k) like the reference; the other channels pass through."""
    s, b, d, rotary_dim = 3, 2, 24, 6
    cos, sin = RotaryEmbedding(rotary_dim)(s, triton_device)
    q, k = leaf((s, b, 3, d), dtype, triton_device), leaf((s, b, 1, d), dtype, triton_device, seed=5)
    assert_matches(lambda q, k: apply_rotary(q, k, cos, sin, fusions.rotary_pos_emb_triton),
                   lambda q, k: apply_rotary(q, k, cos, sin, fusions.rotary_pos_emb_reference), [q, k])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape, with_bias", [((3, 5, 72), True), ((1, 1, 200), True), ((7, 33), False)])
def test_bias_gelu(triton_device, dtype, approximate, shape, with_bias):
    x = leaf(shape, dtype, triton_device, scale=2.0)
    bias = leaf(shape[-1:], dtype, triton_device, seed=6) if with_bias else None
    assert_matches(fusions.bias_gelu_triton, fusions.bias_gelu_reference, [x, bias, approximate])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, with_bias, p, training", [
    ((3, 5, 72), True, 0.3, True), ((1, 1, 200), False, 0.5, True), ((40, 33), True, 0.1, False),
    ((4, 3, 72), True, 0.0, True)])
def test_bias_dropout_add(triton_device, dtype, shape, with_bias, p, training):
    x = leaf(shape, dtype, triton_device)
    bias = leaf(shape[-1:], dtype, triton_device, seed=7) if with_bias else None
    residual = leaf(shape, dtype, triton_device, seed=8)

    def seeded(fn):  # the same generator state for both: the same mask
        def run(x, bias, residual):
            torch.manual_seed(11)
            return fn(x, bias, residual, p, training)
        return run

    assert_matches(seeded(fusions.bias_dropout_add_triton), seeded(fusions.bias_dropout_add_reference),
                   [x, bias, residual])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2, 2 * 72), (1, 1, 2 * 100), (5, 2 * 33)])
def test_swiglu(triton_device, dtype, shape):
    assert_matches(fusions.swiglu_triton, fusions.swiglu_reference, [leaf(shape, dtype, triton_device, 2.0)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, vocab", [((3, 2), 1000), ((1, 1), 50), ((5, 3), 4099)])
def test_cross_entropy(triton_device, dtype, shape, vocab):
    logits = leaf(shape + (vocab,), dtype, triton_device, scale=4.0)
    target = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(9)).to(triton_device)
    assert_matches(lambda x: fusions.cross_entropy_triton(x, target),
                   lambda x: textbook_vocab_parallel_cross_entropy(x, target), [logits], dtype=dtype)


ATTENTION_SEED = 0xDEADBEEF  # above 2**31: the top bit goes through the kernels' uint32 hash


def _attention(fn, p, seed):
    return lambda q, k, v: fn(q, k, v, p, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("b, heads, groups, sq, sk, d", [
    (2, 3, 3, 37, 37, 24),  # several blocks, none full; d not a power of two
    (1, 2, 2, 5, 19, 16),   # fewer queries than keys: causal from the bottom right
    (2, 1, 1, 1, 1, 8),     # sequence length 1
    (1, 4, 2, 20, 20, 16),  # grouped keys and values (GQA)
])
def test_flash_attention(triton_device, dtype, p, b, heads, groups, sq, sk, d):
    q = leaf((b, heads, sq, d), dtype, triton_device)
    k = leaf((b, groups, sk, d), dtype, triton_device, seed=10)
    v = leaf((b, groups, sk, d), dtype, triton_device, seed=11)
    seed = torch.tensor(ATTENTION_SEED, device=triton_device)
    assert_matches(_attention(flash_attention_triton, p, seed), _attention(flash_attention_reference, p, seed),
                   [q, k, v])


@pytest.mark.parametrize("dtype, p", [(torch.float32, 0.0), (torch.float32, 0.1), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("d, e", [(24, 8), (16, 40)])
def test_flash_attention_with_a_value_head_dim_other_than_the_query_s_and_a_given_scale(triton_device, dtype, p, d,
                                                                                        e):
    """Multi-latent attention's shapes: values of e channels, queries and keys of d, the scores scaled by a
    factor other than 1 / sqrt(d); forward and every gradient the reference's. (bf16 with dropout: the kernels'
    delta from the bf16 output and the reference's exact row sum differ by more than bf16's tolerance at so few
    value channels; so they do at d = e = 8, so it is not the two dims' difference.)"""
    b, heads, s = 2, 2, 37
    q, k = leaf((b, heads, s, d), dtype, triton_device), leaf((b, heads, s, d), dtype, triton_device, seed=10)
    v = leaf((b, heads, s, e), dtype, triton_device, seed=11)
    seed = torch.tensor(ATTENTION_SEED, device=triton_device)
    assert_matches(lambda *qkv: flash_attention_triton(*qkv, p, seed, scale=0.3),
                   lambda *qkv: flash_attention_reference(*qkv, p, seed, scale=0.3), [q, k, v])


def test_flash_attention_with_a_gpu_s_tiles_at_head_dim_128(triton_device, monkeypatch):
    """A GPU's tiles (64 x 64; the dK/dV kernel 32 x 32 past head dim 64, where 64 x 64 spilled on sm_90), through
    the interpreter: forward and every gradient still the reference's, dropout included, over several blocks."""
    from megatron_ds.core.fusions import flash_attention
    gpu_meta = flash_attention._meta
    monkeypatch.setattr(flash_attention, "_meta", lambda threshold, device, d, e=None: {
        **gpu_meta(threshold, device, d, e), "BLOCK_M": 64, "BLOCK_N": 64})
    assert flash_attention._backward_kv_meta(flash_attention._meta(1, triton_device, 128))["BLOCK_N"] == 32
    b, heads, s, d = 1, 2, 70, 128
    seed = torch.tensor(ATTENTION_SEED, device=triton_device)
    inputs = [leaf((b, heads, s, d), torch.float32, triton_device, seed=i) for i in (3, 10, 11)]
    assert_matches(_attention(flash_attention_triton, 0.1, seed), _attention(flash_attention_reference, 0.1, seed),
                   inputs)


def test_flash_attention_drops_the_hashed_positions(triton_device):
    """Zero queries (uniform probabilities) and one-hot values make the output the dropped probabilities
    themselves: they are nonzero exactly where keep_mask keeps a visible key. At p = 0.5 the gradients of random
    inputs match the reference's too, which a different mask in backward could not give."""
    b, heads, sq, sk = 2, 2, 20, 40
    seed = torch.tensor(ATTENTION_SEED, device=triton_device)
    q = torch.zeros(b, heads, sq, sk, device=triton_device)
    one_hot = torch.eye(sk, device=triton_device).expand(b, heads, sk, sk)
    out = flash_attention_triton(q, leaf((b, heads, sk, sk), torch.float32, triton_device), one_hot, 0.5, seed)
    rows, keys = torch.arange(b * heads * sq, device=triton_device), torch.arange(sk, device=triton_device)
    keep = keep_mask(seed, rows, keys, drop_threshold(0.5)).view(b, heads, sq, sk)
    visible = keys[None, :] <= torch.arange(sq, device=triton_device)[:, None] + sk - sq
    assert torch.equal(out != 0, keep & visible)
    inputs = [leaf((b, heads, sq, 16), torch.float32, triton_device)] + \
        [leaf((b, heads, sk, 16), torch.float32, triton_device, seed=i) for i in (10, 11)]
    assert_matches(_attention(flash_attention_triton, 0.5, seed), _attention(flash_attention_reference, 0.5, seed),
                   inputs)


def test_interpreter_in_fresh_process():
    """When triton was imported before TRITON_INTERPRET=1 could be set (another test imported it first),
    the CPU interpreter tests above skip; run them in a new process, where conftest sets it in time."""
    if torch.cuda.is_available() or not interpreter_problem() or TRITON_IMPORT_ERROR:
        pytest.skip("the kernel tests ran in this process (or triton is not installed)")
    root = Path(__file__).resolve().parents[4]
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                             "-k", "not test_interpreter_in_fresh_process"],
                            cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert_succeeded(result, tail=5000)
