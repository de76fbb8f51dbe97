"""Megatron-DeepSpeed's spellings of flags megatron_ds already had change no number: the same losses iteration by
iteration as the Megatron-LM spelling (the LLaMA family of tests/support/layouts.py, TP 2)."""
from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON, ITERATIONS, run_layout
from tests.support.megatron_deepspeed_arguments import LAYOUT, MEGATRON_DEEPSPEED_LLAMA


def test_same_losses():
    result = launch(2, COMMON + MEGATRON_DEEPSPEED_LLAMA + LAYOUT)
    assert_succeeded(result, tail=4000)
    observed = losses(result.stdout)
    assert sorted(observed) == list(range(1, ITERATIONS + 1)), result.stdout[-4000:]
    assert observed == run_layout("llama", 2, 1, 1)
