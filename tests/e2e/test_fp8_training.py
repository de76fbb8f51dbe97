"""FP8 training through pretrain.py (--fp8-format, docs/fp8.md): on a model of hidden size 256 (TP 2 shards of whole
128-wide blockwise tiles), TP 2 with --sequence-parallel trains as TP 1 does under each recipe, FP8 follows bf16
closely but not exactly (the GEMMs really are FP8), and ZB-H1's deferred weight gradients take the FP8 GEMMs too;
delayed scaling (scales from earlier steps, moved once per step) keeps ZB-H1 bitwise with 1F1B, DP 2 with one rank."""
import pytest

from megatron_ds.core.tensor_parallel.fp8 import RECIPES
from tests.support.layouts import ITERATIONS, SCHEDULE_FLAGS, run_layout

MODEL = ["--hidden-size", "256", "--bf16"]
# bf16's own TP 2 + SP differs from TP 1 by rounding the row-parallel partial sums to bf16 (3.4e-4 relative at most
# here); FP8 quantises the same bytes on both layouts (tests/unit/core/tensor_parallel/test_fp8_layers.py) but
# turns those bf16 differences into whole FP8 steps where they cross a rounding boundary (1.3e-3 - 1.7e-3 here)
TP_TOLERANCE = 5e-3
# FP8 against bf16 per iteration: the GEMMs' relative error (E4M3: <= 0.051, docs/fp8.md) moves the loss by a few
# 1e-3 over 10 iterations here; a deterministic bf16 run equals itself exactly, so any difference is the FP8 GEMMs'
BF16_TOLERANCE, FP8_AT_LEAST = 2e-2, 5e-4


def _fp8(recipe, fmt="e4m3"):
    return [*MODEL, "--fp8-format", fmt, "--fp8-recipe", recipe]


def _max_relative_difference(observed, expected):
    return max(abs(observed[it] - loss) / abs(loss) for it, loss in expected.items())


@pytest.mark.parametrize("recipe", RECIPES)
def test_tp2_with_sequence_parallelism_trains_as_tp1_under_fp8(recipe):
    tp1 = run_layout("gpt2", 1, 1, 1, _fp8(recipe))
    tp2 = run_layout("gpt2", 2, 1, 1, _fp8(recipe) + ["--sequence-parallel"])
    bf16_tp1 = run_layout("gpt2", 1, 1, 1, MODEL)
    bf16_tp2 = run_layout("gpt2", 2, 1, 1, MODEL + ["--sequence-parallel"])
    print(f"{recipe}: max relative |TP 2 + SP - TP 1| FP8 {_max_relative_difference(tp2, tp1):.2e}, bf16 "
          f"{_max_relative_difference(bf16_tp2, bf16_tp1):.2e}")
    assert tp1[ITERATIONS] < tp1[1], f"the FP8 run did not learn: {tp1}"
    for iteration, loss in tp1.items():
        assert tp2[iteration] == pytest.approx(loss, rel=TP_TOLERANCE), (recipe, iteration, tp2, tp1)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_follows_bf16_closely_but_computes_in_fp8(recipe):
    fp8, bf16 = run_layout("gpt2", 1, 1, 1, _fp8(recipe)), run_layout("gpt2", 1, 1, 1, MODEL)
    rounded = {name: [round(losses[it], 4) for it in sorted(losses)] for name, losses in (("FP8", fp8), ("bf16", bf16))}
    print(f"{recipe}: {rounded}, max relative difference {_max_relative_difference(fp8, bf16):.2e}")
    assert _max_relative_difference(fp8, bf16) > FP8_AT_LEAST, "FP8 trained as bf16 does: no GEMM ran in FP8"
    for iteration, loss in bf16.items():
        assert fp8[iteration] == pytest.approx(loss, rel=BF16_TOLERANCE), (recipe, iteration, fp8, bf16)


@pytest.mark.parametrize("schedule", ["zbh1", "dualpipev", "interleaved"])
def test_every_pipeline_schedule_trains_as_1f1b_under_fp8(schedule):
    """ZB-H1 splits the backward by the autograd graph: the FP8 linear's node gives the input gradient in B and
    its weight gradient in W, from the same saved FP8 copies, so its update is 1F1B's bitwise. DualPipeV (whose
    zero-bubble steps split the backward the same way) and the interleaved schedule place the layers otherwise
    (stage 0 holds the first and last layers, or every other one), which reorders bf16's sums: bf16's own runs
    differ from 1F1B by 1.4e-4 (DualPipeV) and 1.7e-4 (interleaved) here, FP8's by 1.2e-4; held to the TP test's
    tolerance."""
    flags = _fp8("rowwise", "hybrid")
    one_f_one_b = run_layout("gpt2", 1, 2, 1, flags)
    other = run_layout("gpt2", 1, 2, 1, flags + SCHEDULE_FLAGS[schedule])
    print(f"{schedule}: max relative difference from 1F1B under FP8 {_max_relative_difference(other, one_f_one_b):.2e}")
    assert other[ITERATIONS] < other[1], f"the FP8 run did not learn: {other}"
    tolerance = 0 if schedule == "zbh1" else TP_TOLERANCE
    for iteration, loss in one_f_one_b.items():
        assert other[iteration] == pytest.approx(loss, rel=tolerance, abs=0), (iteration, other, one_f_one_b)


