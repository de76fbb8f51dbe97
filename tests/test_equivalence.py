"""The proof that the engine is right: with fp32, no dropout and one seed, every (tp, pp, dp) layout
trains the same model on the same global batches, so its per-iteration lm loss equals the (1,1,1) run."""
import pytest

from tests.launch import launch, losses

ITERATIONS = 10
COMMON = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERATIONS),
          "--lr", "2e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
          "--clip-grad", "1.0", "--weight-decay", "0.1", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--seed", "7", "--mock-data", "--vocab-size", "250", "--log-interval", "1", "--eval-interval", "0"]
FAMILIES = {
    "gpt2": [],
    "llama": ["--normalization", "RMSNorm", "--swiglu", "--use-rotary-position-embeddings",
              "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-key-value-heads", "2"],
}
LAYOUTS = [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 2, 2), (1, 4, 1)]


_runs = {}


def run_layout(family, tp, pp, dp, extra=()):
    """Per-iteration losses of one launch; memoized, so test files that need the same run share it."""
    key = (family, tp, pp, dp, tuple(extra))
    if key not in _runs:
        _runs[key] = _launch_layout(family, tp, pp, dp, extra)
    return _runs[key]


def _launch_layout(family, tp, pp, dp, extra):
    flags = COMMON + FAMILIES[family] + ["--tensor-model-parallel-size", str(tp),
                                         "--pipeline-model-parallel-size", str(pp),
                                         "--make-vocab-size-divisible-by", str(256 // tp), *extra]
    result = launch(tp * pp * dp, flags)
    assert result.returncode == 0, result.stdout[-4000:]
    trajectory = losses(result.stdout)
    assert sorted(trajectory) == list(range(1, ITERATIONS + 1)), result.stdout[-4000:]
    return trajectory


def reference(family):
    return run_layout(family, 1, 1, 1)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}-pp{}-dp{}".format(*l))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_trajectory_matches_single_rank(family, layout):
    expected, observed = reference(family), run_layout(family, *layout)
    assert expected[ITERATIONS] < expected[1], f"the reference run did not learn: {expected}"
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-4), (iteration, observed, expected)


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_zero_stages_without_pipeline_match_single_rank(zero_stage):
    """PP = 1 runs the plain DeepSpeed engine with our mpu; ZeRO-2/3 are allowed there and change no loss."""
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
