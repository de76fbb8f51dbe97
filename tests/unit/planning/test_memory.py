"""megatron_ds.planning.memory: bytes per parameter of the model states under ZeRO, activation bytes per
layer (Korthikanti et al. 2022, docs/formulas.md) and per 1F1B stage, by hand."""
import dataclasses

import pytest
import torch

from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.planning.memory import (
    RUNTIME_OVERHEAD_BYTES,
    StateBytes,
    activation_bytes_per_layer,
    checkpoint_bytes,
    in_flight_micro_batches,
    memory_per_stage,
    sharded_state_bytes,
    stage_activation_bytes,
    state_bytes_per_parameter,
)
from megatron_ds.planning.model import Layout, ModelSpec
from megatron_ds.planning.parameters import stage_parameters
from tests.support.planning_specs import hand_case

# the by-hand case (tests/support/planning_specs.py): s b h of one micro-batch and one layer's activations at TP 2, with
# the default attention (sdpa: flash kernels, whose output is the projection's input, already in the paper's
# 24/t, and an fp32 log-sum-exp per head and query, A = 4a/h = 4 x 4 / 64 = 0.25 instead of the scores' 5as/h)
SBH = 32 * 2 * 64                                                   # 4096
FLASH = 4 * 4 / 64                                                  # 0.25
WHOLE_LAYER = SBH * (10 + 24 / 2 + FLASH / 2)                       # 90624: TP, no SP, no recompute
# the last stage's cross entropy: 64 tokens (s b, not split over TP) x V/t = 256 / 2 = 128 logits, 16-bit:
# the kept logits, the micro-batch before's and their gradient, 3 x 2 x 64 x 128 = 49152, and two fp32 chunk
# temporaries of min(64, 2**24 // 128 = 131072) = 64 rows, 2 x 4 x 64 x 128 = 65536
CROSS_ENTROPY = 3 * 2 * 64 * 128 + 2 * 4 * 64 * 128                 # 114688
# every stage: one layer's backward working set, fc1's output gradient 2 s b 4h / t = 4 s b h and two gradients of
# the hidden state 2 x 2 s b h; a stage that sends activations (DeepSpeed splits them over TP): each in-flight
# micro-batch's output as sent, 2 s b h / t, and one received gradient
BACKWARD = 4 * SBH + 2 * 2 * SBH                                    # 32768


def sent(in_flight):
    return (in_flight + 1) * SBH


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

def _formulas_table_case(attention_backend):
    config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=8, params_dtype=torch.bfloat16,
                               attention_backend=attention_backend)
    model = ModelSpec(config, 1000, 128, 512, 512, True)

    def bytes_for(tp, sp, recompute):
        return activation_bytes_per_layer(model, Layout(tp, 1, 1, 4, 4, sp, recompute))
    return bytes_for


def test_activation_formulas_match_the_formulas_table():
    """docs/formulas.md, "Activation memory per transformer layer", row by row: the paper's, for the explicit
    attention (--attention-backend local)."""
    bytes_for = _formulas_table_case("local")
    s, b, h, a, t = 512, 4, 256, 8, 4
    assert bytes_for(1, False, None) == s * b * h * (34 + 5 * a * s / h)
    assert bytes_for(t, False, None) == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert bytes_for(t, True, None) == s * b * h / t * (34 + 5 * a * s / h)
    assert bytes_for(t, True, "selective") == 34 * s * b * h / t
    assert bytes_for(t, False, "full") == 2 * s * b * h


@pytest.mark.parametrize("attention_backend", ["sdpa", "flash"])
def test_flash_attention_keeps_its_output_and_log_sum_exp_instead_of_the_scores(attention_backend):
    """A = 4a/h: one fp32 log-sum-exp per head and query row; the output [s, b, a/t, d] is the projection's input,
    in the paper's 24/t already."""
    bytes_for = _formulas_table_case(attention_backend)
    s, b, h, a, t = 512, 4, 256, 8, 4
    log_sum_exp = 4 * a * s * b
    assert bytes_for(1, False, None) == 34 * s * b * h + log_sum_exp
    assert bytes_for(t, False, None) == s * b * h * (10 + 24 / t) + log_sum_exp / t
    assert bytes_for(t, True, None) == (34 * s * b * h + log_sum_exp) / t
    assert bytes_for(t, True, "selective") == 34 * s * b * h / t


def test_selective_recompute_without_sp_drops_only_the_score_term():
    model, _ = hand_case()
    assert activation_bytes_per_layer(model, Layout(2, 1, 1, 2, 2, recompute="selective")) == SBH * (10 + 24 / 2)


def test_saved_layer_inputs_split_over_tp_with_sp_or_distribute_saved_activations():
    model, _ = hand_case()

    def full(**choices):
        return activation_bytes_per_layer(model, Layout(2, 1, 1, 2, 2, recompute="full", **choices))

    assert full() == 2 * SBH
    assert full(sequence_parallel=True) == full(distribute_saved_activations=True) == 2 * SBH / 2


