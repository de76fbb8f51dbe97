"""A save that cannot be written (no space, a missing folder): the writers keep the first failed write, naming the
file, instead of raising inside DeepSpeed's save; a run whose save fails prints the file and the OS error in one
line, removes the temporary folder, leaves the previous checkpoint and the pointers as they were, and exits 1.
A link to /dev/full fails every write with ENOSPC, as a full disk does, for root too."""
import errno
import os

import pytest
import torch

from megatron_ds.checkpointing import async_save, files
from tests.checkpoints import TINY, assert_previous_checkpoint_published
from tests.launch import run_alone


def _full_disk_file(folder, name="full.pt"):
    path = folder / name
    os.symlink("/dev/full", path)
    return str(path)


def test_a_failed_write_names_the_file_and_stops_the_writes_of_that_save(tmp_path):
    writer, full = async_save.FileWriter(), _full_disk_file(tmp_path)
    writer.save({"weights": torch.ones(1000)}, full)
    writer.save({"weights": torch.ones(10)}, str(tmp_path / "after.pt"))  # not written: the save is abandoned
    with pytest.raises(OSError) as raised:
        writer.wait()
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, full)
    assert not (tmp_path / "after.pt").exists()
    writer.wait()  # raised once
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="file/x.pt"):
        files.write_torch_file({}, str(tmp_path / "file" / "x.pt"))


def test_a_background_write_that_fails_marks_the_rank_failed(tmp_path):
    """Rank 0's publishing stops waiting for the other ranks at once; wait() raises the failure."""
    writer, full = async_save.BackgroundWriter(), _full_disk_file(tmp_path)
    writer.save({"weights": torch.ones(1000)}, full)
    writer.run_after_all(lambda failed: async_save.mark_finished(writer, str(tmp_path), 1, failed))
    with pytest.raises(OSError) as raised:
        writer.wait()
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, full)
    async_save.mark_written(str(tmp_path), 0, {})
    assert async_save.wait_for_every_rank(str(tmp_path), 2, timeout=60) is None


def test_a_marker_that_cannot_be_written_marks_the_rank_failed(tmp_path):
    """The disk fills after a rank's files: its marker (the files' checksums) fails, a failure marker (an empty
    file) takes its place, so rank 0 stops waiting at once."""
    marker = async_save.marker_name(1)
    _full_disk_file(tmp_path, f"{marker}{files.TMP_SUFFIX}.{os.getpid()}")  # the marker's temporary name
    with pytest.raises(OSError) as raised:
        async_save.mark_written(str(tmp_path), 1, {"a.pt": "crc32:00000000"})
    assert raised.value.errno == errno.ENOSPC and not (tmp_path / marker).exists()
    async_save.mark_written(str(tmp_path), 0, {})
    assert async_save.wait_for_every_rank(str(tmp_path), 2, timeout=60) is None


@pytest.mark.e2e
@pytest.mark.parametrize("mode", [(), ("--async-save",)], ids=["in-the-training-thread", "async-save"])
def test_a_save_on_a_full_disk_fails_in_one_line_and_keeps_the_previous_checkpoint(tmp_path, mode):
    """The disk fills after the save of iteration 2: the save of iteration 4 fails at rank 0's RNG file (in the
    training thread) or at DeepSpeed's config (--async-save, written in the background)."""
    save = tmp_path / "ckpt"
    flags = TINY + ["--train-iters", "4", "--save", str(save), "--save-interval", "2", *mode]
    result = run_alone(["-m", "tests.fault_injection", "disk-full:deepspeed-files@4"], flags)
    assert result.returncode == 1 and "Traceback" not in result.stdout, result.stdout[-3000:]
    failed = save / "global_step4.tmp" / (files.DS_CONFIG_FILE if mode else files.rng_file_name(0))
    assert [line for line in result.stdout.splitlines() if line.startswith("megatron_ds: error: ")] == [
        f"megatron_ds: error: checkpoint of iteration 4 not saved: rank 0: [Errno 28] No space left on device: "
        f"'{failed}'; its temporary folder {save / 'global_step4.tmp'} is removed; the last saved checkpoint, "
        f"{save / 'global_step2'}, and the pointers to it are unchanged"]
    assert sorted(name for name in os.listdir(save) if name.startswith("global_step")) == ["global_step2"]
    assert_previous_checkpoint_published(save)
