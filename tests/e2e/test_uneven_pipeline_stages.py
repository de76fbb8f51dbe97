"""Uneven pipeline stages (Megatron-LM's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers):
8 layers at PP 4 as 1 + 3 + 3 + 1 train what PP 1 trains (lm loss within 1e-5 at each of 10 iterations, fp32,
dropout 0) under 1F1B and ZB-H1, and at PP 2 with 2 virtual stages under the interleaved schedule; a checkpoint
saved with the uneven split continues with the even one and the reverse, resharded on load, its iterations 6-10
within 1e-5 of the straight run of the saved split (which an in-place resume repeats exactly:
tests/e2e/test_checkpointing.py)."""
import pytest

from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON, ITERATIONS, SCHEDULE_FLAGS, run_layout, run_layout_output

EIGHT_LAYERS = ["--num-layers", "8"]
PP4 = EIGHT_LAYERS + ["--pipeline-model-parallel-size", "4", "--make-vocab-size-divisible-by", "256"]
UNEVEN = ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"]
SAVED_AT = 5


def _assert_close(observed, expected):
    for iteration in observed:
        assert observed[iteration] == pytest.approx(expected[iteration], rel=1e-5, abs=0), (
            iteration, observed, expected)


def _train_and_save(folder, split):
    """The straight 10 iterations at PP 4 with `split`, saving at iteration 5 (and 10): its losses."""
    result = launch(4, COMMON + PP4 + split + ["--save", str(folder), "--save-interval", str(SAVED_AT)])
    assert_succeeded(result, tail=4000)
    observed = losses(result.stdout)
    assert sorted(observed) == list(range(1, ITERATIONS + 1)), result.stdout[-4000:]
    return observed, result.stdout


def _resume(folder, split):
    result = launch(4, COMMON + PP4 + split + ["--load", str(folder), "--load-iteration", str(SAVED_AT)])
    assert_succeeded(result, tail=4000)
    assert f"resuming at iteration {SAVED_AT}" in result.stdout, result.stdout[-4000:]
    observed = losses(result.stdout)
    assert sorted(observed) == list(range(SAVED_AT + 1, ITERATIONS + 1)), result.stdout[-4000:]
    return observed, result.stdout


@pytest.fixture(scope="module")
def saved_uneven(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uneven")
    return (folder, *_train_and_save(folder, UNEVEN))


@pytest.fixture(scope="module")
def saved_even(tmp_path_factory):
    folder = tmp_path_factory.mktemp("even")
    return (folder, *_train_and_save(folder, []))


def test_one_three_three_one_under_1f1b_trains_what_pp1_trains(saved_uneven):
    _, uneven, output = saved_uneven
    assert "transformer layers per model stage: 1 + 3 + 3 + 1 (--decoder-first-pipeline-num-layers 1 " \
           "--decoder-last-pipeline-num-layers 1)" in output, output[-4000:]
    single = run_layout("gpt2", 1, 1, 1, EIGHT_LAYERS)
    assert single[ITERATIONS] < single[1]
    _assert_close(uneven, single)


def test_one_three_three_one_under_zbh1_trains_what_pp1_trains():
    uneven = run_layout("gpt2", 1, 4, 1, EIGHT_LAYERS + UNEVEN + SCHEDULE_FLAGS["zbh1"])
    _assert_close(uneven, run_layout("gpt2", 1, 1, 1, EIGHT_LAYERS))


def test_an_uneven_checkpoint_continues_even(saved_uneven):
    folder, straight, _ = saved_uneven
    observed, output = _resume(folder, [])
    assert "resharded to TP 1 x PP 4)" in output, output[-4000:]
    _assert_close(observed, straight)


def test_an_even_checkpoint_continues_uneven(saved_even):
    folder, straight, _ = saved_even
    observed, output = _resume(folder, UNEVEN)
    assert "resharded to TP 1 x PP 4, --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1)" \
           in output, output[-4000:]
    _assert_close(observed, straight)


def test_interleaved_with_given_end_stages_trains_what_pp1_trains():
    """PP 2 with 2 virtual stages per rank: rank 0 holds 2 layers as 1 + 1, rank 1 holds 6 as 3 + 3 (model stages
    1 + 3 + 1 + 3, Megatron-LM's layer offsets)."""
    flags = EIGHT_LAYERS + SCHEDULE_FLAGS["interleaved"] + ["--decoder-first-pipeline-num-layers", "2",
                                                            "--decoder-last-pipeline-num-layers", "6"]
    output = run_layout_output("gpt2", 1, 2, 1, flags)
    assert "transformer layers per model stage: 1 + 3 + 1 + 3" in output, output[-4000:]
    _assert_close(run_layout("gpt2", 1, 2, 1, flags), run_layout("gpt2", 1, 1, 1, EIGHT_LAYERS))
