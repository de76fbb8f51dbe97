"""--zero-stage 0 trains what ZeRO-1 trains, at TP 2 x PP 2 with a tied embedding: the same lm loss and grad norm at
each of 10 iterations, in fp32 and in fp16 (where this CPU's oneDNN has it), and in fp16 under ZB-H1's split
backward. DeepSpeed 0.19.8's engine without ZeRO gets each of these wrong (core/deepspeed_internals.mend_zero_stage_0
mends it): fp32 clipped by the first stage's norm alone and no grad norm reported; fp16 never scaling the loss that
its optimizer unscales, stepping AdamW once with zero gradients at start-up, counting a tied embedding twice and
TP ranks > 0 not at all in the clipping norm. Megatron-DeepSpeed's ZB-H1 example runs fp16 at ZeRO 0."""
import math

import pytest

from megatron_ds.arguments.checks import fp16_supported
from tests.support.layouts import ITERATIONS, run_layout, run_layout_grad_norms

NO_FP16 = pytest.mark.skipif(not fp16_supported(), reason="DeepSpeed has no fp16 on this CPU (oneDNN)")
FP16 = ["--fp16", "--initial-loss-scale", str(2 ** 16)]


@pytest.mark.parametrize("precision, loss_rel, norm_abs", [
    ([], 1e-6, 1.1e-3),
    pytest.param(FP16, 1e-5, 2.1e-3, marks=NO_FP16),
    pytest.param(FP16 + ["--pipeline-schedule", "zbh1"], 1e-5, 2.1e-3, marks=NO_FP16),
], ids=["fp32", "fp16", "fp16-zbh1"])
def test_zero_stage_0_trains_what_zero_stage_1_trains(precision, loss_rel, norm_abs):
    layout = ("gpt2", 2, 2, 1)
    expected_losses = run_layout(*layout, precision)
    expected_norms = run_layout_grad_norms(*layout, precision)
    observed_losses = run_layout(*layout, precision + ["--zero-stage", "0"])
    observed_norms = run_layout_grad_norms(*layout, precision + ["--zero-stage", "0"])
    assert sorted(observed_norms) == list(range(1, ITERATIONS + 1)), observed_norms
    assert all(math.isfinite(norm) for norm in observed_norms.values()), observed_norms
    for iteration in expected_losses:
        assert observed_losses[iteration] == pytest.approx(expected_losses[iteration], rel=loss_rel, abs=0), (
            iteration, observed_losses, expected_losses)
        assert observed_norms[iteration] == pytest.approx(expected_norms[iteration], rel=0, abs=norm_abs), (
            iteration, observed_norms, expected_norms)
