"""A run whose save cannot be written (the disk full: a link to /dev/full fails every write with ENOSPC, for root
too) prints the file and the OS error in one line, removes the temporary folder, leaves the previous checkpoint and
the pointers as they were, and exits 1."""
import os

import pytest

from megatron_ds.checkpointing import files
from tests.support.checkpoints import TINY, assert_previous_checkpoint_published
from tests.support.launch import run_alone


@pytest.mark.parametrize("mode", [(), ("--async-save",)], ids=["in-the-training-thread", "async-save"])
def test_a_save_on_a_full_disk_fails_in_one_line_and_keeps_the_previous_checkpoint(tmp_path, mode):
    """The disk fills after the save of iteration 2: the save of iteration 4 fails at rank 0's RNG file (in the
    training thread) or at DeepSpeed's config (--async-save, written in the background)."""
    save = tmp_path / "ckpt"
    flags = TINY + ["--train-iters", "4", "--save", str(save), "--save-interval", "2", *mode]
    result = run_alone(["-m", "tests.support.fault_injection", "disk-full:deepspeed-files@4"], flags)
    assert result.returncode == 1 and "Traceback" not in result.stdout, result.stdout[-3000:]
    failed = save / "global_step4.tmp" / (files.DS_CONFIG_FILE if mode else files.rng_file_name(0))
    assert [line for line in result.stdout.splitlines() if line.startswith("megatron_ds: error: ")] == [
        f"megatron_ds: error: checkpoint of iteration 4 not saved: rank 0: [Errno 28] No space left on device: "
        f"'{failed}'; its temporary folder {save / 'global_step4.tmp'} is removed; the last saved checkpoint, "
        f"{save / 'global_step2'}, and the pointers to it are unchanged"]
    assert sorted(name for name in os.listdir(save) if name.startswith("global_step")) == ["global_step2"]
    assert_previous_checkpoint_published(save)
