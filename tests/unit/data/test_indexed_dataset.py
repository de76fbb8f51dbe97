import os
import pickle
import struct

import numpy as np
import pytest

from tests.support.corpus import build_indexed_dataset
from megatron_ds.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError,
                                              best_fitting_dtype)

MEGATRON_DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6,
                        np.float32: 7, np.uint16: 8}
DOCUMENTS = [[5, 6, 7], [1], [], [9, 8, 7, 6, 5, 4]]


def write_megatron_index_by_hand(path, code, lengths, pointers, document_indices):
    """The published MMIDIDX layout, field by field, independent of the builder."""
    with open(path, "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(document_indices)}q", *document_indices))


@pytest.mark.parametrize("dtype", list(MEGATRON_DTYPE_CODES))
def test_round_trip_for_every_megatron_dtype(tmp_path, dtype):
    prefix = build_indexed_dataset(tmp_path / "data", DOCUMENTS, dtype)
    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(DOCUMENTS) and dataset.dtype == np.dtype(dtype)
    for index, tokens in enumerate(DOCUMENTS):
        assert dataset[index].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(dataset[index], np.array(tokens, dtype=dtype))
    np.testing.assert_array_equal(dataset.sequence_lengths, [3, 1, 0, 6])
    np.testing.assert_array_equal(dataset.document_indices, [0, 1, 2, 3, 4])
    itemsize = np.dtype(dtype).itemsize
    np.testing.assert_array_equal(dataset.sequence_pointers, np.array([0, 3, 4, 4]) * itemsize)
    assert os.path.getsize(f"{prefix}.bin") == 10 * itemsize


def test_reads_a_hand_written_megatron_index(tmp_path):
    tokens = np.array([10, 11, 12, 20, 21, 30], dtype=np.int32)
    (tmp_path / "hand.bin").write_bytes(struct.pack("<6i", *tokens))
    # two documents: the first made of sequences [10 11 12] and [20 21], the second of [30]
    write_megatron_index_by_hand(tmp_path / "hand.idx", code=4, lengths=[3, 2, 1], pointers=[0, 12, 20],
                                 document_indices=[0, 2, 3])
    dataset = IndexedDataset(str(tmp_path / "hand"))
    assert dataset.dtype == np.int32 and len(dataset) == 3 and dataset.document_count == 2
    np.testing.assert_array_equal(dataset.document_indices, [0, 2, 3])
    assert [list(sequence) for sequence in dataset[0:3]] == [[10, 11, 12], [20, 21], [30]]
    assert list(dataset.get(1, offset=1)) == [21]


