"""parse_args resolves every implied value once and returns a read-only configuration; the generation and
planning tools derive the same values from the same functions."""
import argparse
import json
import re

import pytest
import torch

from megatron_ds.arguments import (
    ResolvedArguments,
    build_parser,
    flag_defaults,
    parse_args,
    transformer_config_from_args,
)
from megatron_ds.engine.ds_config import build_deepspeed_config
from tests.support.flags import TINY_MODEL


def test_resolved_arguments_are_read_only():
    args = parse_args(TINY_MODEL, world_size=1)
    assert isinstance(args, ResolvedArguments)
    with pytest.raises(AttributeError, match="read-only .*'micro_batch_size'"):
        args.micro_batch_size = 4
    with pytest.raises(AttributeError, match="read-only"):
        del args.seed
    variant = argparse.Namespace(**vars(args))
    variant.micro_batch_size = 4          # a copy is an ordinary namespace
    assert args.micro_batch_size == 1


@pytest.mark.parametrize("flags, expected", [
    ([], dict(ffn_hidden_size=128, max_position_embeddings=16, num_key_value_heads=4, lr_decay_iters=1,
              position_embedding_type="learned_absolute", recompute_granularity=None, padded_vocab_size=128,
              vocab_size=128, eod=127, params_dtype=torch.float32, data_parallel_size=1)),
    (["--hidden-size", "192", "--swiglu", "--num-query-groups", "2"],
     dict(ffn_hidden_size=512, num_key_value_heads=2)),                     # 8h/3 rounded down to 64
    (["--use-rotary-position-embeddings", "--recompute-activations"],
     dict(position_embedding_type="rope", recompute_granularity="selective")),
    (["--train-iters", "100", "--lr-warmup-fraction", "0.1"], dict(lr_decay_iters=100, lr_warmup_iters=10)),
    (["--vocab-size", "130", "--bf16"], dict(padded_vocab_size=256, params_dtype=torch.bfloat16)),
], ids=["defaults", "swiglu-gqa", "aliases", "warmup-fraction", "padding-bf16"])
def test_derived_values(flags, expected):
    args = parse_args(TINY_MODEL + flags, world_size=1)
    assert {name: getattr(args, name) for name in expected} == expected


def test_layout_and_deepspeed_json_values(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16, "bf16": {"enabled": True}}))
    args = parse_args(TINY_MODEL + ["--tensor-model-parallel-size", "2", "--deepspeed_config", str(path)],
                      world_size=8)
    assert (args.data_parallel_size, args.micro_batch_size, args.global_batch_size) == (4, 1, 16)
    assert (args.bf16, args.params_dtype, args.padded_vocab_size) == (True, torch.bfloat16, 256)
    assert args.effective_deepspeed_config == build_deepspeed_config(args)
    assert args.effective_deepspeed_config["gradient_accumulation_steps"] == 4


def test_flag_defaults_are_the_parsers():
    parsed = vars(build_parser().parse_args(TINY_MODEL))
    defaults = flag_defaults()
    assert set(defaults) == set(parsed)
    given = {action.dest for action in build_parser()._actions if set(action.option_strings) & set(TINY_MODEL)}
    assert all(defaults[name] == value for name, value in parsed.items() if name not in given)


def test_generation_rebuilds_the_trained_model_config():
    """tools/generate.py reads a checkpoint's saved arguments back into the same TransformerConfig (without
    dropout), also for a checkpoint saved before some flags existed."""
    from megatron_ds.checkpointing.files import args_to_dict
    from megatron_ds.inference.generation import inference_args
    args = parse_args(TINY_MODEL + ["--swiglu", "--use-rotary-position-embeddings", "--hidden-size", "96",
                                    "--rotary-percent", "0.5", "--recompute-activations"], world_size=1)
    saved = args_to_dict(args)
    for name in ("ffn_hidden_size", "position_embedding_type", "attention_backend"):  # an older checkpoint
        saved.pop(name)
    trained, rebuilt = transformer_config_from_args(args), transformer_config_from_args(inference_args(saved))
    expected = {**vars(trained), "hidden_dropout": 0.0, "attention_dropout": 0.0, "recompute_granularity": None}
    assert vars(rebuilt) == expected and rebuilt.rotary_dim == 12  # half of head dim 96 / 4


def test_planner_resolves_like_pretrain(tmp_path):
    from megatron_ds.planning import plan_cli as cli
    flags = TINY_MODEL + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                          "--global-batch-size", "8", "--swiglu", "--hidden-size", "192"]
    trained = parse_args(flags, world_size=8)
    planned = cli.validated_args(cli.build_plan_parser().parse_args(flags + ["--world-size", "8"]))
    names = ("ffn_hidden_size", "padded_vocab_size", "data_parallel_size", "micro_batch_size", "global_batch_size",
             "zero_stage", "params_dtype", "effective_deepspeed_config")
    assert {name: getattr(planned, name) for name in names} == {name: getattr(trained, name) for name in names}


def test_megatron_deepspeed_flags_that_change_nothing_here_are_accepted_and_say_why():
    """Megatron-DeepSpeed's scripts pass --no-gradient-accumulation-fusion to run without apex."""
    args = parse_args(TINY_MODEL + ["--no-gradient-accumulation-fusion"], world_size=1)
    assert args.gradient_accumulation_fusion is False
    assert parse_args(TINY_MODEL, world_size=1).gradient_accumulation_fusion is True
    help_text = " ".join(re.sub(r"-\n\s+", "-", build_parser().format_help()).split())   # wrapped at hyphens
    assert "--no-gradient-accumulation-fusion accepted for Megatron-DeepSpeed scripts" in help_text
    assert "there is no fused weight-gradient kernel to turn off" in help_text


def test_load_defaults_to_save_so_a_restarted_launch_resumes():
    """Without --load a run looks for its checkpoint in --save (empty there: a first launch starts from scratch);
    --load, when given, is used as it is."""
    from_save = parse_args(TINY_MODEL + ["--save", "/ckpt/run"], world_size=1).checkpointing
    assert (from_save.load, from_save.load_from_save) == ("/ckpt/run", True)
    given = parse_args(TINY_MODEL + ["--save", "/ckpt/run", "--load", "/ckpt/base"], world_size=1).checkpointing
    assert (given.load, given.load_from_save) == ("/ckpt/base", False)
    neither = parse_args(TINY_MODEL, world_size=1).checkpointing
    assert (neither.load, neither.load_from_save) == (None, False)


@pytest.mark.parametrize("flags, world, ulysses, context, comm", [
    (["--context-parallel-size", "4"], 4, 1, 4, "p2p"),
    (["--context-parallel-size", "4", "--cp-comm-type", "all_gather"], 4, 1, 4, "allgather"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a"], 4, 4, 1, "p2p"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"],
     8, 2, 2, "p2p"),
    (["--context-parallel-size", "2", "--ds-sequence-parallel-size", "2"], 8, 2, 2, "p2p"),
], ids=["p2p", "all_gather-spelling", "a2a-is-ulysses", "a2a+p2p", "ulysses-and-ring"])
def test_context_parallel_flags_resolve_to_ulysses_and_the_ring(flags, world, ulysses, context, comm):
    args = parse_args(TINY_MODEL + flags + ["--global-batch-size", "8"], world_size=world)
    assert (args.parallel.ulysses, args.parallel.context, args.model.cp_comm_type) == (ulysses, context, comm)
    assert args.data_parallel_size == world // (ulysses * context)
    # DeepSpeed's data-parallel ranks are SP x CP x DP: each counts its part of a micro-batch as one
    assert args.effective_deepspeed_config["train_batch_size"] == 8 * ulysses * context
