"""Megatron-Core's MoE flags select the dropless layer, with Megatron-Core's defaults; Megatron-DeepSpeed's keep
DeepSpeed-MoE; the two families are not mixed, and what the dropless layer does not build is refused by name."""
import pytest

from megatron_ds.arguments import ArgumentsError, parse_args
from megatron_ds.arguments.flags import moe_layer_freq
from megatron_ds.core.transformer.transformer_config import moe_layer_pattern
from tests.support.flags import TINY_MODEL

LLAMA = TINY_MODEL + ["--swiglu", "--normalization", "RMSNorm", "--num-layers", "4"]


def _args(*flags, world=1):
    return parse_args(LLAMA + list(flags), world_size=world)


def test_a_megatron_core_flag_selects_the_dropless_layer_with_megatron_cores_defaults():
    args = _args("--num-experts", "8", "--moe-grouped-gemm")
    config = args.model
    assert args.dropless_moe and not args.moe
    assert (config.num_moe_experts, config.num_experts, config.moe_router_topk, config.moe_router_score_function,
            config.moe_router_load_balancing_type, config.moe_aux_loss_coeff, config.moe_ffn_hidden_size) == \
        (8, (1,), 2, "softmax", "aux_loss", 0.0, config.ffn_hidden_size)
    assert config.moe_layer_pattern == (1, 1, 1, 1) and args.parallel.expert == 1


def test_megatron_deepspeeds_flags_alone_keep_deepspeed_moe():
    args = _args("--num-experts", "4", "--topk", "2")
    assert args.moe and not args.dropless_moe and args.model.num_moe_experts is None


def test_the_expert_parallel_size_is_the_layouts():
    args = _args("--num-experts", "4", "--expert-model-parallel-size", "2", world=2)
    assert args.parallel.expert == 2 and args.model.moe_expert_parallel_size == 2


@pytest.mark.parametrize("freq, pattern", [("2", (1, 0, 1, 0)), ("[0]+[1]*3", (0, 1, 1, 1)),
                                           ("([1]+[0])*2", (1, 0, 1, 0))])
def test_moe_layer_freq_reads_as_megatron_lm_reads_it(freq, pattern):
    assert moe_layer_pattern(moe_layer_freq(freq), 4) == pattern
    assert _args("--num-experts", "4", "--moe-layer-freq", freq).model.moe_layer_pattern == pattern


def test_a_pattern_is_read_not_run():
    with pytest.raises(ValueError, match="only lists of 0 and 1"):
        moe_layer_freq("[__import__('os')]")


def _errors(*flags, world=1):
    with pytest.raises(ArgumentsError) as raised:
        _args(*flags, world=world)
    return str(raised.value)


def test_the_two_families_are_not_mixed_and_unbuilt_parts_are_refused_together():
    error = _errors("--num-experts", "4", "--moe-router-topk", "2", "--topk", "2", "--moe-expert-capacity-factor",
                    "1.0", "--moe-pad-expert-input-to-capacity", "--expert-tensor-parallel-size", "2")
    assert ("--moe-router-topk, --moe-expert-capacity-factor, --moe-pad-expert-input-to-capacity, "
            "--expert-tensor-parallel-size are Megatron-Core's MoE flags (the dropless layer) and --topk "
            "Megatron-DeepSpeed's (DeepSpeed-MoE)") in error
    assert "--moe-pad-expert-input-to-capacity is not built" in error
    assert ("--expert-tensor-parallel-size 2: the dropless layer splits its experts over 1 rank (whole experts) or "
            "over the TP ranks (--tensor-model-parallel-size 1)") in error


TENSOR_PARALLEL_2 = ("--num-experts", "4", "--moe-grouped-gemm", "--tensor-model-parallel-size", "2",
                     "--sequence-parallel")


def test_experts_split_over_the_tensor_parallel_ranks_reach_the_layout_and_the_layer():
    args = _args(*TENSOR_PARALLEL_2, "--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2",
                 world=4)
    assert args.parallel.expert_tensor_parallel and args.model.moe_expert_tensor_parallel
    assert args.expert_tensor_parallel_size == 2 and args.parallel.expert_data_parallel == 1
    whole = _args(*TENSOR_PARALLEL_2, world=4)
    assert whole.expert_tensor_parallel_size == 1 and not whole.model.moe_expert_tensor_parallel


