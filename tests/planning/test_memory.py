"""megatron_ds.planning.memory: bytes per parameter of the model states under ZeRO, activation bytes per
layer (Korthikanti et al. 2022, docs/formulas.md) and per 1F1B stage, by hand."""
import dataclasses

import pytest
import torch

from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.planning.memory import (RUNTIME_OVERHEAD_BYTES, StateBytes, activation_bytes_per_layer,
                                         checkpoint_bytes, in_flight_micro_batches, memory_per_stage,
                                         sharded_state_bytes, stage_activation_bytes, state_bytes_per_parameter)
from megatron_ds.planning.model import Layout, ModelSpec
from megatron_ds.planning.parameters import stage_parameters
from tests.planning.specs import hand_case

# the by-hand case (tests/planning/specs.py): s b h of one micro-batch and one layer's activations at TP 2
SBH = 32 * 2 * 64                                                   # 4096
WHOLE_LAYER = SBH * (10 + 24 / 2 + 5 * 4 * 32 / (64 * 2))          # 110592: TP, no SP, no recompute


# ---------------------------------------------------------------- model states

@pytest.mark.parametrize("precision,zero_stage,expected", [
    ("bf16", 1, (2, 2, 4, 12)),     # + the fp32 accumulation buffer of DeepSpeed's BF16_Optimizer
    ("bf16", 0, (2, 2, 0, 12)),
    ("fp16", 1, (2, 2, 0, 12)),
    ("fp32", 1, (4, 4, 0, 12)),     # DeepSpeed's ZeRO optimizer keeps its own fp32 copy, m and v
    ("fp32", 0, (4, 4, 0, 8)),      # torch AdamW: m and v only
])
def test_state_bytes_per_parameter_before_sharding(precision, zero_stage, expected):
    assert dataclasses.astuple(state_bytes_per_parameter(precision, zero_stage)) == expected


def test_a_checkpoint_holds_the_weights_and_optimizer_states_of_every_parameter():
    """The hand case: 256 x 64 embedding + 32 x 64 positions + 4 layers of 12 h^2 + 13 h + final norm 2 h =
    218,496 parameters; bf16 with ZeRO-1 saves 2 + 12 bytes of each (no gradients), fp32 4 + 12, and fp32 without
    ZeRO 4 + 8 (torch AdamW keeps no master copy)."""
    model, _ = hand_case()
    parameters = 256 * 64 + 32 * 64 + 4 * (12 * 64 ** 2 + 13 * 64) + 2 * 64
    assert checkpoint_bytes(model, zero_stage=1) == parameters * 14 == 3_058_944
    fp32 = dataclasses.replace(model, config=dataclasses.replace(model.config, params_dtype=torch.float32))
    assert (checkpoint_bytes(fp32, 1), checkpoint_bytes(fp32, 0)) == (parameters * 16, parameters * 12)


def test_zero_stages_shard_optimizer_then_gradients_then_weights():
    state, dp = StateBytes(2, 2, 4, 12), 4
    assert dataclasses.astuple(sharded_state_bytes(state, 0, dp)) == (2, 2, 4, 12)
    assert dataclasses.astuple(sharded_state_bytes(state, 1, dp)) == (2, 2, 4, 3)          # 12 / 4
    assert dataclasses.astuple(sharded_state_bytes(state, 2, dp)) == (2, 0.5, 1, 3)
    assert dataclasses.astuple(sharded_state_bytes(state, 3, dp)) == (0.5, 0.5, 1, 3)


# ---------------------------------------------------------------- activations per layer

def test_activation_formulas_match_the_formulas_table():
    """docs/formulas.md, "Activation memory per transformer layer", row by row."""
    config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=8, params_dtype=torch.bfloat16)
    model = ModelSpec(config, 1000, 128, 512, 512, True)
    s, b, h, a, t = 512, 4, 256, 8, 4

    def bytes_for(tp, sp, recompute):
        return activation_bytes_per_layer(model, Layout(tp, 1, 1, b, b, sp, recompute))

    assert bytes_for(1, False, None) == s * b * h * (34 + 5 * a * s / h)
    assert bytes_for(t, False, None) == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert bytes_for(t, True, None) == s * b * h / t * (34 + 5 * a * s / h)
    assert bytes_for(t, True, "selective") == 34 * s * b * h / t
    assert bytes_for(t, False, "full") == 2 * s * b * h


def test_selective_recompute_without_sp_drops_only_the_score_term():
    model, _ = hand_case()
    assert activation_bytes_per_layer(model, Layout(2, 1, 1, 2, 2, recompute="selective")) == SBH * (10 + 24 / 2)


