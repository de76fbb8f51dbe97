"""Reconciling Megatron flags with the DeepSpeed JSON: parse_args fills args, build_deepspeed_config writes the
effective config."""
import json
from pathlib import Path

import pytest
import torch

from megatron_ds.arguments import ArgumentsError, padded_vocab_size
from megatron_ds.engine.ds_config import build_deepspeed_config
from tests.support.flags import parse_with_deepspeed_json

TEMPLATES = Path(__file__).resolve().parents[3] / "ds_configs"
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 1 --mock-data "
        "--vocab-size 128").split()


@pytest.fixture
def parse(tmp_path):
    """parse(*flags, ds=dict or None, world=N) -> args; ds is written to a JSON file and passed as the config."""
    def parse(*flags, ds=None, world=1):
        return parse_with_deepspeed_json(tmp_path, BASE + list(flags), ds, world)
    return parse


@pytest.fixture
def fake_gpu(monkeypatch):
    """fp16 is refused without CUDA; these tests check only the config it would get."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def assert_subset(expected, actual):
    assert {key: actual.get(key) for key in expected} == expected, actual


@pytest.mark.parametrize("ds, world, expected", [
    ({"train_micro_batch_size_per_gpu": 4}, 2, dict(micro_batch_size=4, global_batch_size=8)),
    ({"train_batch_size": 16}, 2, dict(micro_batch_size=1, global_batch_size=16)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, 2, dict(micro_batch_size=2, global_batch_size=16)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 2,
     dict(micro_batch_size=2, global_batch_size=16)),
    ({"bf16": {"enabled": True}}, 1, dict(bf16=True, fp16=False, params_dtype=torch.bfloat16)),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": False}}, 1, dict(bf16=True, fp16=False)),
    ({"zero_optimization": {"stage": 2}}, 1, dict(zero_stage=2)),
    ({"gradient_clipping": 0.5}, 1, dict(clip_grad=0.5)),
    ({"gradient_clipping": 0.0}, 1, dict(clip_grad=0.0)),  # falsy, yet given: not replaced by the default
], ids=["micro", "global", "micro-from-accumulation", "global-from-accumulation", "bf16", "bf16-fp16-disabled",
        "zero", "clip", "clip-zero"])
def test_json_only_values_fill_args(parse, ds, world, expected):
    args = parse(ds=ds, world=world)
    assert {name: getattr(args, name) for name in expected} == expected


@pytest.mark.parametrize("flags, world, expected", [
    (["--micro-batch-size", "2", "--global-batch-size", "16"], 4,
     {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}),
    (["--micro-batch-size", "2", "--global-batch-size", "16", "--tensor-model-parallel-size", "2",
      "--pipeline-model-parallel-size", "2"], 8,  # data-parallel size 8 / (2 x 2) = 2
     {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}),
    (["--bf16"], 1, {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "fp16": None,
                     "communication_data_type": "fp32"}),
    (["--bf16", "--zero-stage", "2"], 1, {"bf16": {"enabled": True}, "data_types": None,  # fp32 accum: ZeRO-1 only
                                          "communication_data_type": None}),
    (["--zero-stage", "3"], 1, {"zero_optimization": {"stage": 3}}),
    (["--clip-grad", "0.3"], 1, {"gradient_clipping": 0.3}),
], ids=["batch", "batch-3d", "bf16", "bf16-zero2", "zero", "clip"])
def test_flag_only_values_written_into_config(parse, flags, world, expected):
    assert_subset(expected, build_deepspeed_config(parse(*flags, world=world)))


@pytest.mark.parametrize("ds", [None, {}], ids=["no-json", "empty-json"])
def test_defaults(parse, ds):
    args = parse(ds=ds, world=4)
    assert (args.micro_batch_size, args.global_batch_size, args.zero_stage, args.clip_grad) == (1, 4, 1, 1.0)
    assert (args.bf16, args.fp16, args.params_dtype) == (False, False, torch.float32)
    config = build_deepspeed_config(args)
    assert_subset({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "bf16": None, "fp16": None}, config)


def test_agreeing_values_accepted(parse):
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "gradient_clipping": 1}
    args = parse("--global-batch-size", "16", "--micro-batch-size", "2", "--bf16", "--zero-stage", "2",
                 "--clip-grad", "1.0", ds=ds, world=2)
    assert (args.global_batch_size, args.micro_batch_size, args.bf16, args.zero_stage, args.clip_grad) == \
        (16, 2, True, 2, 1.0)
    assert_subset(ds, build_deepspeed_config(args))


def test_conflicts_reported_together(parse):
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}
    with pytest.raises(ArgumentsError) as raised:
        parse("--global-batch-size", "4", "--micro-batch-size", "1", "--fp16", "--zero-stage", "1",
              "--clip-grad", "0.5", ds=ds)
    message = str(raised.value)
    for text in ['--global-batch-size 4 conflicts with "train_batch_size": 8',
                 '--micro-batch-size 1 conflicts with "train_micro_batch_size_per_gpu": 2',
                 "--fp16 conflicts with", "conflicts with \"bf16\": {\"enabled\": true}",
                 '--zero-stage 1 conflicts with "zero_optimization.stage": 3',
                 '--clip-grad 0.5 conflicts with "gradient_clipping": 1.0']:
        assert text in message


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("flags, ds, block", [
    ([], {"fp16": {"enabled": True, "loss_scale_window": 500}},  # the user's block keys win over the flags'
     {"loss_scale": 0, "initial_scale_power": 32, "loss_scale_window": 500}),
    (["--fp16", "--initial-loss-scale", "65536"], None, {"loss_scale": 0, "initial_scale_power": 16,
                                                         "loss_scale_window": 1000, "hysteresis": 2,
                                                         "min_loss_scale": 1.0}),
    (["--fp16", "--loss-scale", "128", "--loss-scale-window", "50", "--hysteresis", "3", "--min-loss-scale", "2"],
     None, {"loss_scale": 128, "initial_scale_power": 32, "loss_scale_window": 50, "hysteresis": 3,
            "min_loss_scale": 2.0}),
], ids=["json", "flag-dynamic", "flag-static"])
def test_fp16_config(parse, flags, ds, block):
    args = parse(*flags, ds=ds)
    assert (args.fp16, args.bf16, args.params_dtype) == (True, False, torch.float16)
    config = build_deepspeed_config(args)
    assert_subset({"enabled": True, **block}, config["fp16"])
    assert "bf16" not in config


def test_fp16_refused_without_gpu_or_a_cpu_with_fp16(parse, monkeypatch):
    """The machine's answers replaced: this host's CPU has oneDNN's fp16, a CI machine's may not."""
    from deepspeed.accelerator import get_accelerator
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)
    with pytest.raises(ArgumentsError, match="--fp16 needs a GPU, or a CPU whose oneDNN computes in fp16"):
        parse("--fp16")


def test_unmanaged_json_keys_preserved(parse):
    ds = {"wall_clock_breakdown": True, "zero_optimization": {"stage": 1, "reduce_bucket_size": 123},
          "bf16": {"enabled": True, "immediate_grad_update": False}, "data_types": {"grad_accum_dtype": "bf16"},
          "activation_checkpointing": {"partition_activations": False}}  # an option set true needs the flag
    args = parse("--micro-batch-size", "2", ds=ds)
    config = build_deepspeed_config(args)
    assert config["wall_clock_breakdown"] is True
    assert config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 123}
    assert config["bf16"] == {"enabled": True, "immediate_grad_update": False}
    assert config["data_types"] == {"grad_accum_dtype": "bf16"}  # not replaced by the fp32 default
    assert "communication_data_type" not in config  # fp32 reduction goes with fp32 accumulation only
    assert config["activation_checkpointing"] == {"partition_activations": False}
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert args.user_deepspeed_config == ds  # building the effective config does not touch the user's JSON


def test_flag_stage_merged_into_json_zero_block(parse):
    config = build_deepspeed_config(parse("--zero-stage", "2", ds={"zero_optimization": {"overlap_comm": True}}))
    assert config["zero_optimization"] == {"overlap_comm": True, "stage": 2}


@pytest.mark.parametrize("name, world, micro, global_batch", [
    ("cpu_demo", 2, 4, 32), ("zero1_bf16", 8, 1, 8), ("mtnlg_530b", 8, 1, 1920), ("zero3_no_pipeline", 4, 2, 8),
])
def test_shipped_templates_reconcile(parse, name, world, micro, global_batch):
    """Every template parses, and its values survive unchanged into the effective config."""
    template = json.loads((TEMPLATES / f"{name}.json").read_text())
    args = parse(ds=template, world=world)
    assert (args.micro_batch_size, args.global_batch_size) == (micro, global_batch)
    assert_subset(template, build_deepspeed_config(args))


@pytest.mark.parametrize("vocab, divisible_by, tp, expected", [
    (1000, 128, 2, 1024), (1000, 128, 4, 1024), (1025, 128, 1, 1152), (128, 128, 1, 128),
    (1100, 128, 4, 1536), (1001, 1, 2, 1002),  # the multiple is divisible-by x TP, not divisible-by alone
])
def test_padded_vocab_size(parse, vocab, divisible_by, tp, expected):
    args = parse("--vocab-size", str(vocab), "--make-vocab-size-divisible-by", str(divisible_by),
                 "--tensor-model-parallel-size", str(tp), world=tp)
    assert args.padded_vocab_size == padded_vocab_size(vocab, divisible_by, tp) == expected


@pytest.mark.usefixtures("fake_gpu")
def test_non_positive_initial_loss_scale_rejected(parse):
    with pytest.raises(ArgumentsError, match="--initial-loss-scale"):
        build_deepspeed_config(parse("--fp16", "--initial-loss-scale", "0"))


@pytest.mark.parametrize("ds", [{"train_batch_size": "auto"}, {"bf16": True}, {"zero_optimization": None},
                                {"train_batch_size": 8, "gradient_accumulation_steps": 0}],
                         ids=["string-batch", "bool-block", "null-block", "zero-accumulation"])
def test_bad_json_values_rejected(parse, ds):
    with pytest.raises(ArgumentsError):
        parse(ds=ds)


def test_user_communication_dtype_kept(parse):
    config = build_deepspeed_config(parse("--bf16", ds={"communication_data_type": "bf16"}))
    assert config["communication_data_type"] == "bf16" and config["data_types"] == {"grad_accum_dtype": "fp32"}


def test_universal_checkpoint_turns_on_deepspeeds_universal_loading_only_for_a_universal_folder(parse, tmp_path):
    """--universal-checkpoint with ds_to_universal's pointer in --load sets checkpoint.load_universal; without
    the pointer our own checkpoints load as always (nothing set)."""
    load = tmp_path / "checkpoints"
    load.mkdir()
    assert "checkpoint" not in parse("--universal-checkpoint", "--load", str(load)).effective_deepspeed_config
    (load / "latest_universal").write_text("global_step5_universal")
    args = parse("--universal-checkpoint", "--load", str(load))
    assert args.load_universal_checkpoint
    assert args.effective_deepspeed_config["checkpoint"] == {"load_universal": True}
    assert "checkpoint" not in parse("--load", str(load)).effective_deepspeed_config


def test_universal_loading_problems_named_before_start(parse, tmp_path):
    """DeepSpeed loads a universal folder into its ZeRO optimizer only; a JSON asking for universal loading
    needs the pointer."""
    load = tmp_path / "checkpoints"
    load.mkdir()
    with pytest.raises(ArgumentsError, match="load_universal\": true in .* has no latest_universal"):
        parse("--load", str(load), ds={"checkpoint": {"load_universal": True}})
    (load / "latest_universal").write_text("global_step5_universal")
    with pytest.raises(ArgumentsError, match="--universal-checkpoint: .* --zero-stage is 0, use 1 or 2"):
        parse("--universal-checkpoint", "--load", str(load), "--zero-stage", "0")


def test_unknown_deepspeed_keys_named_with_the_closest_known_one(parse):
    """DeepSpeed ignores an unknown top-level key: a misspelt zero_optimization would leave ZeRO off."""
    with pytest.raises(ArgumentsError) as error:
        parse(ds={"zero_optimisation": {"stage": 1}, "trian_batch_size": 8,
                  "zero_optimization": {"stage": 1, "reduce_bucket_sise": 5}})
    message = str(error.value)
    assert 'unknown DeepSpeed key "zero_optimisation" (did you mean "zero_optimization"?)' in message
    assert 'unknown DeepSpeed key "trian_batch_size" (did you mean "train_batch_size"?)' in message
    assert 'unknown DeepSpeed key "zero_optimization.reduce_bucket_sise" (did you mean "reduce_bucket_size"?)' \
        in message


def test_a_newer_checkpoint_of_our_own_wins_over_the_universal_one(parse, tmp_path):
    """A run resumed from global_step5_universal and saved at 8: restarting with the same flags (or the JSON's
    load_universal) goes on from global_step8, not back to the conversion."""
    load = tmp_path / "checkpoints"
    load.mkdir()
    (load / "latest_universal").write_text("global_step5_universal")
    (load / "latest").write_text("global_step8")
    args = parse("--universal-checkpoint", "--load", str(load))
    assert not args.load_universal_checkpoint and "checkpoint" not in args.effective_deepspeed_config
    args = parse("--load", str(load), ds={"checkpoint": {"load_universal": True}})
    assert args.effective_deepspeed_config["checkpoint"] == {"load_universal": False}
