"""--log-straggler's arithmetic by hand: each rank's compute time against its peers', the report's line, and the
clock of the time spent communicating. On real ranks: tests/e2e/test_stragglers.py."""
import time

import pytest

from megatron_ds.training.resilience.stragglers import CommunicationClock, RankTime, extremes_line, peer_ratios


def test_peers_are_the_other_ranks_of_the_stage_and_the_extremes_the_median_of_all():
    times = [RankTime(0, "a", 0, 1.0), RankTime(1, "a", 0, 1.5), RankTime(2, "b", 0, 1.0),
             RankTime(3, "b", 1, 2.0), RankTime(4, "c", 1, 1.0)]
    ratios = peer_ratios(times)
    assert ratios[1] == 1.5 and ratios[0] == pytest.approx(1 / 1.25) and ratios[3] == 2.0 and ratios[4] == 0.5
    assert peer_ratios([RankTime(0, "a", 0, 3.0), RankTime(1, "a", 1, 1.0), RankTime(2, "a", 2, 2.0)])[0] == 2.0
    line = extremes_line(times, 1, 11, 20)
    assert line == ("straggler check, iterations 11-20: compute per iteration, median 1000.0 ms; slowest rank 3 (b, "
                    "stage 1) 2000.0 ms 2.00x; fastest rank 0 (a, stage 0) 1000.0 ms 1.00x")


def test_the_clock_counts_outermost_calls_and_the_waits_of_async_ones():
    clock = CommunicationClock()
    sleep = clock._timed(lambda seconds, async_op=False: time.sleep(seconds) if not async_op else _Handle(seconds))
    nested = clock._timed(lambda: sleep(0.05))
    nested()
    assert 0.05 <= clock.seconds < 0.09  # counted once, not twice
    handle = sleep(0.05, async_op=True)
    assert clock.seconds < 0.09
    handle.wait()
    assert 0.10 <= clock.seconds < 0.15 and handle.seconds == 0.05


class _Handle:
    """What an async collective returns: wait() blocks until the peers are done."""

    def __init__(self, seconds):
        self.seconds = seconds

    def wait(self):
        time.sleep(self.seconds)
        return True
