"""One run per --save folder (checkpointing/folder_lock.py): the lock names its owner; a live owner makes a claim
refuse; a lock whose process is gone is taken over with a warning; another host's lock is assumed alive; the owner
gives it back. A second run on a locked folder: tests/e2e/test_folder_lock.py."""
import json
import os
import socket
import subprocess
import sys

import pytest

from megatron_ds.checkpointing import folder_lock
from megatron_ds.checkpointing.files import CheckpointError
from tests.support.checkpoints import write_lock


def _dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_live_owner_is_named_and_a_gone_one_is_taken_over(tmp_path):
    write_lock(tmp_path)  # this test process: alive
    with pytest.raises(CheckpointError, match=rf"in use by another run \(pid {os.getpid()} on host "
                                              rf"{socket.gethostname()} since 2026-01-01T00:00:00\+00:00, job 77\)"):
        folder_lock.claim(str(tmp_path))
    write_lock(tmp_path, host="some-other-node")  # cannot be checked from here: assumed alive
    with pytest.raises(CheckpointError, match="host some-other-node"):
        folder_lock.claim(str(tmp_path))
    write_lock(tmp_path, pid=_dead_pid())
    warning = folder_lock.claim(str(tmp_path))
    assert warning and "took over the lock" in warning and "a run that is gone" in warning
    assert json.loads((tmp_path / folder_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    folder_lock.release(str(tmp_path))
    assert not (tmp_path / folder_lock.LOCK_FILE).exists()
    assert folder_lock.claim(str(tmp_path / "new")) is None  # a fresh folder: created and locked
