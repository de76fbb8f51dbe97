"""FP8 GEMMs with dynamic scales: the forward, input-gradient and weight-gradient GEMMs of a linear layer.

Recipes (how finely a scale is shared) and formats (which FP8 type each operand takes):

    tensorwise  one scale per tensor; the amax is all-reduced over `amax_group` where the tensor is split
    rowwise     one scale per row along the contraction dimension (torchao's rowwise)
    blockwise   DeepSeek-V3's: activations and gradients per 1x128 tile along the contraction dimension,
                weights per 128x128 block; partial products promoted to fp32 every 128 elements of K
    delayed     one scale per tensor from the amaxes of earlier steps (fp8_delayed.py: Transformer Engine's
                recipe, Megatron-LM's default); the GEMMs are tensorwise ones
    e4m3        every operand E4M3;  hybrid: gradients E5M2, activations and weights E4M3

Quantisation follows Megatron's --fp8-margin: scale = fp8_max / amax / 2**margin, so a tensor's amax
lands on fp8_max / 2**margin; the GEMMs take the inverse (the dequantisation scale).

Every GEMM C = A @ B^T is an `_scaled_gemm` of two `Fp8Operand`s, each stored [rows, contraction] row-major
(the layout cuBLAS wants for A, and for B once transposed):

    forward  y  = x  W^T     A = x    [tokens, inputs]    B = W    [outputs, inputs]
    dgrad    dx = dy W       A = dy   [tokens, outputs]   B = W^T  [inputs, outputs]
    wgrad    dW = dy^T x     A = dy^T [outputs, tokens]   B = x^T  [inputs, tokens]

Backward keeps only FP8 copies: x^T and W^T quantised along the dimension their backward GEMM contracts.
Tensorwise and 128x128-block scales are symmetric, so those copies are the forward's FP8 data transposed;
rowwise and 1x128 tiles quantise again from the high-precision tensor in the forward.

Exact under tensor parallelism: `split` names the dimension ("tokens", "inputs" or "outputs") that
`amax_group` splits. An amax is all-reduced (MAX) over the group exactly when its scaling region spans that
dimension (the whole tensor for tensorwise, the contraction for rowwise), so each rank quantises its shard to
the bytes the unsplit GEMM would. Blockwise scales are local: exact when each shard is a multiple of 128 long.

Where each call runs. On this CPU build (torch 2.13) `torch._scaled_mm` takes E4M3 and E5M2 operands with
tensorwise (0-d) and rowwise ([M, 1] x [1, N]) fp32 scales and returns fp32 or bf16: tensorwise and rowwise
GEMMs are one `_scaled_mm` call, the call a GPU runs (cuBLAS; there rowwise wants a bf16 output and sizes
that are multiples of 16). `_scaled_mm` refuses block scales on the CPU, so blockwise runs one rowwise
`_scaled_mm` per 128-wide slice of K (the tile's scale per row of A, the block's per column of B) with fp32
outputs summed in fp32: DeepSeek's promotion, computed from the same FP8 bytes. A GPU would run it as one
`torch.nn.functional.scaled_mm` with ScalingType.BlockWise1x128 / BlockWise128x128 (not wired: untested).
`torch._scaled_grouped_mm` has no CPU kernel, so `fp8_grouped_linear` loops over the groups;
on an sm_90 GPU it would be one `_scaled_grouped_mm` with rowwise scales (not wired: untested).
"""
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

DYNAMIC_RECIPES = ("tensorwise", "rowwise", "blockwise")  # scales from each GEMM's own operands: Fp8Recipe
RECIPES = (*DYNAMIC_RECIPES, "delayed")  # delayed: scales from earlier steps' amaxes, fp8_delayed.DelayedScaling
FORMATS = ("e4m3", "hybrid")
SPLIT_DIMS = ("tokens", "inputs", "outputs")
BLOCK = 128

# (activations and gradients, weights): the scaling kind of each operand under a recipe
_KINDS = {"tensorwise": ("tensor", "tensor"), "rowwise": ("row", "row"), "blockwise": ("tile", "block")}
_TRANSPOSABLE = ("tensor", "block")  # kinds whose scales still fit the operand once it is transposed
MIN_CUDA_CAPABILITY = (8, 9)


