"""The start-up checks of the folders a run writes (launch/storage.py): a folder that cannot be made or written
names its flag, path and OS error; a --save file system with less free space than one checkpoint names both
numbers; each rank checks only what it writes; pretrain.py refuses before training, every problem on its line,
exit status 2. A folder whose parent is a file is unwritable for root too (CI runs as root)."""
import os
import types

from megatron_ds.launch.storage import folders_written_by, free_space_problem, storage_problems, unwritable_problem
from tests.support.flags import TINY_MODEL
from tests.support.launch import run_alone


def _args(**folders):
    return types.SimpleNamespace(**{"save": None, "tensorboard_dir": None, "data_cache_path": None,
                                    "pipeline_timeline": None, **folders})


def test_a_folder_that_cannot_be_made_names_the_flag_the_path_and_the_os_error(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    folder = str(tmp_path / "file" / "checkpoints")
    assert unwritable_problem("--save", folder) == (f"--save {folder} is not writable: [Errno 20] Not a "
                                                    f"directory: '{folder}'")
    assert unwritable_problem("--save", str(tmp_path / "new" / "checkpoints")) is None
    assert os.listdir(tmp_path / "new" / "checkpoints") == []  # created, and the probe is gone


def test_less_free_space_than_one_checkpoint_is_refused_with_both_numbers():
    assert free_space_problem("/ckpt", free_bytes=3 * 2 ** 30, checkpoint_bytes=3 * 2 ** 30) is None
    assert free_space_problem("/ckpt", free_bytes=2 ** 30, checkpoint_bytes=2.5 * 2 ** 30) == (
        "--save /ckpt: its file system has 1.00 GiB (1,073,741,824 bytes) free, but one checkpoint of this model "
        "takes at least 2.50 GiB (2,684,354,560 bytes); free space there or give another --save")


def test_each_rank_checks_the_folders_it_writes(tmp_path):
    args = _args(save="/ckpt", tensorboard_dir="/tb", data_cache_path="/cache")
    assert folders_written_by(args, rank=0, logging_rank=3) == [("--save", "/ckpt"), ("--data-cache-path", "/cache")]
    assert folders_written_by(args, rank=3, logging_rank=3) == [("--save", "/ckpt"), ("--tensorboard-dir", "/tb")]
    assert folders_written_by(_args(), rank=0, logging_rank=0) == []
    assert folders_written_by(_args(pipeline_timeline="/tl"), rank=5, logging_rank=0) == [
        ("--pipeline-timeline", "/tl")]
    needed = 2 ** 70  # more than any disk
    assert storage_problems(_args(save=str(tmp_path)), 0, 0, needed)[0].startswith(f"--save {tmp_path}: its file "
                                                                                   f"system has ")


def test_pretrain_refuses_unwritable_folders_before_training(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    folders = {flag: str(tmp_path / "file" / flag.strip("-")) for flag in
               ("--save", "--tensorboard-dir", "--data-cache-path")}
    result = run_alone(["pretrain.py"], TINY_MODEL + [item for pair in folders.items() for item in pair])
    assert result.returncode == 2 and "Traceback" not in result.stdout, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("megatron_ds: error: ")]
    assert errors == [f"megatron_ds: error: {flag} {path} is not writable: [Errno 20] Not a directory: '{path}'"
                      for flag, path in folders.items()], result.stdout[-3000:]
    assert "megatron_ds: world size" not in result.stdout  # before the model is built