def test_delayed_scaling_under_zbh1_equals_1f1b_bitwise_and_dp2_trains_as_one_rank():
    """Delayed scaling's scales move once per step, from the amaxes of the whole global batch (reduced over the stage's
    ranks): ZB-H1's deferred weight gradients (the gradient's amax seen again) give 1F1B's losses bitwise, and DP 2
    holds one rank's within the TP test's tolerance (its bf16 sums split otherwise)."""
    flags = _fp8("delayed", "hybrid")
    one_f_one_b = run_layout("gpt2", 1, 2, 1, flags)
    assert run_layout("gpt2", 1, 2, 1, flags + SCHEDULE_FLAGS["zbh1"]) == one_f_one_b
    one_rank, two_ranks = run_layout("gpt2", 1, 1, 1, flags), run_layout("gpt2", 1, 1, 2, flags)
    for iteration, loss in one_rank.items():
        assert two_ranks[iteration] == pytest.approx(loss, rel=TP_TOLERANCE), (iteration, two_ranks, one_rank)


@pytest.mark.parametrize("recipe", ["rowwise", "delayed"])
def test_dropless_moe_trains_with_fp8_experts_at_expert_parallel_2(recipe):
    """The dropless layer's experts (w1, w3, w2 through fp8_grouped_linear, each expert's own scales; delayed: a row
    of the layer's history per expert and GEMM, reduced over the stage) at EP 2 with the alltoall dispatcher, against
    the same model in bf16; delayed scaling at EP 2 trains as at EP 1 (the same scales wherever an expert runs)."""
    moe = ["--swiglu", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
           "--moe-aux-loss-coeff", "0.01", "--moe-grouped-gemm"]
    fp8 = run_layout("gpt2", 1, 1, 2, _fp8(recipe) + moe + ["--expert-model-parallel-size", "2"])
    bf16 = run_layout("gpt2", 1, 1, 2, MODEL + moe + ["--expert-model-parallel-size", "2"])
    print(f"dropless MoE, {recipe}: max relative difference FP8 vs bf16 {_max_relative_difference(fp8, bf16):.2e}")
    assert fp8[ITERATIONS] < fp8[1], f"the FP8 MoE did not learn: {fp8}"
    assert FP8_AT_LEAST < _max_relative_difference(fp8, bf16) < BF16_TOLERANCE, (fp8, bf16)
    if recipe == "delayed":
        one_expert_rank = run_layout("gpt2", 1, 1, 2, _fp8(recipe) + moe)
        for iteration, loss in one_expert_rank.items():
            assert fp8[iteration] == pytest.approx(loss, rel=TP_TOLERANCE), (iteration, fp8, one_expert_rank)


def test_deepspeed_moe_trains_with_fp8_experts_split_over_tensor_parallel_ranks():
    """Megatron-DeepSpeed's MoE (DeepSpeed-MoE's gate and dispatch) at TP 2 with --enable-expert-tensor-parallelism:
    each expert is our column- and row-parallel MLP, so its GEMMs run in FP8 with the amaxes reduced over TP (the
    recipe holding the TP group is shared, not copied, when DeepSpeed copies the expert), against bf16."""
    moe = ["--num-experts", "4", "--expert-interval", "2", "--topk", "2", "--moe-expert-parallel-size", "2",
           "--enable-expert-tensor-parallelism", "--disable-moe-token-dropping"]
    fp8 = run_layout("gpt2", 2, 1, 2, _fp8("tensorwise") + moe)
    bf16 = run_layout("gpt2", 2, 1, 2, MODEL + moe)
    print(f"DeepSpeed-MoE: max relative difference FP8 vs bf16 {_max_relative_difference(fp8, bf16):.2e}")
    assert fp8[ITERATIONS] < fp8[1], f"the FP8 MoE did not learn: {fp8}"
    assert FP8_AT_LEAST < _max_relative_difference(fp8, bf16) < BF16_TOLERANCE, (fp8, bf16)


@pytest.mark.parametrize("sequence_split", [["--ds-sequence-parallel-size", "2"], ["--context-parallel-size", "2"]],
                         ids=["ulysses2", "cp2"])
def test_rowwise_fp8_trains_as_one_rank_when_ulysses_or_cp_split_the_sequence(sequence_split):
    """Rowwise scales are per token (and per weight row), so a rank holding part of the sequence quantises its
    tokens as one rank does; what differs is bf16's rounding upstream, within the TP test's tolerance."""
    whole = run_layout("gpt2", 1, 1, 1, _fp8("rowwise"))
    split = run_layout("gpt2", 1, 1, 2, _fp8("rowwise") + sequence_split)
    for iteration, loss in whole.items():
        assert split[iteration] == pytest.approx(loss, rel=TP_TOLERANCE), (iteration, split, whole)


def test_full_recompute_replays_the_fp8_gemms_bitwise_with_dropout():
    """The FP8 quantisation is a function of the operands alone, so recomputing a layer gives its bytes again."""
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--attention-backend", "flash"]
    straight = run_layout("gpt2", 1, 1, 1, _fp8("blockwise") + dropout)
    recomputed = run_layout("gpt2", 1, 1, 1, _fp8("blockwise") + dropout + [
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    assert recomputed == straight
