"""FP8 in the planner (docs/fp8.md, docs/formulas.md "FP8"): the GEMMs that run in FP8 at the device's FP8 peak,
what FP8 linears keep for backward (measured on a CPU layer, a DeepSpeed-MoE layer's experts too, and by hand), the
amax all-reduces over TP, and devices without FP8 refused by name (multi-latent attention: test_fp8_mla.py). The
hand case: tests/support/planning_specs.hand_case (h 64, a 4, F 256, s 32, micro batch 2, TP 2 x PP 2): 64 tokens
per rank, 24 h^2 = 98,304 forward FLOPs per token and layer in FP8."""
import dataclasses

import pytest
import torch

from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer
from megatron_ds.launch.devices import device_spec
from megatron_ds.planning import communication as comm
from megatron_ds.planning import plan_cli as cli
from megatron_ds.planning.hardware_flops import fp8_gemm_flops_per_token, stage_fp8_flops_per_micro_batch
from megatron_ds.planning.memory import (
    fp8_copies_bytes,
    fp8_deepspeed_experts_change,
    fp8_layer_change,
    layer_activation_bytes,
)
from megatron_ds.planning.model import Cluster, Layout, ModelSpec
from megatron_ds.planning.parameters import stage_parameters
from megatron_ds.planning.performance import PerformanceAssumptions, stage_time
from tests.support.distributed import run_distributed
from tests.support.planning_specs import HAND_CASE_FLAGS, hand_case
from tests.support.saved_bytes import saved_bytes_after_forward

ASSUMPTIONS = PerformanceAssumptions(compute_efficiency=0.5, bandwidth_efficiency=0.25)


def fp8_hand_case(recipe="tensorwise", **fields):
    model, layout = hand_case()
    config = dataclasses.replace(model.config, fp8_format="e4m3", fp8_recipe=recipe, **fields)
    return dataclasses.replace(model, config=config), layout


def test_the_device_table_holds_the_fp8_peaks_and_names_the_devices_without():
    assert [device_spec(name).peak_fp8_tflops for name in ("h100-80gb", "h800", "h200", "h100-pcie")] == \
        [1979.0, 1979.0, 1979.0, 1513.0]
    assert device_spec("h100-80gb").fp8_problem() is None
    assert "NVIDIA A100-SXM4-80GB has no FP8 tensor cores" in device_spec("a100-80gb").fp8_problem()


def test_the_plan_refuses_fp8_on_a_device_without_it(capsys):
    flags = HAND_CASE_FLAGS[:-2] + ["--device", "a100-80gb", "--fp8-format", "e4m3"]
    assert cli.main(flags) == 2
    assert "--fp8-format e4m3 cannot run on --device: NVIDIA A100-SXM4-80GB has no FP8" in capsys.readouterr().err


def test_the_plan_names_fp8_in_its_precision_and_its_peak(capsys):
    assert cli.main(HAND_CASE_FLAGS[:-2] + ["--device", "h100-80gb", "--fp8-format", "hybrid",
                                            "--fp8-recipe", "blockwise", "--first-last-layers-bf16"]) == 0
    text = capsys.readouterr().out
    assert "bf16, FP8 GEMMs (blockwise, hybrid, first 1 and last 1 layers bf16)" in text
    assert "989 TFLOP/s peak, FP8 1979)" in text


def test_fp8_flops_are_the_layers_weight_gemms_and_first_last_bf16_drops_those_layers():
    model, layout = fp8_hand_case()
    assert fp8_gemm_flops_per_token(model.config, 1) == 24 * 64 ** 2
    first, last = stage_parameters(model, 2, 2)
    # 3 x (forward + 2 backward) x 2 layers x 98,304 x 64 tokens / TP 2; the head (last stage) stays bf16
    assert stage_fp8_flops_per_micro_batch(model, layout, 2, last=False) == 3 * 2 * 98304 * 64 / 2 == 18_874_368
    assert stage_fp8_flops_per_micro_batch(model, layout, 2, last=True, first_layer=3) == 18_874_368
    kept, _ = fp8_hand_case(first_last_layers_bf16=True)
    assert stage_fp8_flops_per_micro_batch(kept, layout, 2, last=False) == 18_874_368 / 2
    bf16, _ = hand_case()
    assert stage_fp8_flops_per_micro_batch(bf16, layout, 2, last=False) == 0


