"""Checksums (CRC-32) of checkpoint files: computed while each file is written, recorded in the metadata beside
the sizes, brought to rank 0 by the writers (and the --async-save markers), verified by --load with every rank
reading its share of the files; a file whose bytes changed at the same size is refused by name, with the last good
checkpoint. The launches on a real DeepSpeed checkpoint are in tests/e2e/test_checkpointing.py."""
import json
import os
import re
import zlib

import pytest
import torch

from megatron_ds.checkpointing import CheckpointManager, async_save, discovery, files
from megatron_ds.checkpointing.foreign import deepspeed_universal as universal
from tests.support.checkpoints import TINY, corrupt_bytes, layout_flags, tiny_checkpoint
from tests.support.distributed import run_distributed


def _manager(load_dir, world_size=1):
    from megatron_ds.arguments import parse_args
    manager = CheckpointManager.__new__(CheckpointManager)
    manager.args = parse_args(TINY + ["--train-iters", "8", "--load", str(load_dir)] + layout_flags(1, 1),
                              world_size=world_size)
    manager.config = manager.args.checkpointing
    return manager


def test_write_torch_file_returns_the_checksum_of_the_bytes_on_disk(tmp_path):
    path = tmp_path / "big.pt"
    written = files.write_torch_file({"w": torch.randn(1_200_000)}, str(path))
    assert path.stat().st_size > files.CHECKSUM_CHUNK_BYTES  # read back in more than one piece
    assert written == files.file_checksum(str(path)) == f"crc32:{zlib.crc32(path.read_bytes()):08x}"


def test_share_of_splits_the_files_round_robin_without_overlap():
    names = [f"f{i}" for i in range(7)]
    shares = [files.share_of(set(names), rank, 3) for rank in range(3)]
    assert shares[0] == ["f0", "f3", "f6"] and sorted(sum(shares, [])) == names


@pytest.mark.parametrize("writer_class", [async_save.FileWriter, async_save.BackgroundWriter])
def test_the_writers_give_the_checksums_of_the_files_they_wrote_into_a_folder(tmp_path, writer_class):
    """Named relative to the save's folder; a file elsewhere (of an abandoned save) is forgotten with them."""
    folder = tmp_path / "global_step2.tmp"
    folder.mkdir()
    writer, names = writer_class(), ["mp_rank_00_model_states.pt", files.rng_file_name(0)]
    writer.save({"x": torch.ones(3)}, str(tmp_path / "abandoned.pt"))
    for size, name in enumerate(names, 4):
        writer.save({"x": torch.ones(size)}, str(folder / name))
    writer.wait()
    assert writer.take_checksums(str(folder)) == {name: files.file_checksum(str(folder / name)) for name in names}
    assert writer.take_checksums(str(tmp_path)) == {}


def test_async_markers_bring_every_ranks_checksums_to_rank_0(tmp_path):
    writer, name = async_save.BackgroundWriter(), "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    writer.save({"x": torch.ones(4)}, str(tmp_path / name))
    writer.run_after_all(lambda failed: async_save.mark_finished(writer, str(tmp_path), 1, failed))
    writer.wait()
    async_save.mark_written(str(tmp_path), 0, {"ds_config.json": "crc32:0000abcd"})
    assert async_save.wait_for_every_rank(str(tmp_path), 2, timeout=60) == {
        name: files.file_checksum(str(tmp_path / name)), "ds_config.json": "crc32:0000abcd"}
    assert os.listdir(tmp_path) == [name]  # the markers are gone


def test_a_file_whose_bytes_changed_at_the_same_size_fails_its_checksum(tmp_path):
    """Every file of a converter's checkpoint has its checksum; 20 KB of random bytes in a shard keep its size
    (the completeness check passes) but not its checksum."""
    folder, _ = tiny_checkpoint(tmp_path, 2)
    metadata = files.read_metadata(folder)
    assert set(metadata["checksums"]) == set(metadata["files"]) and files.METADATA_FILE not in metadata["checksums"]
    assert files.checksum_problems(folder, metadata["checksums"]) == []
    shard = files.sharded_file_name(0, 0)
    corrupt_bytes(os.path.join(folder, shard))
    assert files.problems_of(folder) == []
    assert files.checksum_problems(folder, metadata["checksums"]) == [
        f"{shard} has checksum {files.file_checksum(os.path.join(folder, shard))}, {metadata['checksums'][shard]} "
        f"was written (its bytes changed after the save)"]


def _verify_checksums_on_two_ranks(load_dir, corrupted):
    manager = _manager(load_dir, world_size=2)
    intact = manager._verify_checksums("global_step2", files.read_metadata(os.path.join(load_dir, "global_step2")))
    assert re.fullmatch(r"checksums of 1 file \(\d+\.\d MiB\) verified in \d+\.\d\d s", intact), intact
    with pytest.raises(files.CheckpointError) as refused:
        manager._verify_checksums("global_step4", files.read_metadata(os.path.join(load_dir, "global_step4")))
    message = str(refused.value)
    assert message.startswith(f"checkpoint {os.path.join(load_dir, 'global_step4')} is damaged or incomplete: "
                              f"{corrupted} has checksum "), message
    assert message.endswith(f"the last good checkpoint is {os.path.join(load_dir, 'global_step2')} (iteration 2): "
                            f"load it with --load {load_dir} --load-iteration 2"), message


def test_load_verifies_on_every_rank_and_refuses_a_changed_file_with_the_last_good_checkpoint(tmp_path):
    """Two ranks, two shards: rank 1 reads the corrupted one; both raise the same error."""
    tiny_checkpoint(tmp_path, 2)
    folder, _ = tiny_checkpoint(tmp_path, 4, tp=2)
    corrupted = files.sharded_file_name(1, 0)
    assert files.share_of(files.read_metadata(folder)["checksums"], 1, 2) == [corrupted]
    corrupt_bytes(os.path.join(folder, corrupted))
    run_distributed(_verify_checksums_on_two_ranks, 2, str(tmp_path), corrupted)


def test_a_checkpoint_without_checksums_loads_unverified(tmp_path):
    """Saved before checksums were recorded, or DeepSpeed's universal format (no file list of ours)."""
    folder, _ = tiny_checkpoint(tmp_path, 2)
    metadata = files.read_metadata(folder)
    del metadata["checksums"]
    with open(os.path.join(folder, files.METADATA_FILE), "w") as handle:
        json.dump(metadata, handle)
    tag, older, _ = discovery.resolve_checkpoint(str(tmp_path))
    manager = _manager(tmp_path)
    assert manager._verify_checksums(tag, older) == \
        "no checksums in the checkpoint (saved before they were recorded): files not verified"
    assert manager._verify_checksums(tag, {"format": universal.FORMAT}) == \
        "no checksums in DeepSpeed's universal format: files not verified"
