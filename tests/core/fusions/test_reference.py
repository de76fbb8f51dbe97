"""The references against the model's current code, and properties every backend must keep: dropout masks
reproducible from the RNG state and stored in 1 byte, cross entropy equal to the existing one (chunked, at
TP 1 and TP 2) without saving fp32 logits."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds.core import fusions, parallel_state
from megatron_ds.core.fusions import fused_cross_entropy
from megatron_ds.core.fusions._triton import interpreter_problem
from megatron_ds.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_ds.core.tensor_parallel.random import RNGStatesTracker
from megatron_ds.core.transformer.attention import local_attention
from megatron_ds.core.transformer.norms import LayerNorm, RMSNorm
from megatron_ds.core.transformer.rotary import RotaryEmbedding, apply_rotary_pos_emb
from megatron_ds.core.transformer.transformer_layer import bias_dropout_add as model_bias_dropout_add
from tests.core.fusions.common import TOLERANCES, assert_matches, forward_backward, leaf
from tests.distributed import run_distributed


def saved_tensors(fn, *args):
    """The tensors autograd saves for backward while running fn(*args)."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args)
    return saved


@pytest.mark.parametrize("padding", [False, True])
def test_softmax_reference_matches_local_attention(padding):
    b, heads, s, d = 2, 3, 6, 8
    q, k, v = (leaf((b, heads, s, d), torch.float32, "cpu", seed=i) for i in range(3))
    mask = None
    if padding:  # padding keys at the end of the second sample; every query keeps key 0
        mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
        mask[1, ..., 4:] = True

    def fused(q, k, v):
        scores = torch.matmul(q, k.transpose(-1, -2))
        return torch.matmul(fusions.scale_mask_softmax_reference(scores, mask, 1 / math.sqrt(d), mask is None), v)

    assert_matches(fused, lambda q, k, v: local_attention(q, k, v, mask, 0.0, False), [q, k, v])


def test_softmax_fully_masked_rows_give_zeros_not_nan():
    scores = leaf((1, 1, 2, 3), torch.float32, "cpu")
    mask = torch.tensor([[True, True, True], [False, True, False]])[None, None]
    outputs, grads = forward_backward(lambda x: fusions.scale_mask_softmax_reference(x, mask, 1.0), [scores])
    assert torch.equal(outputs[0][0, 0, 0], torch.zeros(3)) and not grads[0].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_references_match_the_model(dtype):
    x = leaf((3, 2, 72), dtype, "cpu", scale=3.0)
    layer_norm = LayerNorm(72)
    with torch.no_grad():
        layer_norm.weight.uniform_(0.5, 1.5)
        layer_norm.bias.uniform_(-1, 1)
    assert_matches(lambda x: fusions.layer_norm_reference(x, layer_norm.weight, layer_norm.bias, 1e-5),
                   layer_norm, [x])
    rms_norm = RMSNorm(72, dtype=dtype)
    with torch.no_grad():
        rms_norm.weight.uniform_(0.5, 1.5)
    # the model rounds to the input dtype before the weight product: within one more bf16 rounding
    assert_matches(lambda x: fusions.rms_norm_reference(x, rms_norm.weight, None, 1e-5), rms_norm, [x],
                   tolerances=dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else None)


def test_rope_gelu_swiglu_references_match_the_model():
    s, b, heads, d = 4, 2, 3, 72
    cos, sin = RotaryEmbedding(d)(s, "cpu")
    q, k = leaf((s, b, heads, d), torch.bfloat16, "cpu"), leaf((s, b, 1, d), torch.bfloat16, "cpu", seed=1)
    rotated = fusions.rotary_pos_emb_reference(q, k, cos, sin)
    assert torch.equal(rotated[0], apply_rotary_pos_emb(q, cos, sin))
    assert torch.equal(rotated[1], apply_rotary_pos_emb(k, cos, sin))

    x, bias = leaf((5, 200), torch.float32, "cpu", 2.0), leaf((200,), torch.float32, "cpu", seed=2)
    assert_matches(fusions.bias_gelu_reference, lambda x, bias, approximate: F.gelu(x + bias), [x, bias, "none"])
    assert_matches(fusions.bias_gelu_reference, lambda x, bias, approximate: F.gelu(x + bias, approximate="tanh"),
                   [x, bias, "tanh"])
    with pytest.raises(ValueError, match="approximate"):
        fusions.bias_gelu_reference(x, bias, "erf")

    def model_swiglu(x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    assert_matches(fusions.swiglu_reference, model_swiglu, [leaf((3, 2, 144), torch.float32, "cpu")])


def _bda_backends():
    names = ["reference"] + ([] if interpreter_problem() else ["triton"])
    return [getattr(fusions, f"bias_dropout_add_{name}") for name in names]


@pytest.mark.parametrize("bias_dropout_add", _bda_backends(), ids=lambda fn: fn.__name__)
def test_dropout_mask_is_reproducible_and_one_byte(bias_dropout_add):
    x, bias, residual = leaf((64, 2, 72), torch.bfloat16, "cpu"), leaf((72,), torch.bfloat16, "cpu", seed=1), \
        leaf((64, 2, 72), torch.bfloat16, "cpu", seed=2)
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    states = tracker.get_states()
    with tracker.fork():
        first = bias_dropout_add(x, bias, residual, 0.25, True)
        second = bias_dropout_add(x, bias, residual, 0.25, True)
    tracker.set_states(states)  # what activation recompute does
    with tracker.fork():
        again = bias_dropout_add(x, bias, residual, 0.25, True)
    assert torch.equal(first, again) and not torch.equal(first, second)
    dropped = (first == residual).float().mean().item()  # dropped positions leave the residual alone
    assert abs(dropped - 0.25) < 0.03

    saved = saved_tensors(bias_dropout_add, x, bias, residual, 0.25, True)
    assert saved and all(t.dtype == torch.bool for t in saved), [t.dtype for t in saved]
    assert sum(t.numel() for t in saved) == x.numel()

    rng = torch.get_rng_state()
    evaluated = bias_dropout_add(x, bias, residual, 0.25, False)
    assert torch.equal(torch.get_rng_state(), rng)  # no dropout, no random numbers drawn
    torch.testing.assert_close(evaluated, model_bias_dropout_add(x, bias, residual, 0.25, False),
                               **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 4, None])