def test_fp32_activations_count_twice_but_not_the_dropout_masks_or_the_log_sum_exp():
    """The two 1-byte hidden-dropout masks (2 s b h, not split over TP without SP) and the fp32 log-sum-exp
    (4 a s b / t = 512) are the same bytes in either precision."""
    model, layout = hand_case()
    fp32 = dataclasses.replace(model, config=dataclasses.replace(model.config, params_dtype=torch.float32))
    masks, log_sum_exp = 2 * SBH, 4 * 4 * 32 * 2 / 2
    same_bytes = {None: masks + log_sum_exp, "selective": masks, "full": 0}
    for recompute, unchanged in same_bytes.items():
        choice = dataclasses.replace(layout, recompute=recompute)
        assert activation_bytes_per_layer(fp32, choice) == 2 * activation_bytes_per_layer(model, choice) - unchanged


# ---------------------------------------------------------------- per 1F1B stage

def test_stage_i_holds_min_p_minus_i_and_m_micro_batches():
    assert [in_flight_micro_batches(Layout(1, 4, 1, 1, 8), stage) for stage in range(4)] == [4, 3, 2, 1]   # m 8
    assert [in_flight_micro_batches(Layout(1, 4, 1, 1, 2), stage) for stage in range(4)] == [2, 2, 2, 1]   # m 2


def test_memory_by_hand():
    """Stage 0 of 2 holds 2 micro-batches of 2 layers and the embedding-dropout mask s b h of each; stage 1 one
    micro-batch, the final norm's and head's inputs 4 s b h and the cross entropy's 114688 bytes (CROSS_ENTROPY).
    A layer at TP 2 with flash attention: s b h (10 + 24/2 + (4a/h)/2) = 4096 x 22.125 = 90624."""
    model, layout = hand_case()
    assert [in_flight_micro_batches(layout, stage) for stage in (0, 1)] == [2, 1]
    sbh = 32 * 2 * 64
    per_layer = sbh * (10 + 24 / 2 + (4 * 4 / 64) / 2)                         # TP, no SP, no recompute
    assert activation_bytes_per_layer(model, layout) == per_layer == 90624
    first, last = memory_per_stage(model, layout, stage_parameters(model, layout.tp, layout.pp))
    assert (first.weights, first.gradients, first.grad_accumulation, first.optimizer) == \
           (2 * 60608, 2 * 60608, 4 * 60608, 12 / 2 * 60608)                      # 60608 parameters (bf16, DP 2)
    # 2 in flight; embedding mask
    assert first.activations == 2 * 2 * per_layer + 2 * sbh + BACKWARD + sent(2) == 415744
    # 1 in flight; norm/head inputs; logits 6 s b V / t = 6 x 64 x 128; 2 fp32 chunk temporaries 2 x 4 x 64 x 128
    assert last.activations == 2 * per_layer + 4 * sbh + 6 * 64 * 128 + 2 * 4 * 64 * 128 + BACKWARD == 345088
    assert first.total == 14 * 60608 + first.activations + RUNTIME_OVERHEAD_BYTES
    assert last.total == 14 * 60736 + last.activations + RUNTIME_OVERHEAD_BYTES   # 60736 with the tied copy


def test_the_paper_s_score_term_with_local_attention_by_hand():
    """--attention-backend local keeps the scores: A = 5as/h = 5 x 4 x 32 / 64 = 10, a layer at TP 2
    s b h (10 + 24/2 + 10/2) = 110592; the stage extras do not depend on the attention."""
    model, layout = hand_case()
    local = dataclasses.replace(model, config=dataclasses.replace(model.config, attention_backend="local"))
    assert activation_bytes_per_layer(local, layout) == SBH * (10 + 24 / 2 + 5 * 4 * 32 / (64 * 2)) == 110592
    assert stage_activation_bytes(local, layout, 0, 2) == 2 * (2 * 110592 + SBH) + BACKWARD + sent(2)
    assert stage_activation_bytes(local, layout, 1, 2) == 2 * 110592 + 4 * SBH + CROSS_ENTROPY + BACKWARD


def test_sequence_parallel_splits_the_first_and_last_stage_extras_but_not_the_cross_entropy_s_logits():
    """With SP the embedding mask and the norm and head inputs are split over TP; the cross entropy's logits
    and temporaries are of all s b tokens (the head all-gathers the sequence), so CROSS_ENTROPY stays."""
    model, layout = hand_case()
    sp = dataclasses.replace(layout, sequence_parallel=True)
    per_layer = SBH / 2 * (34 + FLASH)                                            # 70144: TP + SP row
    # the hidden-state gradients split too (2 x 2 s b h / t), fc1's not; DeepSpeed sends whole messages (each
    # rank's own tokens), so stage 0 keeps 2 outputs and a gradient of 2 s b h / t, stage 1 each received input
    backward = 4 * SBH + 2 * 2 * SBH / 2
    assert stage_activation_bytes(model, sp, 0, 2) == 2 * (2 * per_layer + SBH / 2) + backward + 3 * SBH == 321536
    assert stage_activation_bytes(model, sp, 1, 2) == \
        2 * per_layer + 4 * SBH / 2 + CROSS_ENTROPY + backward + SBH == 291840