def test_saved_layer_inputs_split_over_tp_with_sp_or_distribute_saved_activations():
    model, _ = hand_case()

    def full(**choices):
        return activation_bytes_per_layer(model, Layout(2, 1, 1, 2, 2, recompute="full", **choices))

    assert full() == 2 * SBH
    assert full(sequence_parallel=True) == full(distribute_saved_activations=True) == 2 * SBH / 2


def test_fp32_activations_count_twice():
    model, layout = hand_case()
    fp32 = dataclasses.replace(model, config=dataclasses.replace(model.config, params_dtype=torch.float32))
    for recompute in (None, "selective", "full"):
        choice = dataclasses.replace(layout, recompute=recompute)
        assert activation_bytes_per_layer(fp32, choice) == 2 * activation_bytes_per_layer(model, choice)


# ---------------------------------------------------------------- per 1F1B stage

def test_stage_i_holds_min_p_minus_i_and_m_micro_batches():
    assert [in_flight_micro_batches(Layout(1, 4, 1, 1, 8), stage) for stage in range(4)] == [4, 3, 2, 1]   # m 8
    assert [in_flight_micro_batches(Layout(1, 4, 1, 1, 2), stage) for stage in range(4)] == [2, 2, 2, 1]   # m 2


def test_memory_by_hand():
    model, layout = hand_case()
    assert [in_flight_micro_batches(layout, stage) for stage in (0, 1)] == [2, 1]
    sbh = 32 * 2 * 64
    per_layer = sbh * (10 + 24 / 2 + 5 * 4 * 32 / (64 * 2))                       # TP, no SP, no recompute
    assert activation_bytes_per_layer(model, layout) == per_layer == 110592
    first, last = memory_per_stage(model, layout, stage_parameters(model, layout.tp, layout.pp))
    assert (first.weights, first.gradients, first.grad_accumulation, first.optimizer) == \
           (2 * 60608, 2 * 60608, 4 * 60608, 12 / 2 * 60608)                      # 60608 parameters (bf16, DP 2)
    assert first.activations == 2 * 2 * per_layer + 2 * sbh                       # 2 in flight; embedding mask
    assert last.activations == 2 * per_layer + 4 * sbh + 4 * 32 * 2 * 256 / 2    # 1 in flight; norm/head, softmax
    assert first.total == 14 * 60608 + first.activations + RUNTIME_OVERHEAD_BYTES
    assert last.total == 14 * 60736 + last.activations + RUNTIME_OVERHEAD_BYTES   # 60736 with the tied copy


def test_sequence_parallel_splits_the_first_and_last_stage_extras_but_not_the_softmax():
    model, layout = hand_case()
    sp = dataclasses.replace(layout, sequence_parallel=True)
    per_layer = SBH / 2 * (34 + 5 * 4 * 32 / 64)                                 # 90112: TP + SP row
    assert stage_activation_bytes(model, sp, 0, 2) == 2 * (2 * per_layer + SBH / 2)
    assert stage_activation_bytes(model, sp, 1, 2) == 2 * per_layer + 4 * SBH / 2 + 4 * 32 * 2 * 256 / 2


def test_one_stage_pipeline_has_both_extras_for_one_micro_batch():
    model, _ = hand_case()
    layout = Layout(2, 1, 4, 2, 16)                                               # m 2, one stage
    assert stage_activation_bytes(model, layout, 0, 4) == 4 * WHOLE_LAYER + SBH + 4 * SBH + 4 * 32 * 2 * 256 / 2


def test_full_recompute_methods_by_hand():
    """Megatron's "uniform" (chunks of N layers, one input saved per chunk) and "block" (only the first N
    layers of each stage recomputed)."""
    model, _ = hand_case()
    sbh, whole_layer = 32 * 2 * 64, 110592
    uniform = Layout(2, 2, 1, 2, 8, recompute="full", recompute_method="uniform", recompute_num_layers=2)
    block = Layout(2, 2, 1, 2, 8, recompute="full", recompute_method="block", recompute_num_layers=1)
    last_stage_extra = 4 * sbh + 4 * 32 * 2 * 256 / 2
    assert stage_activation_bytes(model, uniform, 1, 2) == 2 * sbh + 2 * whole_layer + last_stage_extra
    assert stage_activation_bytes(model, block, 0, 2) == 2 * (2 * sbh + whole_layer) + whole_layer + 2 * sbh


def test_uniform_chunks_round_up_and_the_working_set_is_one_chunk():
    """3 layers in chunks of 2: 2 saved inputs per micro-batch; backward recomputes at most 2 whole layers."""
    model, _ = hand_case()
    layout = Layout(2, 2, 1, 2, 8, recompute="full", recompute_method="uniform", recompute_num_layers=2)
    # stage 0 of 2 with m 4: 2 micro-batches in flight, each with 2 saved inputs and the embedding mask
    assert stage_activation_bytes(model, layout, 0, 3) == 2 * (2 * 2 * SBH + SBH) + 2 * WHOLE_LAYER
