"""RoPE scaling's flags, in Megatron's names and defaults (--rope-type, --rotary-scaling-factor, --beta-fast,
--beta-slow, --mscale, --mscale-all-dim, --original-max-position-embeddings; --use-rope-scaling,
--rope-scaling-factor) and Megatron-LM's GPT spellings (--position-embedding-type yarn, --yarn-*), reach the
TransformerConfig; what cannot run is refused by name, every problem in one message, before any process group."""
import pytest
import torch

from megatron_ds.arguments import ArgumentsError, parse_args
from tests.support.flags import TINY_MODEL

ROPE = TINY_MODEL + ["--use-rotary-position-embeddings"]
DEEPSEEK_V3 = ["--rope-type", "yarn", "--rotary-scaling-factor", "40", "--original-max-position-embeddings", "4096",
               "--beta-fast", "32", "--beta-slow", "1", "--mscale", "1", "--mscale-all-dim", "1"]
SCALING_FIELDS = ("rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                  "mscale", "mscale_all_dim", "use_rope_scaling", "rope_scaling_factor")


def _scaling(*flags, base=ROPE):
    config = parse_args(base + list(flags), world_size=1).model
    return {name: getattr(config, name) for name in SCALING_FIELDS}


def test_megatrons_defaults_are_plain_rope():
    assert _scaling() == {"rope_type": "rope", "rotary_scaling_factor": 1.0, "original_max_position_embeddings": None,
                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                          "use_rope_scaling": False, "rope_scaling_factor": 8.0}


def test_deepseek_v3s_yarn_and_llama31s_scaling_reach_the_config():
    assert _scaling(*DEEPSEEK_V3) == {**_scaling(), "rope_type": "yarn", "rotary_scaling_factor": 40.0,
                                      "original_max_position_embeddings": 4096, "mscale_all_dim": 1.0}
    assert _scaling("--use-rope-scaling") == {**_scaling(), "use_rope_scaling": True}
    assert _scaling("--use-rope-scaling", "--rope-scaling-factor", "32")["rope_scaling_factor"] == 32.0


def test_megatron_lms_gpt_spelling_of_yarn_is_the_same_config():
    spelt = _scaling("--position-embedding-type", "yarn", "--rotary-scaling-factor", "40",
                     "--yarn-original-max-position-embeddings", "4096", "--yarn-beta-fast", "32", "--yarn-beta-slow",
                     "1", "--mscale", "1", "--mscale-all-dim", "1", base=TINY_MODEL)
    assert spelt == _scaling(*DEEPSEEK_V3)
    args = parse_args(TINY_MODEL + ["--position-embedding-type", "yarn", "--original-max-position-embeddings", "8"],
                      world_size=1)
    assert (args.position_embedding_type, args.rope_type, args.model.position_embedding_type) == \
        ("rope", "yarn", "rope")


def _problems(*flags, base=ROPE):
    with pytest.raises(ArgumentsError) as raised:
        parse_args(base + list(flags), world_size=1)
    assert not torch.distributed.is_initialized()
    return raised.value.problems


def test_bad_yarn_is_refused_by_name_all_problems_at_once():
    problems = _problems("--rope-type", "yarn", "--rotary-scaling-factor", "0", "--beta-fast", "1", "--beta-slow", "2")
    assert problems == [
        "--rope-type yarn needs --original-max-position-embeddings: the context the model was trained at before YaRN "
        "extends it (DeepSeek-V3: 4096)",
        "--rotary-scaling-factor 0: YaRN's factor must be > 0",
        "--beta-fast 1, --beta-slow 2: YaRN needs 0 < beta-slow < beta-fast (its ramp runs from the frequencies "
        "that turn beta-fast times over the original context to those that turn beta-slow times)"]


def test_scaling_without_rotary_embeddings_or_both_scalings_are_refused():
    problems = _problems("--rope-type", "yarn", "--original-max-position-embeddings", "8", "--use-rope-scaling",
                         "--rope-scaling-factor", "-1", base=TINY_MODEL)
    assert problems == [
        "--rope-type yarn and --use-rope-scaling: RoPE scaling, and the model has --position-embedding-type "
        "learned_absolute: add --use-rotary-position-embeddings (or --position-embedding-type rope)",
        "--rope-type yarn and --use-rope-scaling are two RoPE scalings (YaRN's, LLaMA-3.1's): give one",
        "--rope-scaling-factor -1 must be > 0"]


def test_scaling_values_without_their_switch_are_refused():
    assert _problems("--rotary-scaling-factor", "40", "--mscale-all-dim", "1", "--original-max-position-embeddings",
                     "4096", "--rope-scaling-factor", "16") == [
        "--rotary-scaling-factor 40, --original-max-position-embeddings 4096, --mscale-all-dim 1: YaRN, unused "
        "without --rope-type yarn",
        "--rope-scaling-factor 16: LLaMA-3.1's RoPE scaling, unused without --use-rope-scaling"]


def test_contradicting_spellings_and_a_non_positive_original_context_are_refused():
    assert _problems("--position-embedding-type", "yarn", "--rope-type", "rope", base=TINY_MODEL) == [
        "--position-embedding-type yarn (Megatron-LM's RoPE with YaRN) contradicts --rope-type rope: give one"]
    assert _problems("--rope-type", "yarn", "--original-max-position-embeddings", "0") == [
        "--original-max-position-embeddings must be positive, got 0"]
