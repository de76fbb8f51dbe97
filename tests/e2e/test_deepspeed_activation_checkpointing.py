"""--deepspeed-activation-checkpointing through the real launcher: DeepSpeed's checkpoint recomputes the layers
and changes no number. fp32: the lm loss of each of 10 iterations equals the run without recompute (rel 1e-5)
at (tp, pp, dp) = (2,1,1), and with --partition-activations --contigious-checkpointing at (2,2,1) (inside
DeepSpeed's pipeline, 2 micro-batches in flight on the first stage), there under 1F1B, interleaved 1F1B, and the
split backwards of ZB-H1 and DualPipeV (DeepSpeed's checkpoint recomputes inside their input-gradient pass, which
asks autograd for the stage input's gradient only); with dropout 0.1 it is identical to our own recompute for
the same seed (the dropout forks DeepSpeed's RNG tracker, seeded as ours)."""
import pytest

from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON, FAMILIES, ITERATIONS, run_layout

DS = ["--checkpoint-activations", "--deepspeed-activation-checkpointing"]
PARTITIONED = DS + ["--partition-activations", "--contigious-checkpointing"]
# the flags tests/e2e/test_sequence_parallel_recompute.py gives our own recompute with dropout (memoized, shared)
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--attention-backend", "local"]
FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"]


def _deepspeed_run(tp, pp, flags):
    """Per-iteration losses of one launch, after checking from its log that DeepSpeed's checkpoint was set up."""
    result = launch(tp * pp, COMMON + FAMILIES["gpt2"] + [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--make-vocab-size-divisible-by", str(256 // tp), *flags])
    assert_succeeded(result, tail=4000)
    partitioned = "--partition-activations" in flags
    assert (f"DeepSpeed activation checkpointing recomputes the layers: partition_activations={partitioned}"
            in result.stdout), result.stdout[-4000:]
    trajectory = losses(result.stdout)
    assert sorted(trajectory) == list(range(1, ITERATIONS + 1)), result.stdout[-4000:]
    return trajectory


@pytest.mark.parametrize("tp, pp, flags", [
    (2, 1, DS), (2, 2, PARTITIONED),
    (2, 2, PARTITIONED + ["--pipeline-schedule", "interleaved", "--num-virtual-stages-per-pipeline-rank", "2"]),
    (2, 2, PARTITIONED + ["--pipeline-schedule", "zbh1"]), (2, 2, PARTITIONED + ["--pipeline-schedule", "dualpipev"]),
], ids=["tp2", "tp2-pp2-partitioned", "tp2-pp2-partitioned-interleaved", "tp2-pp2-partitioned-zbh1",
        "tp2-pp2-partitioned-dualpipev"])
def test_losses_equal_the_run_without_recompute(tp, pp, flags):
    expected, observed = run_layout("gpt2", tp, pp, 1), _deepspeed_run(tp, pp, flags)
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-5), (iteration, observed, expected)


@pytest.mark.parametrize("pp, schedule", [(1, []), (2, ["--pipeline-schedule", "zbh1"])], ids=["tp2", "tp2-pp2-zbh1"])
def test_dropout_is_identical_to_our_recompute(pp, schedule):
    expected = run_layout("gpt2", 2, pp, 1, DROPOUT + FULL_UNIFORM + schedule)
    observed = _deepspeed_run(2, pp, DROPOUT + FULL_UNIFORM + schedule + ["--deepspeed-activation-checkpointing",
                                                                          "--partition-activations"])
    assert observed == expected