def test_what_split_experts_do_not_build_is_refused_together():
    error = _errors(*TENSOR_PARALLEL_2, "--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "4",
                    "--moe-token-dispatcher-type", "allgather", "--moe-ffn-hidden-size", "33", world=4)
    assert "--expert-tensor-parallel-size 2 with --moe-token-dispatcher-type allgather" in error
    assert "each expert's FFN size 33 (--moe-ffn-hidden-size) must be divisible by it" in error
    assert ("--expert-model-parallel-size 4 does not divide the 2 ranks of a pipeline stage that share a TP rank"
            in error)


def test_the_dispatcher_and_the_capacity_reach_the_layer_with_megatron_cores_defaults():
    default = _args("--num-experts", "4", "--moe-grouped-gemm").model
    assert (default.moe_token_dispatcher_type, default.moe_expert_capacity_factor, default.moe_token_drop_policy) == \
        ("alltoall", None, "probs")
    config = _args("--num-experts", "4", "--moe-token-dispatcher-type", "allgather", "--moe-expert-capacity-factor",
                   "1.25", "--moe-token-drop-policy", "position").model
    assert (config.moe_token_dispatcher_type, config.moe_expert_capacity_factor, config.moe_token_drop_policy) == \
        ("allgather", 1.25, "position")


def test_a_capacity_factor_must_be_positive():
    assert "--moe-expert-capacity-factor 0.0 must be > 0 (unset: no token dropped)" in _errors(
        "--num-experts", "4", "--moe-expert-capacity-factor", "0")


def test_checkpoints_of_the_layer_need_zero_partitions():
    error = _errors("--num-experts", "4", "--moe-router-topk", "2", "--save", "/tmp/nowhere", "--zero-stage", "0")
    assert ("--save with the dropless MoE layer needs --zero-stage 1 or 2 (its experts' optimizer states are read "
            "per expert from ZeRO's partitions), got --zero-stage 0") in error


def test_the_layer_needs_its_experts_and_gated_experts():
    assert "need --num-experts: one count of experts (> 1), got 1" in _errors("--moe-router-topk", "2")
    error = _error_without_swiglu()
    assert "compute gated activations only: add --swiglu" in error


def _error_without_swiglu():
    with pytest.raises(ArgumentsError) as raised:
        parse_args(TINY_MODEL + ["--num-experts", "4", "--moe-grouped-gemm"], world_size=1)
    return str(raised.value)


def test_each_pipeline_stage_needs_an_moe_layer():
    error = _errors("--num-experts", "4", "--moe-layer-freq", "[0]*2+[1]*2", "--pipeline-model-parallel-size", "2",
                    world=2)
    assert "pipeline stage(s) 0 would hold no MoE layer" in error


def test_a_pattern_without_an_moe_layer_is_refused_with_a_wrong_length_and_a_zero_interval():
    error = _errors("--num-experts", "32", "--moe-layer-freq", "[0]*4")
    assert ("--moe-layer-freq [0]*4 with --num-experts 32: no layer would be an MoE layer; drop --num-experts and "
            "--moe-layer-freq for a dense model") in error
    assert "--moe-layer-freq must give one 0 or 1 per layer (4), got [1, 1, 1]" in _errors(
        "--num-experts", "32", "--moe-layer-freq", "[1]*3")
    assert "--moe-layer-freq must be positive, got 0" in _errors("--num-experts", "32", "--moe-layer-freq", "0")


def test_the_planner_refuses_a_pattern_without_an_moe_layer(capsys):
    from megatron_ds.planning.plan_cli import main
    assert main(LLAMA + ["--num-experts", "32", "--moe-layer-freq", "[0]*4", "--world-size", "8"]) == 2
    assert "no layer would be an MoE layer" in capsys.readouterr().err


def test_tensor_parallel_ranks_without_sequence_parallelism_need_a_sequence_they_divide():
    error = _errors("--num-experts", "4", "--moe-router-topk", "2", "--tensor-model-parallel-size", "4",
                    "--seq-length", "30", world=4)
    assert ("--tensor-model-parallel-size 4 with the dropless MoE layer: each TP rank routes its share of the "
            "sequence, and --seq-length 30 is not divisible by TP 4") in error
