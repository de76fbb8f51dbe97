"""One run per --save folder (checkpointing/folder_lock.py): a live owner makes a second run refuse at start-up
(every rank, before training); a run on a free folder gives its lock back. The lock itself:
tests/unit/checkpointing/test_folder_lock.py."""
from megatron_ds.checkpointing import folder_lock
from tests.support.checkpoints import TINY, write_lock
from tests.support.launch import assert_succeeded, launch


def test_a_second_run_on_a_locked_folder_refuses_at_start_up(tmp_path):
    write_lock(tmp_path / "ckpt")
    result = launch(2, TINY + ["--train-iters", "2", "--save", str(tmp_path / "ckpt")])
    assert result.returncode != 0, result.stdout[-3000:]
    assert result.stdout.count("is in use by another run") == 2, result.stdout[-3000:]  # every rank
    assert " iteration " not in result.stdout
    ours = launch(2, TINY + ["--train-iters", "2", "--save", str(tmp_path / "free")])
    assert_succeeded(ours, tail=3000)
    assert not (tmp_path / "free" / folder_lock.LOCK_FILE).exists(), ours.stdout[-3000:]
