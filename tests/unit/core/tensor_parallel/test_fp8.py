"""FP8 GEMMs against fp32 products: error bounds from the formats, scales, saved bytes, experts, and TP exactness
on two real gloo ranks.

The error bound. Round-to-nearest into a format with p bits of precision (E4M3: p = 4, E5M2: p = 3) errs by at
most the unit roundoff u = 2**-p relative (E4M3: 2**-4, E5M2: 2**-3), and with the error spread evenly over
the ulp its mean square is at most u**2 / 3. For independent random operands each output element is a sum of
K products whose errors add incoherently, as the products themselves do, so the relative Frobenius error of
C = A B^T is sqrt(rho_a**2 + rho_b**2) <= sqrt((u_a**2 + u_b**2) / 3): 0.051 for E4M3 x E4M3, 0.081 for
E5M2 x E4M3 (hybrid's gradient GEMMs). Measured on these shapes: about 0.037 and 0.058. The fp32 accumulation
adds ~K * 2**-24, far below. The worst case (every error aligned) would be u_a + u_b; random data does not
reach it, so that looser bound would hide a fault. An error below a quarter of the bound would mean the GEMM
did not run in FP8 at all (bf16 errs ~0.003).
"""
import math

import pytest
import torch
import torch.distributed as dist

from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel.fp8 import (
    DYNAMIC_RECIPES,
    FORMATS,
    Fp8Recipe,
    cuda_capability_problems,
    fp8_dtypes,
    fp8_grouped_linear,
    fp8_linear,
    fp8_support_problems,
    quantize,
    scaled_gemm,
)
from tests.support.distributed import run_distributed

TOKENS, INPUTS, OUTPUTS = 64, 256, 256
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _unit_roundoff(dtype):
    return torch.finfo(dtype).eps / 2


def _error_bound(dtype_a, dtype_b):
    return math.sqrt((_unit_roundoff(dtype_a) ** 2 + _unit_roundoff(dtype_b) ** 2) / 3)


def _relative_error(result, reference):
    return ((result.double() - reference.double()).norm() / reference.double().norm()).item()


def _tensors(seed=0, tokens=TOKENS, inputs=INPUTS, outputs=OUTPUTS):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in [(tokens, inputs), (outputs, inputs),
                                                                  (tokens, outputs)]]


def _fp8_products(x, weight, grad, recipe, fmt, **kwargs):
    """(y, dx, dw) of fp8_linear on copies of x and weight, grad fed back."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    output = fp8_linear(x, weight, recipe, fmt, **kwargs)
    output.backward(grad)
    return output.detach(), x.grad, weight.grad


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("recipe", DYNAMIC_RECIPES)
def test_each_gemm_errs_within_the_format_bound(recipe, fmt):
    x, weight, grad = _tensors()
    forward_dtype, grad_dtype = fp8_dtypes(fmt)
    output, grad_x, grad_weight = _fp8_products(x, weight, grad, recipe, fmt)
    gemms = {"forward": (output, x @ weight.t(), forward_dtype),
             "dgrad": (grad_x, grad @ weight, grad_dtype),
             "wgrad": (grad_weight, grad.t() @ x, grad_dtype)}
    for name, (result, reference, first_dtype) in gemms.items():
        bound = _error_bound(first_dtype, forward_dtype)
        error = _relative_error(result, reference)
        assert bound / 4 < error < bound, f"{name}: relative error {error:.4f}, bound {bound:.4f}"


@pytest.mark.parametrize("kind_a, kind_b", [("tensor", "tensor"), ("row", "row"), ("tile", "block"),
                                            ("tile", "tile")])
def test_the_scaled_gemm_is_the_product_of_its_dequantised_operands(kind_a, kind_b):
    """Isolates the GEMM from the rounding: a wrong scale, tile or block index shows at fp32's precision, whose
    error bound for a K-term dot product (any order, two scalings) is (K + 2) * 2**-24 * |a| . |b|.
    Odd sizes put partial tiles and blocks at the edges."""
    a_tensor, b_tensor, _ = _tensors(tokens=40, inputs=300, outputs=200)
    a = quantize(a_tensor, kind_a, torch.float8_e5m2)
    b = quantize(b_tensor * 1000, kind_b, torch.float8_e4m3fn)
    a_values, b_values = a.dequantize().double(), b.dequantize().double()
    error = (scaled_gemm(a, b, torch.float32).double() - a_values @ b_values.t()).abs()
    assert (error <= (a.shape[1] + 2) * 2 ** -24 * (a_values.abs() @ b_values.abs().t())).all()


def _region_maxima(values, kind):
    """Each scaling region's max |value| (odd sizes: partial tiles at the edges)."""
    if kind == "tensor":
        return values.amax().reshape(1)
    if kind == "row":
        return values.amax(dim=1)
    rows = 1 if kind == "tile" else 128
    return torch.stack([values[i:i + rows, j:j + 128].amax()
                        for i in range(0, values.shape[0], rows) for j in range(0, values.shape[1], 128)])


