"""--rampup-batch-size START INCREMENT SAMPLES: the global batch grows as Megatron's does, consumed
samples advance by each iteration's batch, and the data position stays exact across the ramp (a
data-parallel layout reads the same samples as a single rank)."""
import re

import pytest

from megatron_ds.core.batch_schedule import RampupBatchSize, rampup_errors
from tests.launch import launch, losses


def _ramp(schedule, iterations):
    consumed, sizes = 0, []
    for _ in range(iterations):
        sizes.append(schedule.global_batch_size(consumed))
        consumed += sizes[-1]
    return sizes


def test_batch_grows_by_increment_over_the_ramp_samples():
    schedule = RampupBatchSize(start=4, increment=4, ramp_samples=24, global_batch_size=16, micro_batch_size=2,
                               data_parallel_size=2)
    # 3 increments over 24 samples: one every 8 consumed samples
    assert _ramp(schedule, 8) == [4, 4, 8, 12, 16, 16, 16, 16]


def test_mtnlg_ramp_reaches_1920():
    schedule = RampupBatchSize(32, 32, 250_000_000 // 2048, 1920, 1, 8)
    sizes = _ramp(schedule, 400)
    assert sizes[0] == 32 and sizes[-1] == 1920 and sizes == sorted(sizes)
    assert all((b - 32) % 32 == 0 for b in sizes)


@pytest.mark.parametrize("args,message", [((3, 4, 10, 16, 2, 1), "multiples of --micro-batch-size 2"),
                                          ((4, 5, 10, 16, 2, 1), "START plus a whole number of INCREMENTs"),
                                          ((0, 4, 10, 16, 2, 1), "must be positive")])
def test_bad_ramps_are_refused(args, message):
    assert any(message in error for error in rampup_errors(*args))


FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "24",
         "--train-iters", "6", "--lr", "2e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data",
         "--vocab-size", "250", "--make-vocab-size-divisible-by", "128", "--log-interval", "1", "--eval-interval", "0"]


@pytest.mark.e2e
def test_ramp_in_training_is_exact_across_layouts():
    single = launch(1, FLAGS)
    assert single.returncode == 0, single.stdout[-3000:]
    lines = re.findall(r"consumed samples: (\d+) .*? global batch size: (\d+) ", single.stdout)
    assert [(int(c), int(b)) for c, b in lines] == [(4, 4), (8, 4), (16, 8), (28, 12), (44, 16), (60, 16)]
    parallel = launch(4, FLAGS + ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"])
    assert parallel.returncode == 0, parallel.stdout[-3000:]
    expected = losses(single.stdout)
    for iteration, loss in losses(parallel.stdout).items():
        assert loss == pytest.approx(expected[iteration], rel=1e-4)
