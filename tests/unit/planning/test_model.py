"""megatron_ds.planning.model: Layout's derived sizes and recompute choices, ModelSpec's padding and
precision, Cluster's peak, and the layout rules (layout_errors)."""
import pytest
import torch

from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.launch.devices import device_spec
from megatron_ds.planning.model import Cluster, Layout, ModelSpec, layout_errors
from tests.support.planning_specs import small_model


def test_world_size_and_micro_batches_follow_the_layout():
    layout = Layout(tp=2, pp=4, dp=8, micro_batch_size=2, global_batch_size=256)
    assert layout.world_size == 64                 # 2 x 4 x 8
    assert layout.num_micro_batches == 16          # 256 / (2 x 8): gradient accumulation steps per pipeline


def test_only_full_recompute_runs_layers_twice():
    assert Layout(1, 1, 1, 1, 1).recomputed_layers(6) == 0
    assert Layout(1, 1, 1, 1, 1, recompute="selective").recomputed_layers(6) == 0


def test_uniform_recompute_reruns_every_layer_whatever_the_chunk():
    layout = Layout(1, 1, 1, 1, 1, recompute="full", recompute_method="uniform", recompute_num_layers=4)
    assert layout.recomputed_layers(6) == 6        # chunks of 4 and 2 layers, all recomputed


def test_block_recompute_reruns_the_first_n_layers_of_a_stage():
    block = dict(recompute="full", recompute_method="block")
    assert Layout(1, 1, 1, 1, 1, recompute_num_layers=2, **block).recomputed_layers(6) == 2
    assert Layout(1, 1, 1, 1, 1, recompute_num_layers=8, **block).recomputed_layers(6) == 6   # capped at the stage


def test_recompute_descriptions_name_method_chunk_and_split():
    def text(**choices):
        return Layout(1, 1, 1, 1, 1, **choices).describe_recompute()

    assert text() == "none" and text(recompute="selective") == "selective"
    assert text(recompute="full") == "full"
    assert text(recompute="full", recompute_method="block") == "full (block)"
    assert text(recompute="full", recompute_num_layers=4) == "full (uniform 4)"
    assert text(recompute="full", distribute_saved_activations=True) == "full, saved inputs split over TP"


def test_layout_description_counts_micro_batches():
    layout = Layout(2, 4, 8, 2, 256, sequence_parallel=True, recompute="selective")
    assert layout.describe() == ("TP 2 x PP 4 x DP 8, micro batch 2 x 16 micro-batches, SP on, "
                                 "recompute selective, ZeRO-1")


def test_vocabulary_is_padded_to_a_multiple_of_divisor_times_tp():
    model = small_model(vocab_size=300, divisible_by=8)
    assert model.padded_vocab_size(1) == 304       # multiple of 8: 38 x 8
    assert model.padded_vocab_size(4) == 320       # multiple of 32: 10 x 32
    gpt2 = ModelSpec(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4), 50257, 128, 32, 32, True)
    assert gpt2.padded_vocab_size(1) == 50304      # 393 x 128, GPT-2's well-known padded size
    assert gpt2.padded_vocab_size(8) == 51200      # 50 x 1024


@pytest.mark.parametrize("dtype,name,sixteen_bit", [(torch.bfloat16, "bf16", True), (torch.float16, "fp16", True),
                                                    (torch.float32, "fp32", False)])
def test_precision_comes_from_the_parameter_dtype(dtype, name, sixteen_bit):
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, params_dtype=dtype)
    model = ModelSpec(config, 100, 8, 16, 16, True)
    assert (model.precision, model.sixteen_bit) == (name, sixteen_bit)


def test_only_learned_absolute_positions_are_learned():
    assert small_model("gpt2").learned_positions
    assert not small_model("llama").learned_positions     # RoPE has no position parameters


def test_cluster_peak_is_the_device_peak_for_the_precision_unless_overridden():
    a100 = device_spec("a100-80gb")
    assert Cluster(a100, 8, 8).peak_flops(sixteen_bit=True) == 312e12     # bf16 dense
    assert Cluster(a100, 8, 8).peak_flops(sixteen_bit=False) == 19.5e12   # plain fp32
    assert Cluster(a100, 8, 8, peak_tflops_override=150.0).peak_flops(sixteen_bit=False) == 150e12


# ---------------------------------------------------------------- layout_errors

def rule_model(heads=6, ffn=None, layers=3, seq_length=32):
    """h 48, 6 heads (d 8), FFN 4h = 192 unless given."""
    config = TransformerConfig(num_layers=layers, hidden_size=48, num_attention_heads=heads, ffn_hidden_size=ffn)
    return ModelSpec(config, 100, 8, seq_length, seq_length, True)


def reasons(model, layout):
    return [reason for reason, _ in layout_errors(model, layout)]


def test_a_valid_layout_breaks_no_rule():
    assert layout_errors(rule_model(layers=4), Layout(2, 2, 2, 1, 8)) == []


def test_tp_must_divide_heads_kv_heads_and_ffn():
    # 6 heads (6 kv heads) over TP 4: both break; FFN 192 over 4 does not
    assert layout_errors(rule_model(), Layout(4, 1, 1, 1, 1)) == [
        ("heads not divisible by TP", "6 heads over TP 4"), ("kv heads not divisible by TP", "6 kv heads over TP 4")]
    assert layout_errors(rule_model(heads=4, ffn=30), Layout(4, 1, 1, 1, 1)) == [
        ("FFN not divisible by TP", "FFN 30 over TP 4")]


def test_pp_must_divide_layers():
    assert layout_errors(rule_model(layers=3), Layout(1, 2, 1, 1, 1)) == [
        ("layers not divisible by PP", "3 layers over PP 2")]


def test_global_batch_must_be_a_multiple_of_micro_batch_times_dp():
    assert layout_errors(rule_model(), Layout(1, 1, 2, 2, 10)) == [
        ("global batch not a multiple of micro batch x DP", "10 over 2 x 2")]      # 10 % 4 = 2
    assert layout_errors(rule_model(), Layout(1, 1, 2, 2, 12)) == []


def test_zero_2_and_3_need_pp_1():
    assert reasons(rule_model(layers=4), Layout(1, 2, 1, 1, 1, zero_stage=2)) == ["ZeRO-2/3 with PP > 1"]
    assert reasons(rule_model(layers=4), Layout(1, 2, 1, 1, 1, zero_stage=3)) == ["ZeRO-2/3 with PP > 1"]
    assert reasons(rule_model(layers=4), Layout(1, 1, 1, 1, 1, zero_stage=3)) == []


def test_sequence_parallel_needs_tp_to_divide_the_sequence():
    assert layout_errors(rule_model(seq_length=33), Layout(2, 1, 1, 1, 1, sequence_parallel=True)) == [
        ("sequence not divisible by TP (SP)", "sequence 33 over TP 2")]
    assert layout_errors(rule_model(seq_length=33), Layout(2, 1, 1, 1, 1)) == []    # without SP no split