def test_fp8_gemms_run_at_the_fp8_peak():
    """Stage 0: 20,447,232 hardware FLOPs per micro-batch (tests/unit/planning/test_performance.py), 18,874,368 of
    them in FP8 at 1,979 TFLOP/s x 0.5, the rest at 989 x 0.5; at TP 2 tensorwise 2 layers x 8 amax all-reduces,
    10 us each."""
    model, layout = fp8_hand_case()
    cluster = Cluster(device_spec("h100-80gb"), 8, 8)
    stage = stage_parameters(model, 2, 2)[0]
    timed = stage_time(model, layout, cluster, ASSUMPTIONS, stage, comm.links(layout, cluster))
    assert timed.compute == pytest.approx((20_447_232 - 18_874_368) / 494.5e12 + 18_874_368 / 989.5e12)
    assert timed.fp8_amax_reductions == 16
    assert timed.fp8_amax_latency == pytest.approx(16 * 10e-6)


def test_what_fp8_linears_keep_by_hand():
    """fp8_copies_bytes: x^T and W^T one byte an element, and the scales: tensorwise 2 x 4 bytes; rowwise 4 bytes per
    input row of each; blockwise x^T's 200 tokens padded to 2 tiles per row, W^T's 64 x 96 to one 128 x 128 block."""
    assert fp8_copies_bytes(64, 96, 200, "tensorwise") == 64 * (200 + 96) + 8
    assert fp8_copies_bytes(64, 96, 200, "rowwise") == 64 * (200 + 96) + 2 * 4 * 64
    assert fp8_copies_bytes(64, 96, 200, "blockwise") == 64 * 256 + 128 * 128 + 4 * (64 * 2 + 1)


@pytest.mark.parametrize("recompute,projection_input", [(None, 0), ("selective", 2 * 32 * 64)])
def test_the_hand_cases_fp8_layer_by_hand(recompute, projection_input):
    """TP 2, 64 tokens: QKV 64 x (64 + 96) + 8 less its bf16 input 2 x 64 x 64; the projection 32 x (64 + 64) + 8
    (sdpa keeps its bf16 input as its own output, but under selective recompute); fc1 64 x (64 + 128) + 8 less
    2 x 64 x 64; fc2 128 x (64 + 64) + 8 less its bf16 input 2 x 128 x 64."""
    model, layout = fp8_hand_case()
    by_hand = 10248 - 8192 + 4104 + 12296 - 8192 + 16392 - 16384
    assert fp8_layer_change(model, layout, recompute) == by_hand - projection_input == 10272 - projection_input
    assert layer_activation_bytes(model, layout, recompute, fp8=True) == \
        layer_activation_bytes(model, layout, recompute) + 10272 - projection_input


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("recompute", [None, "selective"])
def test_fp8_layer_activations_equal_a_measured_layer(recipe, recompute):
    """A LLaMA-shaped layer (GQA, SwiGLU, RoPE) in bf16 with FP8 GEMMs, 3 x 64 tokens (blockwise: padded to two
    tiles) on this CPU: what its forward keeps, to the byte."""
    config = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                               gated_linear_unit=True, bias=False, normalization="RMSNorm",
                               position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=torch.bfloat16, fp8_format="e4m3", fp8_recipe=recipe,
                               recompute_granularity=recompute)
    model_parallel_cuda_manual_seed(0)
    hidden = torch.randn(64, 3, 128, dtype=torch.bfloat16, requires_grad=True)
    model = ModelSpec(config, vocab_size=64, make_vocab_size_divisible_by=8, max_position_embeddings=64,
                      seq_length=64, tied_embeddings=True)
    planned = layer_activation_bytes(model, Layout(1, 1, 1, 3, 3), recompute, device="cpu", fp8=True)
    assert saved_bytes_after_forward(TransformerLayer(config), hidden) == planned


def deepspeed_moe_model(recipe="tensorwise", **fields):
    """A LLaMA-shaped model of 2 layers, the second a DeepSpeed-MoE layer of 4 experts (top-1, capacity factor 1.5),
    h 128, SwiGLU FFN 256, bf16, s 64 (recipe None: bf16 GEMMs)."""
    fp8 = dict(fp8_format="e4m3", fp8_recipe=recipe) if recipe else {}
    config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256,
                               gated_linear_unit=True, bias=False, normalization="RMSNorm",
                               position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=torch.bfloat16, num_experts=(4,), moe_router_topk=1,
                               moe_train_capacity_factor=1.5, **fp8, **fields)
    return ModelSpec(config, vocab_size=64, make_vocab_size_divisible_by=8, max_position_embeddings=64,
                     seq_length=64, tied_embeddings=True)


