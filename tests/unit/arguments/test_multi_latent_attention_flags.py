"""Multi-latent attention's flags, in Megatron-LM's names and defaults, reach the TransformerConfig; what it cannot
take is refused by name with the values, every problem in one message, before any process group; its sizes are part
of a checkpoint's model (a mismatch named by flag), its projections to the heads split over TP by rows and its down
projections and norms whole; a Hugging Face export of MLA in layers other than DeepSeek-V3's is refused by name."""
import pytest
import torch

from megatron_ds.arguments import ArgumentsError, flag_defaults, parse_args
from megatron_ds.checkpointing import files, layout
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.conversion import convert, huggingface
from tests.support.flags import TINY_MODEL

ROPE = TINY_MODEL + ["--position-embedding-type", "rope"]
MLA = ROPE + ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "8", "--qk-head-dim", "6",
              "--qk-pos-emb-head-dim", "4", "--v-head-dim", "10"]
FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def _mla(argv, world_size=1):
    config = parse_args(argv, world_size=world_size).model
    return {name: getattr(config, name) for name in FIELDS}


def _problems(argv, world_size=1):
    with pytest.raises(ArgumentsError) as raised:
        parse_args(argv, world_size=world_size)
    assert not torch.distributed.is_initialized()
    return raised.value.problems


def test_megatron_lms_defaults_and_the_flags_reach_the_config():
    defaults = flag_defaults()
    assert {name: defaults[name] for name in FIELDS} == {
        "multi_latent_attention": False, "q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128,
        "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
    assert _mla(MLA) == {"multi_latent_attention": True, "q_lora_rank": 16, "kv_lora_rank": 8, "qk_head_dim": 6,
                         "qk_pos_emb_head_dim": 4, "v_head_dim": 10}
    assert parse_args(MLA, world_size=1).model.rotary_dim == 4


def test_ranks_larger_than_the_hidden_size_and_flags_mla_cannot_take_are_refused_together():
    problems = _problems(TINY_MODEL + ["--multi-latent-attention", "--q-lora-rank", "64", "--kv-lora-rank", "33",
                                       "--num-query-groups", "2", "--qk-layernorm", "--add-qkv-bias",
                                       "--qk-pos-emb-head-dim", "5"])
    assert problems == [
        "--q-lora-rank 64 exceeds --hidden-size 32: the latent is a compression of the hidden state",
        "--kv-lora-rank 33 exceeds --hidden-size 32: the latent is a compression of the hidden state",
        "--qk-pos-emb-head-dim 5: RoPE rotates pairs of channels, it must be even",
        "--multi-latent-attention rotates its decoupled key with RoPE: --position-embedding-type learned_absolute is "
        "not rope (add --position-embedding-type rope)",
        "--multi-latent-attention with --num-query-groups 2, --qk-layernorm, --add-qkv-bias: MLA has no key/value "
        "groups, QKV projection or per-head query/key norm, and RoPE rotates qk-pos-emb-head-dim channels whole"], \
        problems


def test_heads_that_do_not_split_over_tp_and_unused_mla_flags_are_named():
    problems = _problems(MLA + ["--num-attention-heads", "6", "--tensor-model-parallel-size", "4"], world_size=4)
    assert "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4" in problems, problems
    assert not any("--hidden-size" in problem for problem in problems), problems  # MLA's heads have their own dims
    assert _problems(ROPE + ["--q-lora-rank", "16", "--v-head-dim", "8"]) == [
        "--q-lora-rank 16, --v-head-dim 8: multi-latent attention's, unused without --multi-latent-attention"]
    assert any("--kv-lora-rank 0 must be positive" in problem for problem in _problems(MLA + ["--kv-lora-rank", "0"]))


def _shape(argv):
    return files.model_shape(vars(parse_args(argv, world_size=1)))


def test_the_sizes_are_part_of_the_checkpoints_model_and_a_mismatch_is_named_by_flag():
    mla, other = _shape(MLA), _shape(MLA[:-2] + ["--v-head-dim", "12"])
    assert mla["multi_latent_attention"] and (mla["q_lora_rank"], mla["v_head_dim"]) == (16, 10)
    assert files.model_family(mla) == "custom"
    assert files.model_shape_differences(mla, other, 1) == ["--v-head-dim: checkpoint 10, flags 12"]
    plain = _shape(ROPE)
    assert not plain["multi_latent_attention"] and plain["v_head_dim"] is None
    assert "--multi-latent-attention: checkpoint True, flags False" in files.model_shape_differences(mla, plain, 1)
    flags = convert.model_flags(mla, {})
    assert "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 6 --qk-pos-emb-head-dim 4 " \
           "--v-head-dim 10" in flags, flags


@pytest.mark.parametrize("name, rule", [
    ("linear_q_proj.weight", (0, 1)), ("linear_q_up_proj.weight", (0, 1)), ("linear_kv_up_proj.weight", (0, 1)),
    ("linear_proj.weight", (1, 1)), ("linear_q_down_proj.weight", None), ("linear_kv_down_proj.weight", None),
    ("q_layernorm.weight", None), ("kv_layernorm.weight", None)])
def test_tp_split_rules_follow_the_heads(name, rule):
    assert layout.partition_rule(f"decoder.layers.3.self_attention.{name}", swiglu=True) == rule


def test_an_export_deepseek_v3_cannot_hold_is_refused_by_name():
    """MLA in GPT-2 style layers (LayerNorm, GeLU, biases): DeepseekV3ForCausalLM's layers are LLaMA's."""
    with pytest.raises(CheckpointError, match="DeepseekV3ForCausalLM cannot hold this model: its layers are LLaMA's"):
        huggingface.to_hf_state(_shape(MLA), {}, {}, 128)
