"""Megatron-DeepSpeed's spellings of flags megatron_ds already had change no number: the same model config as the
Megatron-LM spelling (the LLaMA family of tests/support/layouts.py, TP 2). The same losses:
tests/e2e/compat/test_spellings.py."""
from megatron_ds.arguments import parse_args, transformer_config_from_args
from tests.support.layouts import COMMON, FAMILIES
from tests.support.megatron_deepspeed_arguments import LAYOUT, MEGATRON_DEEPSPEED_LLAMA


def test_same_model_config():
    spelled = parse_args(COMMON + MEGATRON_DEEPSPEED_LLAMA + LAYOUT, world_size=2)
    reference = parse_args(COMMON + FAMILIES["llama"] + LAYOUT, world_size=2)
    assert transformer_config_from_args(spelled) == transformer_config_from_args(reference)
