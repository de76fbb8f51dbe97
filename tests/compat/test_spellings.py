"""Megatron-DeepSpeed's spellings of flags megatron_ds already had change no number: the same model config, and the
same losses iteration by iteration, as the Megatron-LM spelling (the LLaMA family of tests/layouts.py, TP 2)."""
import pytest

from megatron_ds.arguments import parse_args, transformer_config_from_args
from tests.launch import launch, losses
from tests.layouts import COMMON, FAMILIES, ITERATIONS, run_layout

MEGATRON_DEEPSPEED_LLAMA = [
    "--normalization", "rmsnorm",                            # lower case
    "--use-rotary-position-embeddings", "--rotary-position-embeddings-theta", "10000",  # --rotary-base
    "--use-flash-attn-v2",                                   # our fused attention (SDPA), the default
    "--no-query-key-layer-scaling",                          # fp16-only rescaling; we scale by 1/sqrt(d) once
    "--no-async-tensor-model-parallel-allreduce",            # an overlap switch of Megatron's
    "--data-impl", "mmap", "--optimizer", "adam",            # the only data format; AdamW
    "--num-workers", "0",                                    # the reference reads with the default 2 workers
    "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-key-value-heads", "2"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "128"]


def test_same_model_config():
    spelled = parse_args(COMMON + MEGATRON_DEEPSPEED_LLAMA + LAYOUT, world_size=2)
    reference = parse_args(COMMON + FAMILIES["llama"] + LAYOUT, world_size=2)
    assert transformer_config_from_args(spelled) == transformer_config_from_args(reference)


@pytest.mark.e2e
def test_same_losses():
    result = launch(2, COMMON + MEGATRON_DEEPSPEED_LLAMA + LAYOUT)
    assert result.returncode == 0, result.stdout[-4000:]
    observed = losses(result.stdout)
    assert sorted(observed) == list(range(1, ITERATIONS + 1)), result.stdout[-4000:]
    assert observed == run_layout("llama", 2, 1, 1)
