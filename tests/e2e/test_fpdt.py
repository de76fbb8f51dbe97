"""DeepSpeed's FPDT attention (--ds-sequence-parallel-fpdt: Ulysses over chunks of
--ds-sequence-parallel-fpdt-chunk-size tokens, deepspeed.sequence.fpdt_layer.FPDT_Attention) through pretrain.py on
real ranks, its flash-attn calls served by torch's kernels here: each Ulysses rank holds pieces r, r + SP, ... of the
sequence, so that every chunk gathers in order. Over 10 iterations (fp32, dropout 0) the lm loss is within 1e-4 of
the same model without FPDT: a LLaMA (RoPE, 2 key/value heads) at SP 2 in 2 chunks, with full recompute, and at
TP 2 x SP 2 (4 key/value heads); a GPT-2 (biases, learned positions) at SP 2 in 4 chunks."""
import pytest

from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON, FAMILIES, ITERATIONS

FAMILY_FLAGS = {"gpt2": FAMILIES["gpt2"], "llama": FAMILIES["llama"],
                "llama-4kv": FAMILIES["llama"][:-2] + ["--num-key-value-heads", "4"]}
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
_runs = {}


def _run(ranks, family, *flags):
    key = (ranks, family, flags)
    if key not in _runs:
        result = launch(ranks, COMMON + FAMILY_FLAGS[family] + ["--make-vocab-size-divisible-by", "128", *flags])
        assert_succeeded(result, tail=4000)
        _runs[key] = losses(result.stdout)
    return _runs[key]


def _fpdt(chunk_size):
    return ("--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-chunk-size", str(chunk_size))


@pytest.mark.parametrize("family, ranks, layout, chunk_size, extra", [
    ("llama", 2, ("--ds-sequence-parallel-size", "2"), 16, ()),
    ("llama", 2, ("--ds-sequence-parallel-size", "2"), 16, tuple(FULL_RECOMPUTE)),
    ("llama-4kv", 4, ("--ds-sequence-parallel-size", "2", "--tensor-model-parallel-size", "2"), 16, ()),
    ("gpt2", 2, ("--ds-sequence-parallel-size", "2"), 8, ()),
], ids=["llama-sp2", "llama-sp2-full-recompute", "llama-tp2-sp2", "gpt2-sp2-4-chunks"])
def test_fpdt_trains_the_model_ulysses_trains(family, ranks, layout, chunk_size, extra):
    tensor = layout[layout.index("--tensor-model-parallel-size") + 1] if "--tensor-model-parallel-size" in layout \
        else "1"
    expected = _run(int(tensor), family, "--tensor-model-parallel-size", tensor)
    observed = _run(ranks, family, *layout, *_fpdt(chunk_size), *extra)
    assert sorted(observed) == list(range(1, ITERATIONS + 1)), observed
    assert expected[ITERATIONS] < expected[1], expected
    for iteration in expected:
        assert observed[iteration] == pytest.approx(expected[iteration], rel=1e-4), (iteration, observed, expected)
