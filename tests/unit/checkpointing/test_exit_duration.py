"""--exit-duration-in-mins: ranks count from the earliest rank's start and agree on stopping (2 gloo ranks)."""
import time

import torch.distributed as dist

from megatron_ds.checkpointing.exit_policy import ExitDuration
from tests.support.distributed import run_distributed


def _agree():
    now = time.time()
    fresh = ExitDuration(1, now)
    assert not fresh.reached()
    # only rank 1 started 61 s ago: the earliest start counts, so both ranks stop
    early = ExitDuration(1, now - 61 if dist.get_rank() == 1 else now)
    assert early.start <= time.time() - 61  # rank 1's start, whatever rank 0 passed
    assert early.reached()
    assert 1.0 < early.elapsed_minutes() < 1.5
    assert ExitDuration(2, early.start).reached() is False


def test_ranks_count_from_the_earliest_start_and_stop_together():
    run_distributed(_agree, 2)