def test_the_cross_entropy_s_chunk_temporaries_are_fp32_and_of_one_chunk_at_most():
    """fp32 doubles the norm and head inputs and the logits but not the chunk temporaries (fp32 either way):
    2 x 172544 (a layer, test_fp32_...) + 2 x (4 x 4096 + 49152 + BACKWARD) + 65536. A vocabulary of 2**20
    (V/t = 2**19) makes a chunk 2**24 // 2**19 = 32 rows, fewer than the 64 tokens: 2 x 4 x 32 x 2**19 beside the
    logits 6 x 64 x 2**19."""
    model, layout = hand_case()
    fp32 = dataclasses.replace(model, config=dataclasses.replace(model.config, params_dtype=torch.float32))
    assert stage_activation_bytes(fp32, layout, 1, 2) == \
           2 * (2 * WHOLE_LAYER - 2 * SBH - 512) + 2 * (4 * SBH + 6 * 64 * 128 + BACKWARD) + 2 * 4 * 64 * 128 \
           == 607232
    wide = dataclasses.replace(model, vocab_size=2 ** 20)
    assert stage_activation_bytes(wide, layout, 1, 2) == \
           2 * WHOLE_LAYER + 4 * SBH + 6 * 64 * 2 ** 19 + 2 * 4 * 32 * 2 ** 19 + BACKWARD


def test_one_stage_pipeline_has_both_extras_for_one_micro_batch():
    model, _ = hand_case()
    layout = Layout(2, 1, 4, 2, 16)                                               # m 2, one stage
    # 4 layers, the embedding mask s b h, the norm and head inputs 4 s b h and the cross entropy; no pipeline
    assert stage_activation_bytes(model, layout, 0, 4) == \
        4 * WHOLE_LAYER + SBH + 4 * SBH + CROSS_ENTROPY + BACKWARD == 530432


def test_full_recompute_methods_by_hand():
    """Megatron's "uniform" (chunks of N layers, one input saved per chunk) and "block" (only the first N
    layers of each stage recomputed). A whole layer 90624 (flash attention, WHOLE_LAYER); the last stage's extra
    the norm and head inputs 4 s b h and the cross entropy's 114688 (CROSS_ENTROPY)."""
    model, _ = hand_case()
    sbh, whole_layer = 32 * 2 * 64, 90624
    uniform = Layout(2, 2, 1, 2, 8, recompute="full", recompute_method="uniform", recompute_num_layers=2)
    block = Layout(2, 2, 1, 2, 8, recompute="full", recompute_method="block", recompute_num_layers=1)
    last_stage_extra = 4 * sbh + 6 * 64 * 128 + 2 * 4 * 64 * 128
    assert stage_activation_bytes(model, uniform, 1, 2) == 2 * sbh + 2 * whole_layer + last_stage_extra + BACKWARD \
        == 353280
    assert stage_activation_bytes(model, block, 0, 2) == 2 * (2 * sbh + whole_layer) + whole_layer + 2 * sbh \
        + BACKWARD + sent(2) == 341504


def test_uniform_chunks_round_up_and_the_working_set_is_one_chunk():
    """3 layers in chunks of 2: 2 saved inputs per micro-batch; backward recomputes at most 2 whole layers."""
    model, _ = hand_case()
    layout = Layout(2, 2, 1, 2, 8, recompute="full", recompute_method="uniform", recompute_num_layers=2)
    # stage 0 of 2 with m 4: 2 micro-batches in flight, each with 2 saved inputs and the embedding mask
    assert stage_activation_bytes(model, layout, 0, 3) == \
        2 * (2 * 2 * SBH + SBH) + 2 * WHOLE_LAYER + BACKWARD + sent(2) == 267264


def test_gradients_come_with_the_first_backward_where_every_forward_runs_before_it():
    """PP 4, m 2: stages 0-2 run both forwards before either backward, so the activation peak holds no gradient,
    and the first backward makes the gradients while its micro-batch's half of the activations goes; stage 3
    (one in flight) runs a backward before its second forward."""
    model, _ = hand_case()
    layout = Layout(1, 4, 1, 1, 2)
    stages = memory_per_stage(model, layout, stage_parameters(model, layout.tp, layout.pp))
    assert [stage.gradients_before_activation_peak for stage in stages] == [False, False, False, True]
    for stage in stages:
        states = stage.weights + stage.grad_accumulation + stage.optimizer + stage.buffers + stage.overhead
        if stage.gradients_before_activation_peak:
            assert stage.total == states + stage.gradients + stage.activations
        else:
            assert stage.total == states + max(stage.activations, stage.gradients + stage.activations / 2)
