"""One run per --save folder (checkpointing/folder_lock.py): the lock names its owner; a live owner makes a
second run refuse at start-up (every rank, exit 2, before training); a lock whose process is gone is taken
over with a warning; another host's lock is assumed alive; the owner gives it back."""
import json
import os
import socket
import subprocess
import sys

import pytest

from megatron_ds.checkpointing import folder_lock
from megatron_ds.checkpointing.files import CheckpointError
from tests.checkpoints import TINY
from tests.launch import launch


def _lock(folder, **owner):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / folder_lock.LOCK_FILE).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "started": "2026-01-01T00:00:00+00:00", "job": "77",
         **owner}))


def _dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_live_owner_is_named_and_a_gone_one_is_taken_over(tmp_path):
    _lock(tmp_path)  # this test process: alive
    with pytest.raises(CheckpointError, match=rf"in use by another run \(pid {os.getpid()} on host "
                                              rf"{socket.gethostname()} since 2026-01-01T00:00:00\+00:00, job 77\)"):
        folder_lock.claim(str(tmp_path))
    _lock(tmp_path, host="some-other-node")  # cannot be checked from here: assumed alive
    with pytest.raises(CheckpointError, match="host some-other-node"):
        folder_lock.claim(str(tmp_path))
    _lock(tmp_path, pid=_dead_pid())
    warning = folder_lock.claim(str(tmp_path))
    assert warning and "took over the lock" in warning and "a run that is gone" in warning
    assert json.loads((tmp_path / folder_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    folder_lock.release(str(tmp_path))
    assert not (tmp_path / folder_lock.LOCK_FILE).exists()
    assert folder_lock.claim(str(tmp_path / "new")) is None  # a fresh folder: created and locked


@pytest.mark.e2e
def test_a_second_run_on_a_locked_folder_refuses_at_start_up(tmp_path):
    _lock(tmp_path / "ckpt")
    result = launch(2, TINY + ["--train-iters", "2", "--save", str(tmp_path / "ckpt")])
    assert result.returncode != 0, result.stdout[-3000:]
    assert result.stdout.count("is in use by another run") == 2, result.stdout[-3000:]  # every rank
    assert " iteration " not in result.stdout
    ours = launch(2, TINY + ["--train-iters", "2", "--save", str(tmp_path / "free")])
    assert ours.returncode == 0 and not (tmp_path / "free" / folder_lock.LOCK_FILE).exists(), ours.stdout[-3000:]
