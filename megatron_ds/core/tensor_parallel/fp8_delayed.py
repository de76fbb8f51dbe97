"""Delayed scaling (`--fp8-recipe delayed`): Transformer Engine's FP8 recipe, and Megatron-LM's default.

Each operand of a linear's GEMMs (its input, its weight, its output gradient) is one tensor-scaled FP8 tensor whose
scale was fixed before the step, from the amaxes of earlier steps: `amax_history` holds the last
--fp8-amax-history-len steps' amaxes, newest first, and the scale is fp8_max / amax / 2**margin with amax the newest
(`most_recent`) or the largest (`max`) of them. Values beyond fp8_max / scale saturate. Before the first update the
scales are 1, as in Transformer Engine.

Once per optimizer step (`update_delayed_scales`, after the step) the amaxes each linear saw during it (its
forward's in training mode and its backward's, the largest over the micro-batches; recompute and reruns see the
same tensors again) are all-reduced (MAX) over every rank of the pipeline stage: TP, then the sequence-, context- and
data-parallel ranks. So each rank holds the same history and scales, those of the unsplit tensors of the whole
global batch: every TP, SP, CP and DP layout quantises to the bytes one rank would, and the pipeline schedules
agree, since no scale moves between micro-batches. No GEMM waits on a collective.

The history and scales are persistent buffers (`<linear>.fp8_recipe.amax_history` / `.scale`; a dropless MoE layer's
experts share one of its own, a row per global expert and GEMM), identical on every rank of a stage, so checkpoints
carry them, whole, under any resharding; a checkpoint without them (saved in bf16 or with another recipe) starts them
fresh.
"""
import torch
import torch.distributed as dist

from megatron_ds.core.tensor_parallel.fp8 import Fp8Linear, Fp8Operand, fp8_dtypes, grouped_gemms, saturating_cast

AMAX_COMPUTE_ALGOS = ("most_recent", "max")
ROLES = ("input", "weight", "grad")


class DelayedScaling(torch.nn.Module):
    """The delayed scaling of one linear layer, or of a layer's experts (slots: (experts, 3 GEMMs), a row of scales
    per expert and GEMM, by global expert index: every rank keeps all of them, each records its own experts'): the
    recipe their GEMMs run (`linear`, `grouped_linear`), and its state (the module docstring)."""
    recipe = "delayed"

    def __init__(self, fmt, margin=0, history_len=1, compute_algo="most_recent", slots=()):
        super().__init__()
        if history_len < 1:
            raise ValueError(f"FP8 amax history length {history_len}: must be >= 1")
        if compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"FP8 amax compute algorithm {compute_algo!r} is not one of {AMAX_COMPUTE_ALGOS}")
        self.fmt, self.margin, self.compute_algo = fmt, margin, compute_algo
        activations, gradients = fp8_dtypes(fmt)
        self.dtypes = (activations, activations, gradients)
        self.register_buffer("amax_history", torch.zeros(history_len, *slots, len(ROLES)))
        self.register_buffer("scale", torch.ones(*slots, len(ROLES)))
        self.register_buffer("step_amax", torch.zeros(*slots, len(ROLES)), persistent=False)
        self.register_buffer("fp8_max", torch.tensor([torch.finfo(dtype).max for dtype in self.dtypes]),
                             persistent=False)

    def extra_repr(self):
        return (f"{self.fmt}, margin={self.margin}, history={self.amax_history.shape[0]}, "
                f"compute_algo={self.compute_algo}, slots={tuple(self.scale.shape[:-1])}")

    def linear(self, input_, weight, slot=()):
        """input_ @ weight^T (no bias) with the forward and both backward GEMMs in FP8, at `slot`'s scales."""
        return Fp8Linear.apply(input_, weight, _Slot(self, slot))

    def grouped_linear(self, input_, weights, tokens_per_group, slots):
        """Experts' GEMMs (fp8.fp8_grouped_linear's layout), group g at slots[g]'s scales."""
        return grouped_gemms(input_, weights, tokens_per_group,
                             lambda group, rows, weight: self.linear(rows, weight, slots[group]))

    @torch.no_grad()
    def advance(self, amax):
        """The step's amaxes (reduced over the stage) into the history, and the scales they give."""
        self.amax_history.copy_(torch.roll(self.amax_history, 1, dims=0))
        self.amax_history[0] = amax
        chosen = self.amax_history[0] if self.compute_algo == "most_recent" else self.amax_history.amax(dim=0)
        fresh = self.fp8_max / chosen / 2 ** self.margin
        self.scale.copy_(torch.where((chosen > 0) & torch.isfinite(chosen), fresh, self.scale))
        self.step_amax.zero_()


class _Slot:
    """One linear's (or one expert's GEMM's) scales and step amaxes in a DelayedScaling: the recipe Fp8Linear runs."""

    def __init__(self, scaling, slot):
        self.scaling, self.scale, self.step_amax = scaling, scaling.scale[slot], scaling.step_amax[slot]

    def quantize(self, tensor, dims, role) -> Fp8Operand:
        """`tensor` in FP8 at its role's scale, its amax kept for the step's update (dims: see fp8.Fp8Recipe)."""
        index = ROLES.index(role)
        if role == "grad" or self.scaling.training:
            with torch.no_grad():
                self.step_amax[index] = torch.maximum(self.step_amax[index], tensor.detach().abs().amax().float())
        scale = self.scale[index]
        data = saturating_cast(tensor.float() * scale, self.scaling.dtypes[index])
        return Fp8Operand(data, scale.reciprocal(), "tensor", tuple(tensor.shape))

    def quantize_transposed(self, operand, tensor, dims, role) -> Fp8Operand:
        """A tensor scale survives the transpose: the same bytes."""
        return operand.transposed()


def delayed_scalings(module) -> list[DelayedScaling]:
    """Every delayed scaling under `module`, in module order (the same on every rank of a pipeline stage)."""
    return [submodule for submodule in module.modules() if isinstance(submodule, DelayedScaling)]


def update_delayed_scales(scalings, groups=()):
    """After an optimizer step: every scaling's amaxes of the step all-reduced (MAX) over `groups` (together the
    ranks of the pipeline stage), in one all-reduce per group, then each history and scale moved on."""
    if not scalings:
        return
    amax = torch.cat([scaling.step_amax.flatten() for scaling in scalings])
    for group in groups:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    for scaling, part in zip(scalings, amax.split([scaling.step_amax.numel() for scaling in scalings])):
        scaling.advance(part.view_as(scaling.step_amax))
