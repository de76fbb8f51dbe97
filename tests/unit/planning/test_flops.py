"""megatron_ds.planning.hardware_flops: model and hardware FLOPs per iteration (Narayanan et al. 2021 and the
recompute terms of docs/formulas.md) and each stage's share, by hand."""
import dataclasses

import pytest

from megatron_ds.core.models.gpt import model_flops_per_iteration as training_model_flops
from megatron_ds.planning.hardware_flops import (
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    recompute_flops_per_token,
    stage_hardware_flops_per_micro_batch,
)
from megatron_ds.planning.model import Layout
from tests.support.planning_specs import hand_case, small_model

# the by-hand case, forward FLOPs per token: a layer 24h^2 + 4sh, the head 2hV (h 64, s 32, V 256)
LAYER = 24 * 64 ** 2 + 4 * 32 * 64          # 106496
SCORES = 4 * 32 * 64                        # 8192 of it: QK^T and attention x V
HEAD = 2 * 64 * 256                         # 32768


def test_flops_by_hand():
    model, layout = hand_case()
    B, s, l, h, V = 16, 32, 4, 64, 256

    def flops(recompute):
        return hardware_flops_per_iteration(model, Layout(2, 2, 2, 2, 16, recompute=recompute))

    expected_model = 72 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert model_flops_per_iteration(model, layout) == pytest.approx(expected_model, rel=1e-12)
    assert expected_model == pytest.approx(704_643_072)
    assert model_flops_per_iteration(model, layout) == training_model_flops(model.config, 256, B, s)
    assert flops(None) == pytest.approx(expected_model, rel=1e-12)
    assert flops("selective") == pytest.approx(72 * B * s * l * h ** 2 * (1 + s / (3 * h) + V / (12 * l * h)))
    assert flops("full") == pytest.approx(96 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (16 * l * h)))


def test_flops_of_a_llama_shape_match_the_training_code():
    model = small_model("llama", tied=False)
    layout = Layout(2, 2, 1, 1, 8)
    assert model_flops_per_iteration(model, layout) == training_model_flops(model.config, model.padded_vocab_size(2),
                                                                            8, 16)


def test_model_flops_count_the_padded_vocabulary():
    """V 300 is padded to 304 at TP 1 (multiple of 8) and to 320 at TP 4 (multiple of 32)."""
    model = small_model("gpt2", vocab_size=300, divisible_by=8)
    extra_rows = 320 - 304
    difference = (model_flops_per_iteration(model, Layout(4, 1, 1, 1, 8))
                  - model_flops_per_iteration(model, Layout(1, 1, 1, 1, 8)))
    assert difference == 3 * 2 * 32 * extra_rows * 8 * 16           # 3 x 2 h dV per token, B 8 x s 16 tokens


def test_block_recompute_of_one_layer_in_two_costs_half_of_uniform():
    model, _ = hand_case()
    uniform = Layout(2, 2, 1, 2, 8, recompute="full", recompute_method="uniform", recompute_num_layers=2)
    block = Layout(2, 2, 1, 2, 8, recompute="full", recompute_method="block", recompute_num_layers=1)
    base = model_flops_per_iteration(model, uniform)
    every_layer = hardware_flops_per_iteration(model, uniform) - base
    assert hardware_flops_per_iteration(model, block) - base == pytest.approx(every_layer / 2)   # 1 of 2 per stage


def test_recompute_flops_per_token_on_a_two_layer_stage():
    model, layout = hand_case()
    assert recompute_flops_per_token(model, layout, 2) == 0
    assert recompute_flops_per_token(model, dataclasses.replace(layout, recompute="selective"), 2) == 2 * 3 * SCORES
    assert recompute_flops_per_token(model, dataclasses.replace(layout, recompute="full"), 2) == 2 * LAYER


def test_stage_flops_per_micro_batch_by_hand():
    """3 x forward of 2 layers (+ the head on the last stage) for b s / t = 2 x 32 / 2 = 32 tokens' share."""
    model, layout = hand_case()
    assert stage_hardware_flops_per_micro_batch(model, layout, 2, last=False) == 3 * 2 * LAYER * 32 == 20_447_232
    assert stage_hardware_flops_per_micro_batch(model, layout, 2, last=True) == \
           3 * (2 * LAYER + HEAD) * 32 == 23_592_960
    full = dataclasses.replace(layout, recompute="full")
    assert stage_hardware_flops_per_micro_batch(model, full, 2, last=False) == (3 + 1) * 2 * LAYER * 32


def test_stage_flops_of_every_device_add_up_to_the_iteration():
    """2 stages x TP 2 devices x DP 2 replicas x 4 micro-batches each."""
    model, layout = hand_case()
    for recompute in (None, "selective", "full"):
        choice = dataclasses.replace(layout, recompute=recompute)
        per_micro_batch = sum(stage_hardware_flops_per_micro_batch(model, choice, 2, last=stage == 1)
                              for stage in (0, 1))
        assert per_micro_batch * 2 * 2 * 4 == pytest.approx(hardware_flops_per_iteration(model, choice), rel=1e-12)


def test_recompute_reruns_the_multi_token_prediction_layer():
    """One MTP module (a dense layer of the hand case's shape, its projection 2h -> h and its head, all run once
    per token): full recompute reruns its layer, LAYER, selective its attention scores, 3 x SCORES, beside the
    decoder's; the last stage carries it, and every device's share still adds up to the iteration."""
    model, layout = hand_case()
    model = dataclasses.replace(model, config=dataclasses.replace(model.config, mtp_num_layers=1))
    B, s = 16, 32
    without = hardware_flops_per_iteration(model, layout)
    assert without == model_flops_per_iteration(model, layout)
    full = dataclasses.replace(layout, recompute="full")
    assert hardware_flops_per_iteration(model, full) - without == (4 * LAYER + LAYER) * B * s
    selective = dataclasses.replace(layout, recompute="selective")
    assert hardware_flops_per_iteration(model, selective) - without == (4 + 1) * 3 * SCORES * B * s
    for choice in (full, selective):
        per_micro_batch = sum(stage_hardware_flops_per_micro_batch(model, choice, 2, last=stage == 1)
                              for stage in (0, 1))
        assert per_micro_batch * 2 * 2 * 4 == pytest.approx(hardware_flops_per_iteration(model, choice), rel=1e-12)