def fp8_dtypes(fmt: str) -> tuple[torch.dtype, torch.dtype]:
    """(activations and weights, gradients) FP8 dtypes of a format."""
    if fmt not in FORMATS:
        raise ValueError(f"FP8 format {fmt!r} is not one of {FORMATS}")
    return torch.float8_e4m3fn, torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Fp8Operand:
    """A GEMM operand in FP8: `data` [rows, contraction] (padded to whole tiles for tile and block kinds),
    `scale_inv` the dequantisation scale (0-d, [rows, 1], [rows, K/128] or [rows/128, K/128] by kind),
    `shape` the unpadded [rows, contraction]."""
    data: torch.Tensor
    scale_inv: torch.Tensor
    kind: str
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        rows, columns = self.shape
        return (self.data.float() * _per_element(self.scale_inv, self.kind))[:rows, :columns]

    def transposed(self) -> "Fp8Operand":
        """The operand of the transposed tensor, from the same FP8 bytes (tensor and block kinds only)."""
        if self.kind not in _TRANSPOSABLE:
            raise ValueError(f"a {self.kind}-scaled operand cannot be transposed: its scales run along one axis")
        return Fp8Operand(self.data.t().contiguous(), self.scale_inv.t().contiguous(), self.kind, self.shape[::-1])


def quantize(tensor: torch.Tensor, kind: str, dtype: torch.dtype, margin: int = 0,
             amax_group=None) -> Fp8Operand:
    """`tensor` [rows, contraction] in FP8 with a scale per `kind` region (tensor, row, tile 1x128, block
    128x128); the amaxes all-reduced (MAX) over `amax_group` first when one is given."""
    padded = _padded(tensor.float(), kind)
    amax = _amax(padded, kind)
    if amax_group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=amax_group)
    scale = torch.where(amax > 0, torch.finfo(dtype).max / amax / 2 ** margin, torch.ones_like(amax))
    return Fp8Operand(saturating_cast(padded * _per_element(scale, kind), dtype), scale.reciprocal(), kind,
                      tuple(tensor.shape))


def saturating_cast(scaled, dtype):
    """Scaled values in FP8 `dtype`, those beyond its range at its largest magnitude."""
    fp8_max = torch.finfo(dtype).max
    return scaled.clamp(-fp8_max, fp8_max).to(dtype)


def _padded(tensor, kind):
    """Zeros appended to whole tiles: along the contraction for tiles, along both dimensions for blocks."""
    if kind not in ("tile", "block"):
        return tensor
    rows, columns = tensor.shape
    pad_rows = -rows % BLOCK if kind == "block" else 0
    return F.pad(tensor, (0, -columns % BLOCK, 0, pad_rows))


