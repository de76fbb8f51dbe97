"""tools/dry_run.py's command line: bad input is refused before any rank runs, and --ranks chooses the ranks it
names. The dry runs themselves: tests/e2e/tools/test_dry_run.py."""
import pytest

from megatron_ds.planning.dry_run import launch_check as dry_run
from tests.support.dry_run import WORLD_16


@pytest.mark.parametrize("flags, message", [
    (["--ranks", "3,99"], "--ranks '3,99': ranks [99] are outside the world of 16"),
    (["--ranks", "first"], "--ranks 'first': expected stages, all or a list like 0,5,8-11"),
    (["--num-attention-heads", "3"], "--num-attention-heads 3"),
    (["--micro-batches", "4"], "--micro-batches 4: the micro-batches of the --step iteration, at least 1, and only "
                               "with --step"),
    (["--step", "--micro-batches", "0"], "--micro-batches 0"),
], ids=["outside", "spelling", "heads", "micro-batches-without-step", "no-micro-batches"])
def test_bad_input_is_refused_before_any_rank_runs(flags, message, capsys):
    assert dry_run.main(WORLD_16 + flags) == 2
    error = capsys.readouterr().err
    assert message in error and "dry run:" not in error


def test_stages_choose_one_rank_per_stage_and_tp_position():
    from megatron_ds.core.parallel_state import build_topology
    topology = build_topology(2, 4, 16)
    assert dry_run.chosen_ranks("stages", topology, 16) == [0, 1, 4, 5, 8, 9, 12, 13]
    assert dry_run.chosen_ranks("2,8-10", topology, 16) == [2, 8, 9, 10]
    assert dry_run.chosen_ranks("all", topology, 16) == list(range(16))
