"""A save that cannot be written (no space, a missing folder): the writers keep the first failed write, naming the
file, instead of raising inside DeepSpeed's save, and a rank whose file or marker cannot be written is marked
failed, so rank 0 stops waiting. A link to /dev/full fails every write with ENOSPC, as a full disk does, for root
too. A run whose save fails: tests/e2e/test_save_failures.py."""
import errno
import os

import pytest
import torch

from megatron_ds.checkpointing import async_save, files


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
