"""Megatron-LM's memory-mapped indexed dataset ("MMIDIDX"), byte for byte: a `.bin` of tokens and an `.idx`.

`.idx`, little-endian, with no padding:

    magic             9 bytes   b"MMIDIDX\\x00\\x00"
    version           uint64    1
    dtype code        uint8     1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count    uint64    S
    document count    uint64    D = documents + 1
    sequence lengths  int32[S]  tokens per sequence
    sequence pointers int64[S]  byte offset of each sequence in the .bin
    document indices  int64[D]  [0, n1, n2, ...]: document k is sequences [indices[k], indices[k + 1])

`.bin`: the tokens of every sequence, concatenated, in the dtype. A document is usually one sequence; a
sentence-split document is several.

Files written by Megatron-LM open here and files written here open in Megatron-LM. Both files are memory
mapped: opening a dataset reads the 34-byte header and a few index entries, whatever the size; the checks
(magic, version, dtype code, .idx size against the header counts, .bin size against the end of the last
sequence, which is the sum of lengths x itemsize for a sequentially written file) are O(1).
"""
import array
import os
import shutil
import struct

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count: 34 bytes

DTYPE_OF_CODE = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_OF_CODE.items()}


class IndexedDatasetError(ValueError):
    """An .idx/.bin pair that is missing, corrupt or inconsistent; the message names the file."""


def best_fitting_dtype(vocab_size):
    """The narrowest token dtype Megatron-LM uses for a vocabulary: uint16 below 65500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def idx_path(path_prefix):
    return path_prefix + ".idx"


def bin_path(path_prefix):
    return path_prefix + ".bin"


def dataset_exists(path_prefix):
    """Whether both files of the dataset exist (the builder renames the .idx last)."""
    return os.path.isfile(idx_path(path_prefix)) and os.path.isfile(bin_path(path_prefix))


def dtype_code(dtype):
    """Megatron's uint8 code for a numpy dtype."""
    dtype = np.dtype(dtype)
    if dtype not in CODE_OF_DTYPE:
        raise ValueError(f"dtype {dtype} has no Megatron indexed-dataset code; use one of "
                         f"{sorted(str(d) for d in CODE_OF_DTYPE)}")
    return CODE_OF_DTYPE[dtype]


# ---------------------------------------------------------------------------------------------- reading


def _expected_index_bytes(sequence_count, document_count):
    return _HEADER.size + sequence_count * (4 + 8) + document_count * 8


def read_index_header(path):
    """(dtype, sequence count, document count) from an .idx file, after checking magic, version, dtype
    code and that the file size matches the counts."""
    if not os.path.isfile(path):
        raise IndexedDatasetError(f"index file not found: {path}")
    with open(path, "rb") as stream:
        raw = stream.read(_HEADER.size)
    magic = raw[:len(INDEX_MAGIC)]
    if magic != INDEX_MAGIC[:len(magic)]:
        raise IndexedDatasetError(f"{path} is not a Megatron MMIDIDX index: it starts with "
                                  f"{magic!r}, expected {INDEX_MAGIC!r}")
    if len(raw) < _HEADER.size:
        raise IndexedDatasetError(f"{path} is truncated: {len(raw)} bytes, shorter than the "
                                  f"{_HEADER.size}-byte header")
    _, version, code, sequence_count, document_count = _HEADER.unpack(raw)
    if version != INDEX_VERSION:
        raise IndexedDatasetError(f"{path} has index version {version}; only version {INDEX_VERSION} "
                                  f"is supported")
    if code not in DTYPE_OF_CODE:
        raise IndexedDatasetError(f"{path} has unknown dtype code {code}; known codes are "
                                  f"{sorted(DTYPE_OF_CODE)}")
    actual, expected = os.path.getsize(path), _expected_index_bytes(sequence_count, document_count)
    if actual != expected:
        raise IndexedDatasetError(
            f"{path} is {actual} bytes but its header ({sequence_count} sequences, {document_count} "
            f"document indices) needs {expected}: the file is {'truncated' if actual < expected else 'too long'}")
    return np.dtype(DTYPE_OF_CODE[code]), sequence_count, document_count