def _amax(tensor, kind):
    magnitude = tensor.abs()
    rows, columns = tensor.shape
    if kind == "tensor":
        return magnitude.amax()
    if kind == "row":
        return magnitude.amax(dim=1, keepdim=True)
    if kind == "tile":
        return magnitude.view(rows, columns // BLOCK, BLOCK).amax(dim=2)
    if kind == "block":
        return magnitude.view(rows // BLOCK, BLOCK, columns // BLOCK, BLOCK).amax(dim=(1, 3))
    raise ValueError(f"unknown scaling kind {kind!r}")


def _per_element(scale, kind):
    """A scale broadcastable to its operand's (padded) data."""
    if kind == "tile":
        return scale.repeat_interleave(BLOCK, dim=1)
    if kind == "block":
        return scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return scale


def scaled_gemm(a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b^T from FP8 operands sharing their contraction dimension."""
    if a.kind == "tile":
        return _blockwise_gemm(a, b, out_dtype)
    scale_b = b.scale_inv.reshape(1, -1) if b.kind == "row" else b.scale_inv
    return torch._scaled_mm(a.data, b.data.t(), a.scale_inv, scale_b, out_dtype=out_dtype)


def _blockwise_gemm(a, b, out_dtype):
    """One rowwise _scaled_mm per 128-wide slice of K, accumulated in fp32 (DeepSeek's promotion)."""
    total = None
    for block in range(a.data.shape[1] // BLOCK):
        columns = slice(block * BLOCK, (block + 1) * BLOCK)
        scale_b = b.scale_inv[:, block]
        if b.kind == "block":
            scale_b = scale_b.repeat_interleave(BLOCK)
        scale_a = a.scale_inv[:, block:block + 1].contiguous()
        partial = torch._scaled_mm(a.data[:, columns], b.data[:, columns].t(), scale_a,
                                   scale_b.reshape(1, -1).contiguous(), out_dtype=torch.float32)
        total = partial if total is None else total + partial
    return total[:a.shape[0], :b.shape[0]].to(out_dtype)


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How every operand of a linear layer is quantised: recipe, format, margin, and which dimension
    (`split`: tokens, inputs or outputs) `amax_group` splits, if any."""
    recipe: str
    fmt: str
    margin: int = 0
    amax_group: object = None
    split: str | None = None

    def __post_init__(self):
        if self.recipe not in DYNAMIC_RECIPES:
            raise ValueError(f"FP8 recipe {self.recipe!r} is not one of {DYNAMIC_RECIPES}")
        fp8_dtypes(self.fmt)
        if (self.amax_group is None) != (self.split is None):
            raise ValueError("amax_group and split come together: the group and the dimension it splits")
        if self.split is not None and self.split not in SPLIT_DIMS:
            raise ValueError(f"split {self.split!r} is not one of {SPLIT_DIMS}")

    def __deepcopy__(self, memo):
        """Itself: it is immutable, and its process group cannot be copied (DeepSpeed-MoE deep-copies the expert
        it is given once per local expert)."""
        return self

    def quantize(self, tensor, dims, role) -> Fp8Operand:
        """`tensor` [rows, contraction] whose dimensions are named `dims`; role is input, weight or grad."""
        kind = _KINDS[self.recipe][role == "weight"]
        dtype = fp8_dtypes(self.fmt)[role == "grad"]
        return quantize(tensor, kind, dtype, self.margin, self._amax_group(kind, dims))

    def quantize_transposed(self, operand, tensor, dims, role) -> Fp8Operand:
        """`tensor`^T quantised for a GEMM contracting dims[1]: the bytes of `operand` where its scales allow."""
        if operand.kind in _TRANSPOSABLE:
            return operand.transposed()
        return self.quantize(tensor.t(), dims, role)

    def linear(self, input_, weight):
        """input_ @ weight^T (no bias) with the forward and both backward GEMMs in FP8."""
        return Fp8Linear.apply(input_, weight, self)

    def _amax_group(self, kind, dims):
        """The group whose shards share this operand's scales: where the scaling region spans the split."""
        spans_split = self.split in dims if kind == "tensor" else kind == "row" and self.split == dims[1]
        return self.amax_group if spans_split else None


class Fp8Linear(torch.autograd.Function):
    """input_ @ weight^T in FP8, its operands quantised by `recipe` (an Fp8Recipe, or fp8_delayed.DelayedScaling):
    quantize(tensor, dims, role) and quantize_transposed(operand, tensor, dims, role)."""

    @staticmethod
    def forward(ctx, input_, weight, recipe):
        x = input_.reshape(-1, input_.shape[-1])
        x_fp8 = recipe.quantize(x, ("tokens", "inputs"), "input")
        w_fp8 = recipe.quantize(weight, ("outputs", "inputs"), "weight")
        output = scaled_gemm(x_fp8, w_fp8, input_.dtype)
        x_t = recipe.quantize_transposed(x_fp8, x, ("inputs", "tokens"), "input")
        w_t = recipe.quantize_transposed(w_fp8, weight, ("inputs", "outputs"), "weight")
        ctx.save_for_backward(x_t.data, x_t.scale_inv, w_t.data, w_t.scale_inv)
        ctx.x_t_layout, ctx.w_t_layout = (x_t.kind, x_t.shape), (w_t.kind, w_t.shape)
        ctx.recipe, ctx.input_shape = recipe, input_.shape
        ctx.input_dtype, ctx.weight_dtype = input_.dtype, weight.dtype
        return output.view(*input_.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x_data, x_scale, w_data, w_scale = ctx.saved_tensors
        x_t = Fp8Operand(x_data, x_scale, *ctx.x_t_layout)
        w_t = Fp8Operand(w_data, w_scale, *ctx.w_t_layout)
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        grad_fp8 = ctx.recipe.quantize(grad, ("tokens", "outputs"), "grad")
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_input = scaled_gemm(grad_fp8, w_t, ctx.input_dtype).view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            grad_t = ctx.recipe.quantize_transposed(grad_fp8, grad, ("outputs", "tokens"), "grad")
            grad_weight = scaled_gemm(grad_t, x_t, ctx.weight_dtype)
        return grad_input, grad_weight, None


def fp8_linear(input_: torch.Tensor, weight: torch.Tensor, recipe: str, fmt: str, margin: int = 0,
               amax_group=None, split: str | None = None) -> torch.Tensor:
    """input_ @ weight^T (no bias) with the forward and both backward GEMMs in FP8.
    input_ [..., inputs], weight [outputs, inputs]; amax_group with split: see the module docstring."""
    return Fp8Recipe(recipe, fmt, margin, amax_group, split).linear(input_, weight)


def fp8_grouped_linear(input_: torch.Tensor, weights, tokens_per_group, recipe: str, fmt: str,
                       margin: int = 0) -> torch.Tensor:
    """Experts' GEMMs: input_ [tokens, inputs] sorted by group, weights [groups, outputs, inputs] (or a
    sequence of [outputs, inputs]); each group's rows times its weight^T, every GEMM in FP8 with the group's
    own scales. Groups without tokens run no GEMM (their weights get no gradient from them)."""
    return grouped_gemms(input_, weights, tokens_per_group,
                         lambda group, rows, weight: fp8_linear(rows, weight, recipe, fmt, margin))


def grouped_gemms(input_, weights, tokens_per_group, linear):
    """linear(group, rows, weight) of each group's rows (input_ sorted by group) and its weight, concatenated; a
    group without rows runs none."""
    chunks = input_.split([int(count) for count in tokens_per_group])
    return torch.cat([linear(group, chunk, weights[group]) if len(chunk)
                      else chunk.new_zeros((0, weights[group].shape[0])) for group, chunk in enumerate(chunks)])


def fp8_support_problems(device, recipe=None) -> list[str]:
    """What `device` lacks for the FP8 GEMMs of `recipe` (every recipe's when it names none built here), one sentence
    each; empty where it has them."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.version.hip:
            return [f"{torch.cuda.get_device_name(device)}: ROCm's FP8 types (e4m3fnuz) are not supported here"]
        problems = cuda_capability_problems(torch.cuda.get_device_name(device),
                                            torch.cuda.get_device_capability(device))
        if problems:
            return problems
    elif device.type != "cpu":
        return [f"device type {device.type!r} has no FP8 GEMM path here (CPUs and CUDA GPUs do)"]
    return _probe_problems(device, recipe)


def cuda_capability_problems(name: str, capability: tuple[int, int]) -> list[str]:
    if tuple(capability) >= MIN_CUDA_CAPABILITY:
        return []
    major, minor = capability
    return [f"{name} (sm_{major}{minor}) has no FP8 tensor cores: FP8 GEMMs need sm_89 (Ada) or sm_90 "
            f"(Hopper) and newer"]


# the _scaled_mm scaling each recipe calls: blockwise runs rowwise GEMMs, one per 128 of K
SCALED_MM_SCALING = {"tensorwise": "tensorwise", "rowwise": "rowwise", "blockwise": "rowwise", "delayed": "tensorwise"}


def _probe_problems(device, recipe):
    """Runs a tiny _scaled_mm of each scaling `recipe` calls on the device: the refusal, if any, is the problem (torch
    2.11 runs tensorwise scaling on a CPU, not rowwise)."""
    problems = []
    ones = torch.ones(16, 16, device=device)
    operand = ones.to(torch.float8_e4m3fn)
    scales = {"tensorwise": (ones.new_tensor(1.0), ones.new_tensor(1.0)),
              "rowwise": (ones.new_ones(16, 1), ones.new_ones(1, 16))}
    wanted = [SCALED_MM_SCALING[recipe]] if recipe in SCALED_MM_SCALING else list(scales)
    for scaling in wanted:
        try:
            torch._scaled_mm(operand, operand.t(), *scales[scaling], out_dtype=torch.bfloat16)
        except (RuntimeError, ValueError, NotImplementedError) as error:
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            called_by = f" (the {recipe} recipe's)" if recipe not in (None, scaling) else ""
            problems.append(f"{device}: torch {torch.__version__} refuses a {scaling} FP8 GEMM{called_by} "
                            f"({first_line})")
    return problems
