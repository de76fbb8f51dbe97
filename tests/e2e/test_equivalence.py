"""The proof that the engine is right: with fp32, no dropout and one seed, every (tp, pp, dp) layout
trains the same model on the same global batches, so its per-iteration lm loss equals the (1,1,1) run."""
import pytest

from tests.support.layouts import ITERATIONS, LAYOUTS, run_layout


def reference(family):
    return run_layout(family, 1, 1, 1)


# GPT-2 at every layout; LLaMA (its parts: rotary, SwiGLU, GQA, untied embeddings) split by TP, PP and DP
LLAMA_LAYOUTS = [(2, 1, 1), (2, 2, 1), (2, 2, 2)]


@pytest.mark.parametrize("family, layout", [("gpt2", layout) for layout in LAYOUTS] +
                         [("llama", layout) for layout in LLAMA_LAYOUTS],
                         ids=lambda v: "tp{}-pp{}-dp{}".format(*v) if isinstance(v, tuple) else v)
def test_loss_trajectory_matches_single_rank(family, layout):
    expected, observed = reference(family), run_layout(family, *layout)
    assert expected[ITERATIONS] < expected[1], f"the reference run did not learn: {expected}"
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-4), (iteration, observed, expected)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_stages_without_pipeline_match_single_rank(zero_stage):
    """PP = 1 runs the plain DeepSpeed engine with our mpu; ZeRO-2/3 are allowed there and change no loss
    (ZeRO-0: tests/e2e/test_resharding.py)."""
    expected = reference("gpt2")
    observed = run_layout("gpt2", 2, 1, 2, ["--zero-stage", str(zero_stage)])
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-4), (iteration, observed, expected)


def test_bf16_pipeline_tracks_fp32():
    """bf16 with ZeRO-1 in the pipeline (DeepSpeed's BF16_Optimizer, fp32 master weights) follows the fp32 run."""
    expected = reference("llama")
    observed = run_layout("llama", 2, 2, 1, ["--bf16"])
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=2e-2), (iteration, observed, expected)


def test_flash_attention_op_at_tp2_trains_like_sdpa_on_one_rank():
    """--attention-backend flash (the blocked op, GQA's key and value heads unexpanded, split over TP) computes
    the attention sdpa does."""
    expected = reference("llama")
    observed = run_layout("llama", 2, 1, 1, ["--attention-backend", "flash"])
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-4), (iteration, observed, expected)


def test_qwen_attention_at_tp2_with_sequence_parallelism_trains_like_one_rank():
    """Qwen's attention parts (--qk-layernorm: the norms whole on each TP rank, their gradients summed over the
    ranks' heads; --add-qkv-bias: split with the QKV rows) at TP 2 with --sequence-parallel train as one rank."""
    qwen = ["--qk-layernorm", "--add-qkv-bias"]
    expected = run_layout("llama", 1, 1, 1, qwen)
    observed = run_layout("llama", 2, 1, 1, qwen + ["--sequence-parallel"])
    assert expected[ITERATIONS] < expected[1], f"the reference run did not learn: {expected}"
    assert expected != reference("llama"), "the flags changed nothing"
    print("max |TP 2 + SP loss - TP 1 loss|:", max(abs(observed[it] - loss) for it, loss in expected.items()))
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-5, abs=1e-5), (iteration, observed, expected)