def test_cross_entropy_reference_equals_the_existing_one(dtype, chunk_rows):
    logits = leaf((5, 3, 1000), dtype, "cpu", scale=4.0)
    target = torch.randint(0, 1000, (5, 3), generator=torch.Generator().manual_seed(9))
    assert_matches(lambda x: fusions.cross_entropy_reference(x, target, chunk_rows),
                   lambda x: vocab_parallel_cross_entropy(x, target), [logits], dtype=dtype,
                   tolerances=dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else None)


def _ce_backends():
    names = ["reference"] + ([] if interpreter_problem() else ["triton"])
    return {name: getattr(fusions, f"cross_entropy_{name}") for name in names}


@pytest.mark.parametrize("name", list(_ce_backends()))
def test_cross_entropy_saves_no_fp32_logits(name):
    logits = leaf((8, 2, 1000), torch.bfloat16, "cpu")
    target = torch.randint(0, 1000, (8, 2))
    saved = saved_tensors(_ce_backends()[name], logits, target, 3)
    assert all(t.numel() < logits.numel() or t.dtype == torch.bfloat16 for t in saved)
    assert sum(t.numel() * t.element_size() for t in saved) < 1.1 * logits.numel() * logits.element_size()
    existing = saved_tensors(vocab_parallel_cross_entropy, logits, target)
    assert any(t.dtype == torch.float32 and t.numel() == logits.numel() for t in existing)


def _tp2_cross_entropy(backend_names):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = parallel_state.get_tensor_model_parallel_rank()
    full = torch.randn(6, 2, 2 * 333, generator=torch.Generator().manual_seed(3)) * 4
    target = torch.randint(0, 2 * 333, (6, 2), generator=torch.Generator().manual_seed(4))
    target[0, 0], target[0, 1] = 0, 2 * 333 - 1  # both ends of the vocabulary
    shard = full.chunk(2, dim=-1)[rank].contiguous().requires_grad_()
    for name in backend_names:
        fn = getattr(fusions, f"cross_entropy_{name}")
        assert_matches(lambda x: fn(x, target, 5), lambda x: vocab_parallel_cross_entropy(x, target), [shard],
                       tolerances=dict(atol=1e-6, rtol=1e-6))
    full_loss = F.cross_entropy(full.view(-1, 2 * 333), target.view(-1), reduction="none").view(6, 2)
    torch.testing.assert_close(fusions.cross_entropy_reference(shard, target), full_loss)
    dist.barrier()


def test_cross_entropy_at_tp2_equals_the_existing_one():
    run_distributed(_tp2_cross_entropy, 2, list(_ce_backends()), timeout=120)


def test_cross_entropy_reference_walks_the_tokens_in_chunks(monkeypatch):
    seen = []
    for name in ("_local_stats", "_grad_chunk"):
        original = getattr(fused_cross_entropy, name)

        def recording(chunk, *args, original=original):
            seen.append(chunk.size(0))
            return original(chunk, *args)

        monkeypatch.setattr(fused_cross_entropy, name, recording)
    logits = leaf((7, 2, 300), torch.bfloat16, "cpu")
    target = torch.randint(0, 300, (7, 2))
    fusions.cross_entropy_reference(logits, target, 4).sum().backward()
    assert seen == [4, 4, 4, 2] * 2
    assert fused_cross_entropy.default_chunk_rows(128 * 1024) == 128