class _Index:
    """The three arrays of an .idx file, as read-only views of a memory map."""

    def __init__(self, path):
        self.dtype, sequence_count, document_count = read_index_header(path)
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r")
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(self._mmap, np.int32, sequence_count, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(self._mmap, np.int64, sequence_count, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(self._mmap, np.int64, document_count, offset)
        self._check_document_bounds(path)

    def _check_document_bounds(self, path):
        indices, count = self.document_indices, len(self.sequence_lengths)
        if len(indices) == 0 or indices[0] != 0 or indices[-1] != count:
            first, last = (indices[0], indices[-1]) if len(indices) else (None, None)
            raise IndexedDatasetError(f"{path}: document indices must run from 0 to the sequence count "
                                      f"{count}; they run from {first} to {last}")

    def data_bytes(self):
        """Bytes of .bin the index addresses: the end of the last sequence (the sum of lengths x itemsize
        for a file written sequentially, as every Megatron writer does)."""
        if len(self.sequence_lengths) == 0:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize


def _map_tokens(path, expected_bytes):
    """A read-only uint8 memory map of the .bin, after checking that its size matches the index."""
    if not os.path.isfile(path):
        raise IndexedDatasetError(f"data file not found: {path}")
    actual = os.path.getsize(path)
    if actual != expected_bytes:
        raise IndexedDatasetError(f"{path} is {actual} bytes but its index addresses {expected_bytes}: "
                                  f"the file is {'truncated' if actual < expected_bytes else 'too long'}")
    if actual == 0:
        return np.empty(0, dtype=np.uint8)  # an empty file cannot be memory mapped
    return np.memmap(path, dtype=np.uint8, mode="r")


class IndexedDataset:
    """A Megatron MMIDIDX dataset opened by its path prefix (the path without .bin/.idx).

    dataset[i] and dataset.get(i, offset, length) return read-only numpy views of the memory-mapped .bin;
    dataset[a:b] returns a list of them. Picklable: a copy reopens the files by prefix.
    """

    def __init__(self, path_prefix):
        self.path_prefix = str(path_prefix)
        self._index = _Index(idx_path(self.path_prefix))
        self._bin = _map_tokens(bin_path(self.path_prefix), self._index.data_bytes())

    def __getstate__(self):
        return self.path_prefix

    def __setstate__(self, path_prefix):
        self.__init__(path_prefix)

    def __len__(self):
        return len(self._index.sequence_lengths)

    @property
    def dtype(self):
        return self._index.dtype

    @property
    def sequence_lengths(self):
        return self._index.sequence_lengths

    @property
    def sequence_pointers(self):
        return self._index.sequence_pointers

    @property
    def document_indices(self):
        return self._index.document_indices

    @property
    def document_count(self):
        return len(self._index.document_indices) - 1

    def _tokens_at(self, byte_offset, count):
        return np.frombuffer(self._bin, dtype=self.dtype, count=count, offset=byte_offset)

    def _sequence_index(self, idx):
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"sequence index must be an integer, got {type(idx).__name__}")
        position = int(idx) + len(self) if idx < 0 else int(idx)
        if not 0 <= position < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences in {self.path_prefix}")
        return position

    def get(self, idx, offset=0, length=None):
        """Tokens [offset, offset + length) of sequence idx (to its end when length is None)."""
        position = self._sequence_index(idx)
        sequence_length = int(self.sequence_lengths[position])
        length = sequence_length - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {idx} of length "
                             f"{sequence_length} in {self.path_prefix}")
        start = int(self.sequence_pointers[position]) + offset * self.dtype.itemsize
        return self._tokens_at(start, length)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return self._get_contiguous(idx)
        return self.get(idx)

    def _get_contiguous(self, index_slice):
        start, stop, step = index_slice.indices(len(self))
        if step != 1:
            raise ValueError(f"slices of an indexed dataset must be contiguous, got step {step}")
        if start >= stop:
            return []
        lengths = self.sequence_lengths[start:stop]
        tokens = self._tokens_at(int(self.sequence_pointers[start]), int(lengths.sum(dtype=np.int64)))
        return np.split(tokens, np.cumsum(lengths[:-1], dtype=np.int64))


# ---------------------------------------------------------------------------------------------- writing


