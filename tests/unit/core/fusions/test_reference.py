"""The references (what the model runs unfused) against plain PyTorch, and properties every backend must
keep: only inputs or outputs saved for backward, in their own dtype; one dropout mask definition,
reproducible from the RNG state and stored in 1 byte; cross entropy equal to the tensor-parallel one
(chunked, at TP 1 and TP 2) without saving fp32 logits."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds.core import fusions, parallel_state
from megatron_ds.core.fusions import fused_cross_entropy
from megatron_ds.core.fusions._triton import interpreter_problem
from megatron_ds.core.fusions.counter_hash import draw_seed, drop_threshold
from megatron_ds.core.fusions.dropout import HASH_CHUNK_ELEMENTS, dropout, element_mixes, tensor_keep_mask
from megatron_ds.core.tensor_parallel.random import RNGStatesTracker
from megatron_ds.core.transformer.attention import local_attention
from megatron_ds.core.transformer.rotary import RotaryEmbedding, apply_rotary_pos_emb
from tests.support.distributed import run_distributed
from tests.support.fused_op_checks import TOLERANCES, assert_matches, forward_backward, leaf, saved_tensors
from tests.support.oracles import fmix32, textbook_vocab_parallel_cross_entropy


def _padding_mask(b, s):
    """Padding keys at the end of the second sample; every query keeps key 0."""
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    mask[1, ..., 4:] = True
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding", [False, True])
def test_softmax_reference_matches_torch(padding, dtype):
    scores = leaf((2, 3, 6, 6), dtype, "cpu", scale=3.0)
    mask = _padding_mask(2, 6) if padding else None

    def torch_softmax(scores, mask, scale, causal):
        masked = torch.ones(6, 6, dtype=torch.bool).triu(diagonal=1) if causal else mask
        return torch.softmax((scores.double() * scale).masked_fill(masked, float("-inf")), -1).to(dtype)

    assert_matches(fusions.scale_mask_softmax_reference, torch_softmax, [scores, mask, 0.37, mask is None])


@pytest.mark.parametrize("padding", [False, True])
def test_local_attention_matches_sdpa(padding):
    b, heads, s, d = 2, 3, 6, 8
    q, k, v = (leaf((b, heads, s, d), torch.float32, "cpu", seed=i) for i in range(3))
    mask = _padding_mask(b, s) if padding else None

    def sdpa(q, k, v):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~mask)

    assert_matches(lambda q, k, v: local_attention(q, k, v, mask, 0.0, False), sdpa, [q, k, v])


def test_softmax_fully_masked_rows_give_zeros_not_nan():
    scores = leaf((1, 1, 2, 3), torch.float32, "cpu")
    mask = torch.tensor([[True, True, True], [False, True, False]])[None, None]
    outputs, grads = forward_backward(lambda x: fusions.scale_mask_softmax_reference(x, mask, 1.0), [scores])
    assert torch.equal(outputs[0][0, 0, 0], torch.zeros(3)) and not grads[0].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_references_match_torch(dtype):
    x = leaf((3, 2, 72), dtype, "cpu", scale=3.0)
    weight = (1 + 0.1 * leaf((72,), dtype, "cpu", seed=3)).detach().requires_grad_()
    bias = leaf((72,), dtype, "cpu", seed=4)

    def torch_layer_norm(x, weight, bias, eps):
        return F.layer_norm(x.double(), x.shape[-1:], weight.double(), bias.double(), eps).to(x.dtype)

    def torch_rms_norm(x, weight, bias, eps):
        x64 = x.double()
        return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight + bias).to(x.dtype)

    assert_matches(fusions.layer_norm_reference, torch_layer_norm, [x, weight, bias, 1e-5], dtype=dtype)
    assert_matches(fusions.rms_norm_reference, torch_rms_norm, [x, weight, bias, 1e-5], dtype=dtype)
    assert_matches(lambda x, w: fusions.rms_norm_reference(x, w, None, 1e-5),
                   lambda x, w: torch_rms_norm(x, w, torch.zeros(()), 1e-5), [x, weight], dtype=dtype)


# bytes autograd keeps per element of the op's input, by the paper's accounting: a norm keeps its 16-bit
# input (plus per-row statistics), GeLU its 16-bit input, SwiGLU its gate, silu(gate) and up (f each, 2f input)
SAVED_BYTES_PER_INPUT_ELEMENT = {"layer_norm": 2, "rms_norm": 2, "bias_gelu": 2, "swiglu": 3}


@pytest.mark.parametrize("op", list(SAVED_BYTES_PER_INPUT_ELEMENT))
def test_references_save_no_fp32_copies(op):
    x = leaf((4, 2, 144), torch.bfloat16, "cpu")
    weight, bias = leaf((144,), torch.bfloat16, "cpu", seed=1), leaf((144,), torch.bfloat16, "cpu", seed=2)
    inputs = {"layer_norm": (x, weight, bias, 1e-5), "rms_norm": (x, weight, None, 1e-5),
              "bias_gelu": (x, bias), "swiglu": (x,)}[op]
    saved = saved_tensors(getattr(fusions, f"{op}_reference"), *inputs)
    per_row = 8 * x.numel() // x.size(-1) + 4 * 2 * x.size(-1)   # fp32 statistics per row; the norm's weights
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    assert 0 < saved_bytes <= SAVED_BYTES_PER_INPUT_ELEMENT[op] * x.numel() + per_row


def test_softmax_reference_saves_its_probabilities_alone():
    scores = leaf((2, 3, 6, 6), torch.bfloat16, "cpu")
    saved = saved_tensors(fusions.scale_mask_softmax_reference, scores, _padding_mask(2, 6), 0.5, True)
    assert [(t.dtype, t.shape) for t in saved] == [(torch.bfloat16, scores.shape)]


def test_rope_gelu_swiglu_references_match_torch():
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

    def torch_swiglu(x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    assert_matches(fusions.swiglu_reference, torch_swiglu, [leaf((3, 2, 144), torch.float32, "cpu")])


def _bda_backends():
    names = ["reference"] + ([] if interpreter_problem() else ["triton"])
    return [getattr(fusions, f"bias_dropout_add_{name}") for name in names]


@pytest.mark.parametrize("bias_dropout_add", _bda_backends(), ids=lambda fn: fn.__name__)
def test_dropout_mask_is_reproducible_and_saved_as_one_byte_or_its_seed(bias_dropout_add):
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
    if bias_dropout_add is fusions.bias_dropout_add_reference:
        assert [(t.dtype, t.numel()) for t in saved] == [(torch.bool, x.numel())]
    else:  # the kernels hash the mask again in backward
        assert [(t.dtype, t.dim()) for t in saved] == [(torch.int64, 0)]

    rng = torch.get_rng_state()
    evaluated = bias_dropout_add(x, bias, residual, 0.25, False)
    assert torch.equal(torch.get_rng_state(), rng)  # no dropout, no random numbers drawn
    torch.testing.assert_close(evaluated, residual + x + bias, **TOLERANCES[torch.bfloat16])


def test_dropout_and_bias_dropout_add_share_one_mask_the_counter_hash_of_one_drawn_seed():
    x = torch.rand(64, 2, 72) + 1.0  # no zeros: a zero output is a dropped position
    torch.manual_seed(5)
    dropped = dropout(x, 0.25, True) == 0
    torch.manual_seed(5)
    assert torch.equal(dropped, fusions.bias_dropout_add_reference(x, None, torch.zeros_like(x), 0.25, True) == 0)
    torch.manual_seed(5)
    assert torch.equal(dropped, ~fusions.dropout_keep_mask(x, 0.25))
    torch.manual_seed(5)
    seed = draw_seed("cpu")
    rows = [[fmix32((fmix32(row ^ seed.item()) + column * 0x9E3779B9) & 0xFFFFFFFF) < drop_threshold(0.25)
             for column in range(72)] for row in (0, 1, 127)]  # element (s, b, :) is row s * 2 + b
    assert dropped.view(128, 72)[[0, 1, 127]].tolist() == rows
    assert abs(dropped.float().mean().item() - 0.25) < 0.02


def test_the_plain_pytorch_mask_is_hashed_in_chunks_with_the_one_piece_mask_s_bits():
    x = torch.empty(2100, 512)  # past HASH_CHUNK_ELEMENTS: two chunks of 2048 and 52 rows
    assert x.numel() > HASH_CHUNK_ELEMENTS
    torch.manual_seed(3)
    chunked = fusions.dropout_keep_mask(x, 0.25)
    torch.manual_seed(3)
    assert torch.equal(chunked, tensor_keep_mask(x, element_mixes(x, draw_seed("cpu")), drop_threshold(0.25)))
    saved = saved_tensors(dropout, x.requires_grad_(), 0.25, True)
    assert [t.dtype for t in saved] == [torch.bool]
    assert dropout(x, 0.25, False) is x and dropout(x, 0.0, True) is x


def test_a_gpu_hashes_a_mask_in_few_large_chunks_to_the_same_bits(monkeypatch):
    """On CUDA the plain-PyTorch hash runs in chunks of 64M elements (few launches); the chunk size changes
    nothing in the mask (here: the CPU's chunk set to the GPU's, against the 1M default)."""
    from megatron_ds.core.fusions import dropout as dropout_module
    assert dropout_module.hash_chunk_elements("cuda") == 1 << 26 > dropout_module.hash_chunk_elements("cpu")
    x = torch.empty(2100, 512)
    torch.manual_seed(3)
    small_chunks = fusions.dropout_keep_mask(x, 0.25)
    monkeypatch.setattr(dropout_module, "HASH_CHUNK_ELEMENTS", dropout_module.CUDA_HASH_CHUNK_ELEMENTS)
    torch.manual_seed(3)
    assert torch.equal(fusions.dropout_keep_mask(x, 0.25), small_chunks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 4, None])
def test_cross_entropy_reference_equals_the_textbook_form(dtype, chunk_rows):
    logits = leaf((5, 3, 1000), dtype, "cpu", scale=4.0)
    target = torch.randint(0, 1000, (5, 3), generator=torch.Generator().manual_seed(9))
    assert_matches(lambda x: fusions.cross_entropy_reference(x, target, chunk_rows),
                   lambda x: textbook_vocab_parallel_cross_entropy(x, target), [logits], dtype=dtype,
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
    textbook = saved_tensors(textbook_vocab_parallel_cross_entropy, logits, target)
    assert any(t.dtype == torch.float32 and t.numel() == logits.numel() for t in textbook)


def _tp2_cross_entropy(backend_names):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = parallel_state.get_tensor_model_parallel_rank()
    full = torch.randn(6, 2, 2 * 333, generator=torch.Generator().manual_seed(3)) * 4
    target = torch.randint(0, 2 * 333, (6, 2), generator=torch.Generator().manual_seed(4))
    target[0, 0], target[0, 1] = 0, 2 * 333 - 1  # both ends of the vocabulary
    shard = full.chunk(2, dim=-1)[rank].contiguous().requires_grad_()
    for name in backend_names:
        fn = getattr(fusions, f"cross_entropy_{name}")
        assert_matches(lambda x: fn(x, target, 5), lambda x: textbook_vocab_parallel_cross_entropy(x, target), [shard],
                       tolerances=dict(atol=1e-6, rtol=1e-6))
    full_loss = F.cross_entropy(full.view(-1, 2 * 333), target.view(-1), reduction="none").view(6, 2)
    torch.testing.assert_close(fusions.cross_entropy_reference(shard, target), full_loss)
    dist.barrier()


def test_cross_entropy_at_tp2_equals_the_textbook_form():
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