def test_deepspeed_moe_experts_fp8_by_hand():
    """Micro batch 3 x 64 = 192 tokens, C = 192 / 4 x 1.5 = 72 slots per expert. Tensorwise, each expert's fc1
    128 x (72 + 512) + 8 and fc2 256 x (72 + 128) + 8, less the slots' 16-bit inputs and fc2's, 2 x 288 x
    (128 + 256). TP 2: the experts run whole on each rank and reduce no amax (the attention's 3 forward and 1
    backward, 4 bytes each); with expert TP each expert's fc1 and fc2 reduce theirs as the dense MLP's, 4 x (3 + 1)
    more."""
    model, tp2 = deepspeed_moe_model(), Layout(2, 1, 1, 3, 3)
    assert fp8_deepspeed_experts_change(model, Layout(1, 1, 1, 3, 3), 4) == \
        4 * (128 * 584 + 8 + 256 * 200 + 8) - 2 * 288 * 384 == 282_688
    assert comm.fp8_amax_reductions_per_layer(model, tp2, 2) == comm.AmaxReductions(3, 1, 12.0, 4.0)
    sharded = deepspeed_moe_model(moe_expert_tensor_parallel=True)
    assert comm.fp8_amax_reductions_per_layer(sharded, tp2, 2) == comm.AmaxReductions(15, 5, 60.0, 20.0)


def _deepspeed_moe_layers_match_the_planner():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    for recipe in (None, "tensorwise", "rowwise", "blockwise"):
        model = deepspeed_moe_model(recipe)
        model_parallel_cuda_manual_seed(0)
        hidden = torch.randn(64, 3, 128, dtype=torch.bfloat16, requires_grad=True)
        measured = saved_bytes_after_forward(TransformerLayer(model.config, layer_number=2), hidden)
        planned = layer_activation_bytes(model, Layout(1, 1, 1, 3, 3), None, experts=4, device="cpu",
                                         fp8=recipe is not None)
        assert measured == planned, (recipe, measured, planned)


def test_deepspeed_moe_fp8_layer_activations_equal_a_measured_layer():
    """DeepSpeed-MoE's experts are our MLP, so their fc1 and fc2 run in FP8: the MoE layer of deepspeed_moe_model in
    bf16 and with each recipe (blockwise: each expert's 72 slots padded to one tile) keeps what the planner counts, to
    the byte (one gloo rank: DeepSpeed's MoE takes its expert groups from torch.distributed)."""
    run_distributed(_deepspeed_moe_layers_match_the_planner, 1)


def test_amax_all_reduces_by_hand():
    """TP 2, per layer and micro-batch. Tensorwise: forward QKV's and fc1's weights, the projection's and fc2's
    inputs and weights; backward QKV's and fc1's output gradients; 4 bytes, all-reduced as 2 x 1/2 x 4. Rowwise:
    forward QKV's and fc1's W^T rows (h = 64 each), the projection's and fc2's tokens (64) and weight rows (64);
    backward QKV's and fc1's gradient tokens (64): 256 bytes each. Blockwise: none."""
    model, layout = fp8_hand_case()
    assert comm.fp8_amax_reductions_per_layer(model, layout) == comm.AmaxReductions(6, 2, 24.0, 8.0)
    rowwise, _ = fp8_hand_case("rowwise")
    assert comm.fp8_amax_reductions_per_layer(rowwise, layout) == comm.AmaxReductions(6, 2, 1536.0, 512.0)
    blockwise, _ = fp8_hand_case("blockwise")
    assert comm.fp8_amax_reductions_per_layer(blockwise, layout) == comm.AmaxReductions(0, 0, 0.0, 0.0)
    assert comm.fp8_amax_reductions_per_layer(model, dataclasses.replace(layout, tp=1, dp=4)).forward == 0


def test_fp8_tensor_parallel_change_by_hand():
    """Per micro-batch on stage 0 (2 layers): the amaxes (2 x 32 bytes); with SP, less QKV's and fc1's all-gathers of
    their saved input shards (1/2 x 8192 bytes each), which FP8 keeps gathered in FP8; full recompute repeats the
    forward's amaxes."""
    model, layout = fp8_hand_case()
    stage = stage_parameters(model, 2, 2)[0]
    assert comm.fp8_tensor_parallel_change(model, layout, stage) == 64
    sequence_parallel = dataclasses.replace(layout, sequence_parallel=True)
    assert comm.fp8_tensor_parallel_change(model, sequence_parallel, stage) == 64 - 2 * 2 * 4096
    recomputed = dataclasses.replace(layout, recompute="full")
    assert comm.fp8_amax_reductions_per_micro_batch(model, recomputed, stage) == (2 * (6 + 6 + 2), 2 * (48 + 8))