@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("kind", ["tensor", "row", "tile", "block"])
def test_each_region_amax_lands_on_fp8_max_over_two_to_the_margin(kind, dtype, margin):
    tensor = _tensors(tokens=130, inputs=300)[0] * 37
    operand = quantize(tensor, kind, dtype, margin)
    rows, columns = tensor.shape
    magnitudes = operand.data.float().abs()[:rows, :columns]
    assert torch.isfinite(magnitudes).all() and magnitudes.max() <= torch.finfo(dtype).max
    target = torch.finfo(dtype).max / 2 ** margin
    assert (_region_maxima(magnitudes, kind) == target).all()
    relative = (operand.dequantize() - tensor).abs() / tensor.abs()
    assert relative[tensor.abs() > tensor.abs().max() / 2 ** 4].max() <= _unit_roundoff(dtype) * (1 + 1e-6)


def test_a_zero_tensor_quantises_to_zeros_with_a_finite_scale():
    operand = quantize(torch.zeros(4, 128), "tile", torch.float8_e4m3fn)
    assert (operand.data.float() == 0).all() and torch.isfinite(operand.scale_inv).all()


@pytest.mark.parametrize("recipe", DYNAMIC_RECIPES)
def test_finer_recipes_keep_small_rows_that_tensorwise_flushes(recipe):
    """Rows 2**0 .. 2**-19 in magnitude: one tensorwise scale pushes the small rows into E4M3's subnormals;
    a scale per row or per 1x128 tile keeps every row at full relative precision."""
    x, weight, _ = _tensors()
    x = x * 2.0 ** -(torch.arange(TOKENS) % 20).unsqueeze(1)
    output = fp8_linear(x, weight, recipe, "e4m3")
    reference = x @ weight.t()
    worst_row = max(_relative_error(output[row], reference[row]) for row in range(TOKENS))
    bound = _error_bound(torch.float8_e4m3fn, torch.float8_e4m3fn)
    if recipe == "tensorwise":
        assert worst_row > 4 * bound
    else:
        assert worst_row < 2 * bound


@pytest.mark.parametrize("recipe", DYNAMIC_RECIPES)
def test_backward_keeps_fp8_copies_not_the_inputs(recipe):
    x, weight, _ = _tensors()
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fp8_linear(x.requires_grad_(), weight.requires_grad_(), recipe, "hybrid")
    fp8_bytes = sum(t.numel() for t in saved if t.dtype in FP8_DTYPES)
    other_bytes = sum(t.numel() * t.element_size() for t in saved if t.dtype not in FP8_DTYPES)
    assert fp8_bytes >= x.numel() + weight.numel()
    assert other_bytes < (x.numel() + weight.numel()) / 16  # scales only


def test_bf16_inputs_give_bf16_outputs_and_gradients():
    x, weight, grad = (t.bfloat16() for t in _tensors())
    output, grad_x, grad_weight = _fp8_products(x, weight, grad.bfloat16(), "rowwise", "e4m3")
    assert output.dtype == grad_x.dtype == grad_weight.dtype == torch.bfloat16
    assert _relative_error(output, x.float() @ weight.float().t()) < _error_bound(*fp8_dtypes("e4m3")) + 2 ** -8


def test_amax_group_needs_the_dimension_it_splits():
    with pytest.raises(ValueError, match="split"):
        Fp8Recipe("tensorwise", "e4m3", amax_group=object())
    with pytest.raises(ValueError, match="recipe"):
        Fp8Recipe("delayed", "e4m3")
    with pytest.raises(ValueError, match="format"):
        Fp8Recipe("tensorwise", "e5m2")


def test_support_problems_name_what_the_device_lacks():
    assert fp8_support_problems("cpu") == []
    assert "sm_70" in cuda_capability_problems("Tesla V100-SXM2-32GB", (7, 0))[0]
    assert "sm_86" in cuda_capability_problems("NVIDIA A10", (8, 6))[0]
    assert cuda_capability_problems("NVIDIA H100 80GB HBM3", (9, 0)) == []
    assert "'meta'" in fp8_support_problems("meta")[0]


