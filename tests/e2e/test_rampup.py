"""--rampup-batch-size START INCREMENT SAMPLES in training: consumed samples advance by each iteration's batch, and
the data position stays exact across the ramp (a data-parallel layout reads the same samples as a single rank)."""
import re

import pytest

from tests.support.launch import assert_succeeded, launch, losses

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "24",
         "--train-iters", "6", "--lr", "2e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data",
         "--vocab-size", "250", "--make-vocab-size-divisible-by", "128", "--log-interval", "1", "--eval-interval", "0"]


def test_ramp_in_training_is_exact_across_layouts():
    single = launch(1, FLAGS)
    assert_succeeded(single, tail=3000)
    lines = re.findall(r"consumed samples: (\d+) .*? global batch size: (\d+) ", single.stdout)
    assert [(int(c), int(b)) for c, b in lines] == [(4, 4), (8, 4), (16, 8), (28, 12), (44, 16), (60, 16)]
    parallel = launch(4, FLAGS + ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"])
    assert_succeeded(parallel, tail=3000)
    expected = losses(single.stdout)
    for iteration, loss in losses(parallel.stdout).items():
        assert loss == pytest.approx(expected[iteration], rel=1e-4)
