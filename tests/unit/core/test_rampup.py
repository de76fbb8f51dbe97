"""--rampup-batch-size START INCREMENT SAMPLES (core/batch_schedule.py): the global batch grows as Megatron's does;
ramps that cannot be are refused. In training: tests/e2e/test_rampup.py."""
import pytest

from megatron_ds.core.batch_schedule import RampupBatchSize, rampup_errors


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