def test_builder_writes_the_published_header_and_arrays(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "out.bin"), np.uint16) as builder:
        builder.add_document([1, 2, 3])
        builder.add_item([4, 5])
        builder.add_item([6])
        builder.end_document()
        builder.finalize(str(tmp_path / "out.idx"))
    raw = (tmp_path / "out.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, sequence_count, document_count = struct.unpack_from("<QBQQ", raw, 9)
    assert (version, code, sequence_count, document_count) == (1, 8, 3, 3)
    assert struct.unpack_from("<3i", raw, 34) == (3, 2, 1)
    assert struct.unpack_from("<3q", raw, 34 + 12) == (0, 6, 10)
    assert struct.unpack_from("<3q", raw, 34 + 12 + 24) == (0, 1, 3)
    assert len(raw) == 34 + 12 + 24 + 24
    assert (tmp_path / "out.bin").read_bytes() == struct.pack("<6H", 1, 2, 3, 4, 5, 6)


def test_get_returns_a_slice_of_one_sequence(tmp_path):
    dataset = IndexedDataset(build_indexed_dataset(tmp_path / "data", DOCUMENTS))
    assert list(dataset.get(3)) == [9, 8, 7, 6, 5, 4]
    assert list(dataset.get(3, offset=2)) == [7, 6, 5, 4]
    assert list(dataset.get(3, offset=1, length=3)) == [8, 7, 6]
    assert list(dataset.get(-1, offset=5, length=1)) == [4]
    assert list(dataset.get(0, offset=3, length=0)) == []
    with pytest.raises(IndexError):
        dataset.get(3, offset=4, length=3)
    with pytest.raises(IndexError):
        dataset.get(len(DOCUMENTS))


def test_slices_are_contiguous_runs_of_sequences(tmp_path):
    dataset = IndexedDataset(build_indexed_dataset(tmp_path / "data", DOCUMENTS))
    assert [list(s) for s in dataset[1:4]] == DOCUMENTS[1:4]
    assert [list(s) for s in dataset[:]] == DOCUMENTS
    assert dataset[2:2] == []
    with pytest.raises(ValueError, match="contiguous"):
        dataset[::2]


def test_dataset_pickles_by_reopening_its_files(tmp_path):
    dataset = pickle.loads(pickle.dumps(IndexedDataset(build_indexed_dataset(tmp_path / "data", DOCUMENTS))))
    assert list(dataset[3]) == DOCUMENTS[3]


def test_empty_dataset(tmp_path):
    dataset = IndexedDataset(build_indexed_dataset(tmp_path / "empty", []))
    assert len(dataset) == 0 and dataset[:] == [] and list(dataset.document_indices) == [0]


def test_best_fitting_dtype_follows_megatron():
    assert best_fitting_dtype(32000) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(128256) == np.int32


def test_add_index_appends_documents_and_offsets_document_indices(tmp_path):
    first = build_indexed_dataset(tmp_path / "a", [[1, 2], [3]])
    with IndexedDatasetBuilder(str(tmp_path / "b.bin"), np.uint16) as builder:
        builder.add_item([4])
        builder.add_item([5, 6])
        builder.end_document()
        builder.finalize(str(tmp_path / "b.idx"))
    with IndexedDatasetBuilder(str(tmp_path / "ab.bin"), np.uint16) as builder:
        builder.add_index(first)
        builder.add_index(str(tmp_path / "b"))
        builder.finalize(str(tmp_path / "ab.idx"))
    merged = IndexedDataset(str(tmp_path / "ab"))
    assert [list(s) for s in merged[:]] == [[1, 2], [3], [4], [5, 6]]
    np.testing.assert_array_equal(merged.document_indices, [0, 1, 2, 4])


def test_add_index_refuses_another_dtype(tmp_path):
    other = build_indexed_dataset(tmp_path / "wide", [[1]], np.int32)
    with pytest.raises(IndexedDatasetError, match="wide.idx.*int32.*uint16"):
        with IndexedDatasetBuilder(str(tmp_path / "narrow.bin"), np.uint16) as builder:
            builder.add_index(other)
    assert set(os.listdir(tmp_path)) == {"wide.bin", "wide.idx"}


def test_tokens_that_do_not_fit_the_dtype_are_refused(tmp_path):
    with pytest.raises(ValueError, match="do not fit"):
        with IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16) as builder:
            builder.add_document([1, 70000])


def test_an_interrupted_build_leaves_no_file_under_a_final_name(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16) as builder:
            builder.add_document([1, 2, 3])
            assert not (tmp_path / "x.bin").exists()
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------- corruption


def corrupt_magic(prefix):
    _patch(f"{prefix}.idx", 0, b"NOTMMIDX\x00")


def corrupt_version(prefix):
    _patch(f"{prefix}.idx", 9, struct.pack("<Q", 2))


def corrupt_dtype_code(prefix):
    _patch(f"{prefix}.idx", 17, struct.pack("<B", 9))


def truncate_idx(prefix):
    _truncate(f"{prefix}.idx", 8)


def truncate_idx_inside_header(prefix):
    os.truncate(f"{prefix}.idx", 20)


def extend_idx(prefix):
    with open(f"{prefix}.idx", "ab") as f:
        f.write(b"\x00" * 8)


def truncate_bin(prefix):
    _truncate(f"{prefix}.bin", 2)


def remove_idx(prefix):
    os.remove(f"{prefix}.idx")


def remove_bin(prefix):
    os.remove(f"{prefix}.bin")


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, drop_bytes):
    os.truncate(path, os.path.getsize(path) - drop_bytes)


@pytest.mark.parametrize("corrupt, file_suffix, message", [
    (corrupt_magic, ".idx", "not a Megatron MMIDIDX"),
    (corrupt_version, ".idx", "version 2"),
    (corrupt_dtype_code, ".idx", "unknown dtype code 9"),
    (truncate_idx, ".idx", "truncated"),
    (truncate_idx_inside_header, ".idx", "truncated"),
    (extend_idx, ".idx", "too long"),
    (truncate_bin, ".bin", "truncated"),
    (remove_idx, ".idx", "not found"),
    (remove_bin, ".bin", "not found"),
])
def test_corrupt_or_missing_files_raise_an_error_naming_the_file(tmp_path, corrupt, file_suffix, message):
    prefix = build_indexed_dataset(tmp_path / "data", DOCUMENTS)
    corrupt(prefix)
    with pytest.raises(IndexedDatasetError, match=message) as error:
        IndexedDataset(prefix)
    assert f"{prefix}{file_suffix}" in str(error.value)
    assert isinstance(error.value, ValueError)
