"""Index arrays of the GPT and blended datasets: how they are built, and how they are cached on disk.

The sample index and the blending index are built by helpers.cpp, compiled at first use with
torch.utils.cpp_extension (ninja, cached under TORCH_EXTENSIONS_DIR). Where it does not build, or when
MEGATRON_DS_NO_CPP_HELPERS=1, a NumPy fallback gives identical arrays.
"""
import functools
import hashlib
import json
import logging
import os
import time
import uuid
import warnings
from array import array

import numpy as np

logger = logging.getLogger(__name__)

DISABLE_CPP_ENV = "MEGATRON_DS_NO_CPP_HELPERS"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers.cpp")
_INT32_MAX = np.iinfo(np.int32).max
_MAX_BLENDED_DATASETS = np.iinfo(np.int16).max


# ---------------------------------------------------------------------------------------- the C++ module


@functools.lru_cache(maxsize=None)
def _compile_helpers():
    try:
        from torch.utils import cpp_extension
        return cpp_extension.load(name="megatron_ds_dataset_helpers", sources=[_SOURCE],
                                  extra_cflags=["-O3", "-ffp-contract=off"], verbose=False)
    except Exception as error:  # no compiler, no ninja, a read-only extensions dir, ...
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        warnings.warn(f"megatron_ds: C++ dataset index helpers did not build ({first_line}); "
                      f"using the slower NumPy fallback")
        return None


def compiled_helpers():
    """The compiled helpers module, or None when disabled by MEGATRON_DS_NO_CPP_HELPERS=1 or unbuildable."""
    if os.environ.get(DISABLE_CPP_ENV) == "1":
        return None
    return _compile_helpers()


def _require_compiled():
    helpers = compiled_helpers()
    if helpers is None:
        raise RuntimeError(f"the C++ dataset helpers are unavailable (disabled by {DISABLE_CPP_ENV}=1 "
                           f"or failed to build)")
    return helpers


def _warn_fallback(what):
    if os.environ.get(DISABLE_CPP_ENV) != "1":
        return  # _compile_helpers already warned why
    warnings.warn(f"megatron_ds: {DISABLE_CPP_ENV}=1, building the {what} with NumPy")


# ---------------------------------------------------------------------------------------- sample index


def available_samples(sequence_lengths, document_index, seq_length):
    """How many samples of seq_length + 1 tokens (overlapping by one) the document index holds."""
    total = int(np.asarray(sequence_lengths)[np.asarray(document_index)].sum(dtype=np.int64))
    return max(total - 1, 0) // seq_length


def sample_index_dtype(document_index):
    """int32 when every (position, offset) fits, else int64; offsets always fit (lengths are int32)."""
    return np.dtype(np.int32) if len(document_index) <= _INT32_MAX else np.dtype(np.int64)


def _sample_index_inputs(sequence_lengths, document_index, seq_length, num_samples):
    sequence_lengths = np.ascontiguousarray(sequence_lengths, dtype=np.int32)
    document_index = np.ascontiguousarray(document_index, dtype=np.int64)
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    if document_index.size and (document_index.min() < 0 or document_index.max() >= len(sequence_lengths)):
        raise ValueError(f"document index values must lie in [0, {len(sequence_lengths)}), got "
                         f"[{document_index.min()}, {document_index.max()}]")
    available = available_samples(sequence_lengths, document_index, seq_length)
    num_samples = available if num_samples is None else int(num_samples)
    if not 0 <= num_samples <= available:
        raise ValueError(f"{num_samples} samples of {seq_length} + 1 tokens requested but the document "
                         f"index holds only {available}")
    return sequence_lengths, document_index, num_samples


def build_sample_index(sequence_lengths, document_index, seq_length, num_samples=None):
    """[num_samples + 1, 2] rows (position in document_index, token offset): sample i spans from row i to
    the token at row i + 1, inclusive (seq_length + 1 tokens). num_samples=None takes all that fit."""
    if compiled_helpers() is None:
        _warn_fallback("sample index")
        return build_sample_index_numpy(sequence_lengths, document_index, seq_length, num_samples)
    return build_sample_index_cpp(sequence_lengths, document_index, seq_length, num_samples)


def build_sample_index_cpp(sequence_lengths, document_index, seq_length, num_samples=None):
    helpers = _require_compiled()
    lengths, documents, num_samples = _sample_index_inputs(sequence_lengths, document_index, seq_length,
                                                           num_samples)
    sample_index = np.empty((num_samples + 1, 2), dtype=sample_index_dtype(documents))
    fill = (helpers.fill_sample_index_int32 if sample_index.dtype == np.int32
            else helpers.fill_sample_index_int64)
    fill(lengths, documents, int(seq_length), sample_index)
    return sample_index