def write_index(path, dtype, sequence_lengths, document_indices):
    """Write an .idx; the sequence pointers are the running byte offsets of the lengths."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    documents = np.asarray(document_indices, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    with open(path, "wb") as stream:
        stream.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, dtype_code(dtype), len(lengths), len(documents)))
        for part in (lengths, pointers, documents):
            stream.write(part.tobytes())


def _partial_path(path):
    return f"{path}.partial"


class IndexedDatasetBuilder:
    """Writes a Megatron MMIDIDX dataset: tokens stream to `<bin_path>.partial`; `finalize(idx_path)` writes
    the index and renames both files (.bin first, .idx last), so an interrupted run leaves no pair of
    files that looks complete. Use as a context manager to delete the partial files on an exception.
    """

    def __init__(self, bin_path, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self.bin_path = str(bin_path)
        self._bin = open(_partial_path(self.bin_path), "wb")
        self._sequence_lengths = array.array("i")
        self._document_indices = array.array("q", [0])
        self._partial_idx = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is not None:
            self.abort()

    def _as_tokens(self, tokens):
        values = np.asarray(tokens)
        if values.dtype == self.dtype:
            return values.ravel()
        if values.size and values.dtype.kind in "iub" and self.dtype.kind in "iu":
            limits = np.iinfo(self.dtype)
            low, high = values.min(), values.max()
            if low < limits.min or high > limits.max:
                raise ValueError(f"token values in [{low}, {high}] do not fit dtype {self.dtype}")
        return values.astype(self.dtype).ravel()

    def add_item(self, tokens):
        """Append one sequence to the current document (close it with end_document)."""
        values = self._as_tokens(tokens)
        if values.size > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {values.size} tokens does not fit the int32 length field")
        self._bin.write(values.tobytes())
        self._sequence_lengths.append(values.size)

    def end_document(self):
        """Close the current document: the sequences added since the last one."""
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(self, tokens, lengths=None):
        """Append one document: one sequence, or len(lengths) sequences of those lengths (Megatron's form)."""
        if lengths is None:
            self.add_item(tokens)
        else:
            self._add_sequences(self._as_tokens(tokens), lengths)
        self.end_document()

    def add_documents(self, tokens, document_lengths):
        """Append many one-sequence documents at once: `tokens` is their concatenation."""
        first = len(self._sequence_lengths)
        self._add_sequences(self._as_tokens(tokens), document_lengths)
        self._document_indices.extend(range(first + 1, len(self._sequence_lengths) + 1))

    def _add_sequences(self, values, lengths):
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.sum() != values.size:
            raise ValueError(f"sequence lengths sum to {lengths.sum()} but {values.size} tokens were given")
        self._bin.write(values.tobytes())
        self._sequence_lengths.frombytes(lengths.astype(np.int32).tobytes())

    def add_index(self, path_prefix):
        """Append every document of the dataset at path_prefix (same dtype required), for merging."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"cannot append {idx_path(path_prefix)} (dtype {other.dtype}) to "
                                      f"{self.bin_path} (dtype {self.dtype}): the dtypes differ")
        first = len(self._sequence_lengths)
        self._sequence_lengths.frombytes(np.ascontiguousarray(other.sequence_lengths).tobytes())
        self._document_indices.frombytes((other.document_indices[1:] + first).tobytes())
        with open(bin_path(path_prefix), "rb") as source:
            shutil.copyfileobj(source, self._bin, length=16 << 20)

    def finalize(self, idx_path):
        """Write the index next to the data and move both to their final names."""
        self._bin.close()
        idx_path = str(idx_path)
        self._partial_idx = _partial_path(idx_path)
        write_index(self._partial_idx, self.dtype, np.frombuffer(self._sequence_lengths, np.int32),
                    np.frombuffer(self._document_indices, np.int64))
        if os.path.exists(idx_path):
            os.remove(idx_path)  # never pair an old index with the new data
        os.replace(_partial_path(self.bin_path), self.bin_path)
        os.replace(_partial_path(idx_path), idx_path)

    def abort(self):
        """Close and delete the partial data file; nothing is left under the final names."""
        self._bin.close()
        for path in (_partial_path(self.bin_path), self._partial_idx):
            if path is not None and os.path.exists(path):
                os.remove(path)
