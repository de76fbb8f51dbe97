"""Megatron-DeepSpeed's --exit-on-missing-checkpoint in a launch: a --load folder without a checkpoint stops the run
instead of starting it from scratch. Its other flags:
tests/unit/arguments/compat/test_megatron_deepspeed_arguments.py."""
from tests.support.megatron_deepspeed_arguments import BASE


def test_exit_on_missing_checkpoint_stops_instead_of_starting_from_scratch(tmp_path):
    from tests.support.launch import launch
    result = launch(1, BASE + ["--load", str(tmp_path / "empty"), "--exit-on-missing-checkpoint"])
    assert result.returncode != 0 and "no checkpoint there (--exit-on-missing-checkpoint)" in result.stdout, \
        result.stdout[-2000:]
