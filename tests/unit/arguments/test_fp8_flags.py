"""FP8's flags, in Megatron-LM's names (and Megatron-DeepSpeed's spellings of the format), reach the TransformerConfig;
what FP8 is not built with is refused by name with the values, every problem in one message, before any process
group."""
import pytest
import torch

from megatron_ds.arguments import ArgumentsError, build_parser, flag_defaults, parse_args
from tests.support.flags import TINY_MODEL

FIELDS = ("fp8_format", "fp8_recipe", "fp8_margin", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
          "num_layers_at_end_in_bf16")
BF16 = TINY_MODEL + ["--num-layers", "4", "--bf16"]


def _fp8(argv):
    config = parse_args(argv, world_size=1).model
    return {name: getattr(config, name) for name in FIELDS}


def _problems(argv):
    with pytest.raises(ArgumentsError) as raised:
        parse_args(argv, world_size=1)
    assert not torch.distributed.is_initialized()
    return raised.value.problems


def test_megatron_lms_defaults_off_and_delayed_scaling_when_no_recipe_is_given():
    defaults = flag_defaults()
    assert {name: defaults[name] for name in FIELDS} == {
        "fp8_format": None, "fp8_recipe": None, "fp8_margin": 0, "first_last_layers_bf16": False,
        "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1}
    assert _fp8(BF16)["fp8_format"] is None
    assert _fp8(BF16 + ["--fp8-format", "e4m3"]) == {
        "fp8_format": "e4m3", "fp8_recipe": "delayed", "fp8_margin": 0, "first_last_layers_bf16": False,
        "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1}
    assert "default delayed, as in Megatron-LM" in " ".join(build_parser().format_help().split())


def test_the_flags_and_megatron_deepspeeds_spellings_reach_the_config():
    assert _fp8(BF16 + ["--fp8-hybrid", "--fp8-recipe", "blockwise", "--fp8-margin", "2", "--first-last-layers-bf16",
                        "--num-layers-at-end-in-bf16", "2"]) == {
        "fp8_format": "hybrid", "fp8_recipe": "blockwise", "fp8_margin": 2, "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 2}
    assert _fp8(BF16 + ["--fp8-e4m3", "--fp8-format", "e4m3"])["fp8_format"] == "e4m3"
    config = parse_args(BF16 + ["--fp8-format", "e4m3", "--first-last-layers-bf16"], world_size=1).model
    assert [config.fp8_in_layer(number) for number in range(1, 5)] == [False, True, True, False]


def test_delayed_scalings_flags_are_inert_with_fp8_off_as_in_megatron_lm():
    assert _fp8(BF16 + ["--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo",
                        "max"])["fp8_format"] is None


def test_delayed_scaling_takes_megatron_lms_defaults_for_its_history():
    def delayed(extra):
        config = parse_args(BF16 + ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"] + extra, world_size=1).model
        return config.fp8_recipe, config.fp8_amax_history_len, config.fp8_amax_compute_algo

    assert delayed([]) == ("delayed", 1, "most_recent")
    assert delayed(["--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"]) == ("delayed", 1024, "max")


def test_what_fp8_is_not_built_with_is_refused_together():
    problems = _problems(BF16 + ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--fp8-amax-history-len", "1024",
                                 "--fp8-amax-compute-algo", "max", "--fp8-param-gather", "--fp8-margin", "-1",
                                 "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2",
                                 "--num-layers-at-end-in-bf16", "2"])
    assert problems == [
        "--fp8-param-gather: FP8 parameters gathered in FP8 are not built in megatron_ds; drop the flag (the "
        "weights stay bf16 and are quantised at each GEMM)",
        "--fp8-margin -1: must be >= 0 (the amax lands on fp8_max / 2**margin)",
        "--fp8-amax-history-len 1024, --fp8-amax-compute-algo max: delayed scaling's, but this run's --fp8-recipe "
        "is rowwise (scales from each GEMM's own operands); drop the flag, or the --fp8-recipe for delayed (the "
        "default)",
        "--first-last-layers-bf16 with --num-layers-at-start-in-bf16 2 and --num-layers-at-end-in-bf16 2 leaves none "
        "of --num-layers 4 in FP8; drop --first-last-layers-bf16 or --fp8-format"], problems
    assert any(problem.startswith("--fp8-recipe mxfp8 with --fp8-format hybrid: MXFP8")
               for problem in _problems(BF16 + ["--fp8-hybrid", "--fp8-recipe", "mxfp8"]))
    assert _problems(BF16 + ["--fp8-hybrid", "--fp8-amax-history-len", "0", "--num-experts", "4"]) == [
        "--fp8-amax-history-len 0: must be >= 1",
        "--fp8-recipe delayed (the default) with --num-experts 4 of DeepSpeed-MoE (Megatron-DeepSpeed's MoE flags): "
        "an amax history of its experts is not built in megatron_ds; give --fp8-recipe tensorwise, rowwise or "
        "blockwise, or the dropless layer (Megatron-Core's MoE flags)"]
    dropless = parse_args(BF16 + ["--fp8-hybrid", "--num-experts", "4", "--moe-ffn-hidden-size", "64", "--swiglu"],
                          world_size=1)
    assert dropless.model.fp8_recipe == "delayed" and dropless.model.num_moe_experts == 4


def test_two_formats_fp16_and_fp32_are_refused_by_name():
    assert _problems(BF16 + ["--fp8-format", "e4m3", "--fp8-hybrid"]) == [
        "--fp8-format e4m3 and --fp8-hybrid ask for different FP8 formats: give one"]
    assert _problems(TINY_MODEL + ["--fp8-format", "hybrid", "--fp16"]) == [
        "--fp8-format hybrid with --fp16: FP8 training with fp16 activations and loss scaling is not built in "
        "megatron_ds; use --bf16"]
    assert _problems(TINY_MODEL + ["--fp8-e4m3"]) == [
        "--fp8-format e4m3 needs --bf16: FP8 training here keeps bf16 activations and weights (fp32 master weights); "
        "fp32 training with FP8 GEMMs is not built"]


def test_a_device_without_fp8_gemms_is_refused_naming_what_it_lacks(monkeypatch):
    from megatron_ds.arguments import checks
    monkeypatch.setattr(checks, "fp8_support_problems",
                        lambda device, recipe: [f"{device}: torch refuses a {recipe} FP8 GEMM (no kernel)"])
    assert _problems(BF16 + ["--fp8-format", "e4m3"]) == [
        "--fp8-format e4m3: this machine cannot run FP8 GEMMs: cpu: torch refuses a delayed FP8 GEMM (no kernel)"]
