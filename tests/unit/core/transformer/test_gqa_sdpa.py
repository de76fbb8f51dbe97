"""GQA through torch's scaled_dot_product_attention: grouped key and value heads go in as they are
(enable_gqa=True) where the kernel SDPA picks takes them (a CPU's flash kernel; on CUDA flash attention or cuDNN),
else they are repeated to every query head first; the dry run's fake CUDA tensors and the planner's memory model
assume what an sm80+ GPU does (flash attention takes them for fp16 and bf16)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_ds.core.fusions.flash_attention import flash_attention_footprint
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.tensor_parallel.random import initialize_deterministically
from megatron_ds.core.transformer import TransformerConfig, attention
from megatron_ds.core.transformer.attention import (
    SelfAttention,
    gpu_sdpa_takes_grouped_heads,
    sdpa_attention,
    sdpa_takes_grouped_heads,
)
from megatron_ds.planning.dry_run.fake_step import StepRecorder
from megatron_ds.planning.memory import attention_kernel, layer_activation_bytes
from megatron_ds.planning.model import Layout, ModelSpec

B, HEADS, GROUPS, S, D = 2, 8, 2, 16, 8
SDPBackend = torch.backends.cuda.SDPBackend


def _qkv(groups=GROUPS, requires_grad=False):
    """CPU fp32 query [b, heads, s, d], key and value [b, groups, s, d]."""
    generator = torch.Generator().manual_seed(0)
    shapes = ((B, HEADS, S, D), (B, groups, S, D), (B, groups, S, D))
    return [torch.randn(shape, generator=generator).requires_grad_(requires_grad) for shape in shapes]


def _fake_qkv(dtype=torch.bfloat16, head_dim=D, requires_grad=False, device="cpu"):
    """Under FakeTensorMode: query [b, heads, s, d], key and value [b, groups, s, d] (the dry run's are on this
    machine's device, a CPU here, and stand for a GPU's)."""
    return [torch.empty(shape, dtype=dtype, device=device, requires_grad=requires_grad)
            for shape in ((B, HEADS, S, head_dim), (B, GROUPS, S, head_dim), (B, GROUPS, S, head_dim))]


def _expanded(tensor, heads=HEADS):
    return tensor.repeat_interleave(heads // tensor.size(1), dim=1)


# ---------------------------------------------------------------- numerics (CPU, fp32)

@pytest.mark.parametrize("groups", [1, 2, 4])
def test_sdpa_on_grouped_heads_equals_sdpa_on_expanded_heads_forward_and_backward(groups):
    query, key, value = _qkv(groups=groups, requires_grad=True)
    grouped = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    grouped_grads = torch.autograd.grad(grouped, (query, key, value), torch.ones_like(grouped))
    expanded = F.scaled_dot_product_attention(query, _expanded(key), _expanded(value), is_causal=True)
    expanded_grads = torch.autograd.grad(expanded, (query, key, value), torch.ones_like(expanded))
    torch.testing.assert_close(grouped, expanded, rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(grouped_grads, expanded_grads):   # key, value: summed over each group's heads
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_the_repeat_for_a_refusing_kernel_is_repeat_interleave_and_a_view_for_one_group():
    _, key, _ = _qkv()
    assert torch.equal(attention._repeat_heads(key, HEADS), _expanded(key))
    one_group = key[:, :1]
    repeated = attention._repeat_heads(one_group, HEADS)
    assert repeated.stride(1) == 0 and repeated.data_ptr() == one_group.data_ptr()   # no copy


def test_sdpa_attention_repeats_the_heads_where_the_kernel_refuses_groups(monkeypatch):
    """Same result either way; the call SDPA gets: grouped heads with enable_gqa, or repeated heads without."""
    query, key, value = _qkv(requires_grad=True)
    calls = []
    original = F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        calls.append((k.size(1), kwargs.get("enable_gqa", False)))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    taken = sdpa_attention(query, key, value, None, 0.0, True)
    monkeypatch.setattr(attention, "sdpa_takes_grouped_heads", lambda *args: False)
    refused = sdpa_attention(query, key, value, None, 0.0, True)
    assert calls == [(GROUPS, True), (HEADS, False)]
    torch.testing.assert_close(taken, refused, rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(torch.autograd.grad(taken.sum(), (key, value)),
                            torch.autograd.grad(refused.sum(), (key, value))):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the decision on CUDA

@pytest.mark.parametrize("dtype, head_dim, takes", [
    (torch.bfloat16, 128, True), (torch.float16, 64, True), (torch.bfloat16, 256, True),
    (torch.bfloat16, 288, False),    # over flash attention's 256
    (torch.float32, 128, False),     # fp32: the memory-efficient kernel, which takes no groups (torch 2.11-2.13)
])
def test_a_gpu_takes_grouped_heads_in_flash_attention_for_16_bit_types(dtype, head_dim, takes):
    assert gpu_sdpa_takes_grouped_heads(dtype, head_dim) is takes
    for device in ("cpu", "cuda"):
        with FakeTensorMode():   # the dry run's tensors stand for a GPU's, whatever their device
            query, key, value = _fake_qkv(dtype, head_dim, device=device)
            assert sdpa_takes_grouped_heads(query, key, value) is takes


@pytest.mark.parametrize("choice, takes", [(SDPBackend.FLASH_ATTENTION, True), (SDPBackend.CUDNN_ATTENTION, True),
                                           (SDPBackend.EFFICIENT_ATTENTION, True), (SDPBackend.MATH, False),
                                           (SDPBackend.ERROR, False)])
def test_on_a_real_gpu_the_kernel_sdpa_would_pick_for_grouped_heads_decides(monkeypatch, choice, takes):
    """A real CUDA tensor asks SDPA's own dispatch (torch._fused_sdp_choice, with enable_gqa) which kernel it would
    run: a fused one takes the groups (the memory-efficient one only in torch releases after 2.13: before, it
    refuses them and the dispatch answers math, or another fused kernel). Fake CUDA tensors stand in for real ones
    here (this machine has no GPU); the dispatch's answer is the test's."""
    asked = []

    def fused_sdp_choice(*args, **kwargs):
        asked.append((args[3:], kwargs))
        return int(choice)

    monkeypatch.setattr(torch, "_fused_sdp_choice", fused_sdp_choice)
    monkeypatch.setattr(attention, "is_fake", lambda tensor: False)
    with FakeTensorMode():
        query, key, value = _fake_qkv(device="cuda")
        assert sdpa_takes_grouped_heads(query, key, value, 0.25) is takes
    assert asked == [((None, 0.25, True), {"enable_gqa": True})]


def _layer(dtype, groups=GROUPS, **options):
    model_parallel_cuda_manual_seed(5)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS, num_query_groups=groups,
                               hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope", bias=False,
                               params_dtype=dtype, **options)
    layer = SelfAttention(config, 1)
    initialize_deterministically(layer, "attention", 5)
    return layer


@pytest.mark.parametrize("dtype, takes", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)])
def test_the_layer_splits_grouped_heads_for_a_gpu_s_flash_attention(dtype, takes):
    """SelfAttention.takes_grouped_heads on the dry run's fake tensors (a GPU's): grouped for fp16 and bf16,
    expanded for fp32; never with a mask; a real CPU tensor: grouped (a real CUDA one too: sdpa_attention repeats
    them where the kernel refuses them)."""
    layer = _layer(dtype)
    qkv_width = (HEADS + 2 * GROUPS) * D
    for device in ("cpu", "cuda"):
        with FakeTensorMode():
            mixed = torch.empty(S, B, qkv_width, dtype=dtype, device=device)
            mask = torch.empty(B, 1, S, S, dtype=torch.bool, device=device)
            assert layer.takes_grouped_heads(mixed, None) is takes
            assert layer.takes_grouped_heads(mixed, mask) is False
    assert layer.takes_grouped_heads(torch.empty(S, B, qkv_width, dtype=dtype), None) is True
    local = _layer(dtype, attention_backend="local")
    assert local.takes_grouped_heads(torch.empty(S, B, qkv_width, dtype=dtype), None) is False


def test_a_layer_with_grouped_heads_computes_what_it_does_with_expanded_heads():
    """CPU, fp32: the layer's output and gradients are the same whether sdpa takes the groups or repeats them."""
    hidden = torch.randn(S, B, HEADS * D, generator=torch.Generator().manual_seed(1))
    results = []
    for takes in (True, False):
        layer = _layer(torch.float32)
        layer.takes_grouped_heads = lambda mixed, mask, takes=takes: takes
        inputs = hidden.clone().requires_grad_()
        output, _ = layer(inputs)
        output.sum().backward()
        results.append((output.detach(), inputs.grad, layer.linear_qkv.weight.grad))
    for grouped, expanded in zip(*results):
        torch.testing.assert_close(grouped, expanded, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the dry run's footprint and the memory model

def test_the_dry_run_s_sdpa_footprint_keeps_grouped_heads_as_given_and_the_op_repeats_them():
    with FakeTensorMode():
        query, key, value = _fake_qkv(requires_grad=True)
        sdpa = flash_attention_footprint(query, key, value, copies=False)
        op = flash_attention_footprint(query, key, value, copies=True)
    saved = {name: [tuple(t.shape) for t in out.grad_fn.saved_tensors[:3]]
             for name, out in (("sdpa", sdpa), ("op", op))}
    assert saved["sdpa"] == [(B, HEADS, S, D), (B, GROUPS, S, D), (B, GROUPS, S, D)]
    assert saved["op"] == [(B, HEADS, S, D)] * 3


def _llama(dtype, groups=GROUPS):
    config = TransformerConfig(num_layers=2, hidden_size=HEADS * 16, num_attention_heads=HEADS, num_query_groups=groups,
                               normalization="RMSNorm", gated_linear_unit=True, bias=False,
                               position_embedding_type="rope", params_dtype=dtype)
    return ModelSpec(config, 1000, 128, 256, 256, False)


def test_the_memory_model_counts_grouped_heads_on_a_gpu_as_on_a_cpu_for_16_bit_types():
    """bf16 on a GPU: "sdpa_grouped" as on a CPU (the QKV output whole and RoPE's rotated q and k of their own
    heads), so a GPU's count equals the CPU's; fp32 on a GPU: "sdpa", q, k and v copies of every head."""
    bf16, fp32 = _llama(torch.bfloat16), _llama(torch.float32)
    assert attention_kernel(bf16.config, "cuda") == attention_kernel(bf16.config, "cpu") == "sdpa_grouped"
    assert attention_kernel(fp32.config, "cuda") == "sdpa"
    layout = Layout(1, 1, 1, 2, 2)
    assert layer_activation_bytes(bf16, layout, None, device="cuda") == layer_activation_bytes(bf16, layout, None,
                                                                                               device="cpu")
    # per token, a = 8 heads of d = 16, g = 2 groups, w = 4: the expanded copies 3wad against the QKV output
    # w(a + 2g)d beside RoPE's rotated q and k w(a + g)d
    a, g, d, w, tokens = HEADS, GROUPS, 16, 4, 256 * 2
    expanded, grouped = (layer_activation_bytes(fp32, layout, None, device=device) for device in ("cuda", "cpu"))
    assert expanded - grouped == tokens * w * d * (3 * a - (a + 2 * g) - (a + g))
    multi_head = dataclasses.replace(bf16.config, num_query_groups=HEADS)
    assert attention_kernel(multi_head, "cuda") == "sdpa_grouped"   # one group a head: the same bytes either way


def _kept_after_forward(dtype, takes_grouped_heads=None):
    """Bytes an attention layer's forward leaves alive on the dry run's fake tensors (planning/dry_run/fake_step.py's
    recorder): what it keeps for backward, and its output."""
    model_parallel_cuda_manual_seed(5)
    with FakeTensorMode() as mode:
        config = TransformerConfig(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS,
                                   num_query_groups=GROUPS, hidden_dropout=0.0, attention_dropout=0.0,
                                   position_embedding_type="rope", bias=False, params_dtype=dtype)
        layer = SelfAttention(config, 1)
        hidden = torch.empty(S, B, HEADS * D, dtype=dtype, requires_grad=True)
    if takes_grouped_heads is not None:
        layer.takes_grouped_heads = lambda mixed, mask: takes_grouped_heads
    with StepRecorder({}, mode) as recorder:
        output, _ = layer(hidden)
        return recorder.live_bytes


def test_the_dry_run_keeps_what_the_memory_model_counts_for_grouped_heads():
    """bf16: grouped heads keep the QKV output whole beside RoPE's rotated q and k of their own heads,
    w(a + 2g)d + w(a + g)d per token, where expanded ones keep q, k and v copies of every head, 3wad: the dry run's
    difference between the two is the memory model's (a = 8, g = 2: 2wd per token less)."""
    grouped, expanded = _kept_after_forward(torch.bfloat16), _kept_after_forward(torch.bfloat16, False)
    a, g, w, tokens = HEADS, GROUPS, 2, S * B
    assert expanded - grouped == tokens * w * D * (3 * a - (a + 2 * g) - (a + g))
    assert _kept_after_forward(torch.float32) == _kept_after_forward(torch.float32, False)  # fp32: expanded
