"""Multi-latent attention through pretrain.py (fp32, dropout 0, 10 iterations, YaRN, a query latent, a value head
dim of its own): TP 2 with Megatron's --sequence-parallel and selective recompute, PP 2 under 1F1B and under
DualPipeV, and Ulysses 2 with full recompute train the single-rank model, the lm loss within 1e-5; a checkpoint
saved at TP 2 continues at TP 1 as the TP 2 run did."""
import pytest

from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON, FAMILIES, ITERATIONS, SCHEDULE_FLAGS, run_layout

SAVE_INTERVAL = 5


def _assert_close(observed, expected, iterations=range(1, ITERATIONS + 1)):
    assert sorted(observed) == list(iterations), observed
    for iteration in iterations:
        assert observed[iteration] == pytest.approx(expected[iteration], rel=1e-5, abs=1e-5), \
            (iteration, observed, expected)


@pytest.fixture(scope="module")
def tp2_save(tmp_path_factory):
    return tmp_path_factory.mktemp("mla") / "tp2"


def _tp2_flags(save):
    return ["--sequence-parallel", "--recompute-granularity", "selective", "--save", str(save),
            "--save-interval", str(SAVE_INTERVAL)]


@pytest.mark.parametrize("layout, extra", [
    ((1, 2, 1), SCHEDULE_FLAGS["1f1b"]),
    ((1, 2, 1), SCHEDULE_FLAGS["dualpipev"]),
    ((1, 1, 2), ["--ds-sequence-parallel-size", "2", "--recompute-granularity", "full"]),
], ids=["pp2-1f1b", "pp2-dualpipev", "ulysses2-full-recompute"])
def test_layouts_train_the_single_rank_model(layout, extra):
    expected = run_layout("mla", 1, 1, 1)
    assert expected[ITERATIONS] < expected[1], f"the reference run did not learn: {expected}"
    _assert_close(run_layout("mla", *layout, extra), expected)


def test_tp2_with_sequence_parallelism_trains_the_single_rank_model_and_its_checkpoint_continues_at_tp1(tp2_save):
    expected = run_layout("mla", 1, 1, 1)
    observed = run_layout("mla", 2, 1, 1, _tp2_flags(tp2_save))
    _assert_close(observed, expected)
    flags = COMMON + FAMILIES["mla"] + ["--make-vocab-size-divisible-by", "256", "--load", str(tp2_save),
                                        "--load-iteration", str(SAVE_INTERVAL)]
    result = launch(1, flags)
    assert_succeeded(result, tail=4000)
    assert f"resuming at iteration {SAVE_INTERVAL}" in result.stdout and "resharded to TP 1 x PP 1" in result.stdout, \
        result.stdout[-3000:]
    _assert_close(losses(result.stdout), observed, range(SAVE_INTERVAL + 1, ITERATIONS + 1))