def build_sample_index_numpy(sequence_lengths, document_index, seq_length, num_samples=None):
    """Sample i >= 1 starts at stream token i * seq_length: in the first document position whose running
    end lies beyond it (zero-length documents are thereby skipped); sample 0 starts at (0, 0)."""
    lengths, documents, num_samples = _sample_index_inputs(sequence_lengths, document_index, seq_length,
                                                           num_samples)
    document_ends = np.cumsum(lengths[documents], dtype=np.int64)
    starts = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    positions = np.searchsorted(document_ends, starts, side="right")
    document_starts = document_ends[positions] - lengths[documents[positions]]
    sample_index = np.zeros((num_samples + 1, 2), dtype=sample_index_dtype(documents))
    sample_index[1:, 0] = positions
    sample_index[1:, 1] = starts - document_starts
    return sample_index


# ---------------------------------------------------------------------------------------- blending index


def normalize_weights(weights):
    """Weights as float64 summing to 1, after checking they are finite, non-negative and not all zero."""
    values = np.asarray(weights, dtype=np.float64).ravel()
    if values.size == 0:
        raise ValueError("blend weights are empty")
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(f"blend weights must be finite and >= 0, got {values.tolist()}")
    total = values.sum()
    if total <= 0:
        raise ValueError(f"blend weights sum to {total}; at least one must be positive")
    return values / total


def build_blending_indices(weights, size):
    """(dataset_index int16[size], dataset_sample_index int64[size]) of Megatron's greedy blend: sample i
    is the next unused sample of the dataset that lags its weight the most."""
    if compiled_helpers() is None:
        _warn_fallback("blending index")
        return build_blending_indices_numpy(weights, size)
    return build_blending_indices_cpp(weights, size)


def _blending_inputs(weights, size):
    shares = normalize_weights(weights)
    if len(shares) > _MAX_BLENDED_DATASETS:
        raise ValueError(f"at most {_MAX_BLENDED_DATASETS} datasets can be blended, got {len(shares)}")
    if size < 0:
        raise ValueError(f"blend size must be >= 0, got {size}")
    return shares, int(size)


def build_blending_indices_cpp(weights, size):
    helpers = _require_compiled()
    shares, size = _blending_inputs(weights, size)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    helpers.fill_blending_indices(shares, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


def build_blending_indices_numpy(weights, size):
    """The same greedy loop in plain Python floats, so every tie breaks as in C++. Each pick depends on
    the ones before, which leaves nothing to vectorise: about a microsecond per sample and dataset."""
    shares, size = _blending_inputs(weights, size)
    shares = shares.tolist()
    counts = [0] * len(shares)
    chosen, within = array("h"), array("q")
    for i in range(size):
        progress = float(max(i, 1))
        lags = [share * progress - count for share, count in zip(shares, counts)]
        best = lags.index(max(lags))
        chosen.append(best)
        within.append(counts[best])
        counts[best] += 1
    return (np.frombuffer(chosen, dtype=np.int16).copy(), np.frombuffer(within, dtype=np.int64).copy())


# ---------------------------------------------------------------------------------------- on-disk cache


def description_hash(description, *arrays):
    """sha256 of a JSON-able description plus the bytes of some arrays: the name of a set of cached indices."""
    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode())
    for values in arrays:
        digest.update(np.ascontiguousarray(values).view(np.uint8))  # hashed in place, not copied
    return digest.hexdigest()


def cache_paths(cache_dir, stem, names):
    return {name: os.path.join(cache_dir, f"{stem}-{name}.npy") for name in names}


def is_cached(cache_dir, stem, names):
    return cache_dir is not None and all(map(os.path.isfile, cache_paths(cache_dir, stem, names).values()))


def save_atomically(path, write):
    """write(stream) into a unique temporary file, then rename: readers never see a partial file."""
    temporary = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(temporary, "wb") as stream:
            write(stream)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def load_or_build(cache_dir, stem, names, build, description, label):
    """The arrays `names` (a dict), memory-mapped from cache_dir when all are there, else from build() and
    then saved. cache_dir=None builds in memory. Logs one line: built or loaded, and how long it took.
    Returns (arrays, loaded)."""
    began = time.perf_counter()
    paths = cache_paths(cache_dir, stem, names) if cache_dir is not None else None
    loaded = is_cached(cache_dir, stem, names)
    if loaded:
        arrays = {name: np.load(path, mmap_mode="r") for name, path in paths.items()}
    else:
        arrays = build()
        if paths is not None:
            _save_all(cache_dir, stem, paths, arrays, description)
    where = f" ({cache_dir}/{stem}-*)" if cache_dir is not None else " (not cached)"
    logger.info("%s: %s indices in %.3f s%s", label, "loaded" if loaded else "built",
                time.perf_counter() - began, where)
    return arrays, loaded


def _save_all(cache_dir, stem, paths, arrays, description):
    try:
        os.makedirs(cache_dir, exist_ok=True)
        text = json.dumps(description, indent=2, sort_keys=True).encode()
        save_atomically(os.path.join(cache_dir, f"{stem}-description.json"), lambda stream: stream.write(text))
        for name, path in paths.items():
            save_atomically(path, functools.partial(np.save, arr=arrays[name]))
    except OSError as error:
        warnings.warn(f"megatron_ds: could not cache dataset indices in {cache_dir} ({error}); "
                      f"they are rebuilt on every run")
