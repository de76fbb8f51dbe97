"""Delayed scaling (core/tensor_parallel/fp8_delayed.py) on one process: the scales come from earlier steps' amaxes
(newest, or the largest of the history), with the margin; a step without an amax keeps its scale; values beyond the
scale's range saturate; only training records amaxes; the history and scales are the checkpointed state."""
import math

import pytest
import torch

from megatron_ds.core.tensor_parallel.fp8_delayed import DelayedScaling, delayed_scalings, update_delayed_scales

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _step(scaling, input_, weight, output_grad=None):
    """One training step's GEMMs: forward and backward, then the step's update."""
    input_ = input_.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    output = scaling.linear(input_, weight)
    output.backward(torch.ones_like(output) if output_grad is None else output_grad)
    update_delayed_scales([scaling])
    return output.detach()


def _amaxes(input_, weight, output_grad):
    return torch.stack([input_.abs().amax(), weight.abs().amax(), output_grad.abs().amax()])


@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_the_scales_come_from_the_history_of_earlier_steps(algo):
    scaling = DelayedScaling("hybrid", margin=1, history_len=3, compute_algo=algo)
    weight, output_grad = torch.full((4, 8), 0.5), torch.full((2, 4), 2.0)
    assert torch.equal(scaling.scale, torch.ones(3))  # before any update, as Transformer Engine starts
    steps = [torch.full((2, 8), value) for value in (4.0, 1.0, 2.0, 0.5)]
    seen = []
    for input_ in steps:
        _step(scaling, input_, weight, output_grad)
        seen.append(_amaxes(input_, weight, output_grad))
    assert torch.equal(scaling.amax_history, torch.stack(seen[::-1][:3]))  # the last three steps, newest first
    chosen = seen[-1] if algo == "most_recent" else torch.stack(seen[-3:]).amax(dim=0)
    expected = torch.tensor([E4M3_MAX, E4M3_MAX, E5M2_MAX]) / chosen / 2
    assert torch.equal(scaling.scale, expected)


def test_a_step_without_an_amax_keeps_the_scale_and_values_beyond_the_range_saturate():
    scaling = DelayedScaling("e4m3")
    _step(scaling, torch.full((2, 8), 2.0), torch.ones(4, 8))
    before = scaling.scale.clone()
    update_delayed_scales([scaling])  # a step in which the layer ran nothing: amaxes 0
    assert torch.equal(scaling.scale, before)
    scaling.step_amax[0] = math.inf  # a non-finite input
    update_delayed_scales([scaling])
    assert torch.equal(scaling.scale, before)
    # the input's scale is fixed at 448 / 2: an input of 4 lands beyond E4M3's range and saturates at 448
    output = scaling.linear(torch.full((1, 8), 4.0), torch.eye(8)[:1])
    assert output.item() == E4M3_MAX / before[0].item()


def test_only_training_records_the_forward_amaxes_and_the_products_are_fp8_ones():
    torch.manual_seed(0)
    scaling = DelayedScaling("e4m3")
    input_, weight = torch.randn(64, 32), torch.randn(16, 32) / 32 ** 0.5
    scaling.eval()
    scaling.linear(input_, weight)
    assert torch.equal(scaling.step_amax, torch.zeros(3))
    scaling.train()
    _step(scaling, input_, weight)
    output = scaling.linear(input_, weight)
    exact = input_ @ weight.t()
    error = ((output - exact).norm() / exact.norm()).item()
    assert 1e-3 < error < 0.051, error  # FP8's rounding, within E4M3 x E4M3's bound (docs/fp8.md)


def test_the_history_and_scales_are_the_checkpointed_state_and_found_under_a_model():
    model = torch.nn.ModuleDict({"first": torch.nn.Linear(2, 2), "second": torch.nn.Linear(2, 2)})
    model["first"].fp8_recipe = DelayedScaling("e4m3", history_len=4)
    model["second"].fp8_recipe = DelayedScaling("hybrid")
    assert delayed_scalings(model) == [model["first"].fp8_recipe, model["second"].fp8_recipe]
    state = model.state_dict()
    assert state["first.fp8_recipe.amax_history"].shape == (4, 3)
    assert not [name for name in state if name.endswith("step_amax")]
    with pytest.raises(ValueError, match="history length 0"):
        DelayedScaling("e4m3", history_len=0)