@pytest.mark.parametrize("recipe", DYNAMIC_RECIPES)
def test_grouped_gemms_match_each_groups_fp32_products(recipe):
    tokens_per_group = [40, 0, 100, 3]
    x, _, grad = _tensors(tokens=sum(tokens_per_group), outputs=128)
    weights = torch.randn(len(tokens_per_group), 128, INPUTS, generator=torch.Generator().manual_seed(1))
    x, weights = x.requires_grad_(), weights.requires_grad_()
    output = fp8_grouped_linear(x, weights, tokens_per_group, recipe, "hybrid")
    output.backward(grad)
    starts = [sum(tokens_per_group[:group]) for group in range(len(tokens_per_group))]
    e4m3, e5m2 = fp8_dtypes("hybrid")
    for group, (start, count) in enumerate(zip(starts, tokens_per_group)):
        rows = slice(start, start + count)
        if not count:
            assert (weights.grad[group] == 0).all()
            continue
        checks = {"forward": (output[rows], x[rows] @ weights[group].t(), e4m3),
                  "dgrad": (x.grad[rows], grad[rows] @ weights[group], e5m2),
                  "wgrad": (weights.grad[group], grad[rows].t() @ x[rows], e5m2)}
        for name, (result, reference, first_dtype) in checks.items():
            bound = _error_bound(first_dtype, e4m3)
            error = _relative_error(result.detach(), reference.detach())
            assert error < bound, f"group {group} {name}: relative error {error:.4f}, bound {bound:.4f}"


def _shards_against_one_rank(recipe, fmt, layout, group):
    """The names of the products where this rank's share of the split GEMM differs from one rank's FP8 GEMM:
    bitwise where the split leaves the contraction whole, within fp32 summation where it splits it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, weight, grad = _tensors(seed=7)
    whole = _fp8_products(x, weight, grad, recipe, fmt)
    if layout == "column":  # weight rows split: outputs
        shards = _fp8_products(x, weight.chunk(world, 0)[rank], grad.chunk(world, 1)[rank], recipe, fmt,
                               amax_group=group, split="outputs" if group else None)
        exact = {"y": (shards[0], whole[0].chunk(world, 1)[rank]), "dW": (shards[2], whole[2].chunk(world, 0)[rank])}
        summed = {"dX": (shards[1], whole[1])}
    else:  # weight columns split: inputs, the forward's contraction
        shards = _fp8_products(x.chunk(world, 1)[rank], weight.chunk(world, 1)[rank], grad, recipe, fmt,
                               amax_group=group, split="inputs" if group else None)
        exact = {"dX": (shards[1], whole[1].chunk(world, 1)[rank]), "dW": (shards[2], whole[2].chunk(world, 1)[rank])}
        summed = {"y": (shards[0], whole[0])}
    differing = [name for name, (shard, reference) in exact.items() if not torch.equal(shard, reference)]
    for name, (partial, reference) in summed.items():
        dist.all_reduce(partial)
        if not torch.allclose(partial, reference, rtol=1e-5, atol=1e-4):
            differing.append(name)
    return differing


def _check_tensor_parallel_fp8():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    group = parallel_state.get_tensor_model_parallel_group()
    for recipe in DYNAMIC_RECIPES:
        for fmt in FORMATS:
            for layout in ("column", "row"):
                case = f"{recipe} {fmt} {layout}-parallel"
                differing = _shards_against_one_rank(recipe, fmt, layout, group)
                assert differing == [], f"{case}: {differing} differ from one rank's"
                local = _shards_against_one_rank(recipe, fmt, layout, None)
                if recipe == "blockwise":  # 128-aligned shards: every tile and block lies on one rank
                    assert local == [], f"{case}: blockwise scales are local"
                else:
                    assert local != [], f"{case}: without the amax reduction the shards should differ"
    dist.barrier()


def test_tensor_parallel_fp8_computes_one_ranks_products():
    run_distributed(_check_tensor_parallel_fp8, 2, timeout=120)


def test_a_torch_without_rowwise_scaling_runs_tensorwise_and_refuses_the_recipes_that_need_it(monkeypatch):
    """torch 2.11 on a CPU runs _scaled_mm with one scale per tensor only (its error is the one raised here): the
    tensorwise recipe is usable there, rowwise and blockwise (rowwise GEMMs per 128 of K) are named as refused."""
    scaled_mm = torch._scaled_mm

    def tensorwise_only(a, b, scale_a, scale_b, **kwargs):
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            raise RuntimeError("Now _scaled_mm only supports per-tensor scaling for CPU backend.")
        return scaled_mm(a, b, scale_a, scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", tensorwise_only)
    assert fp8_support_problems("cpu", "tensorwise") == []
    [rowwise] = fp8_support_problems("cpu", "rowwise")
    [blockwise] = fp8_support_problems("cpu", "blockwise")
    assert "refuses a rowwise FP8 GEMM (Now _scaled_mm only supports per-tensor scaling" in rowwise
    assert "refuses a rowwise FP8 GEMM (the blockwise recipe's)" in blockwise
    assert fp8_support_problems("cpu") == [rowwise]
