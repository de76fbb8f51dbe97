import os
import warnings

import numpy as np
import pytest

from megatron_ds.data import index_helpers
from megatron_ds.data.index_helpers import (build_blending_indices_cpp, build_blending_indices_numpy,
                                            build_sample_index_cpp, build_sample_index_numpy)


@pytest.fixture(scope="module")
def compiled():
    """Builds the C++ helpers once (about 10 s cold, then cached under TORCH_EXTENSIONS_DIR)."""
    if os.environ.get(index_helpers.DISABLE_CPP_ENV) == "1":
        pytest.skip(f"{index_helpers.DISABLE_CPP_ENV}=1")
    helpers = index_helpers.compiled_helpers()
    assert helpers is not None, "helpers.cpp did not build; see the warning"
    return helpers


def brute_force_sample_index(lengths, document_index, seq_length, num_samples):
    """(position, offset) of stream token i * seq_length, from a token-by-token expansion of the stream."""
    position_of_token = np.concatenate([np.full(lengths[d], p) for p, d in enumerate(document_index)] + [[]])
    offset_of_token = np.concatenate([np.arange(lengths[d]) for d in document_index] + [[]])
    rows = [(0, 0)] + [(position_of_token[i * seq_length], offset_of_token[i * seq_length])
                       for i in range(1, num_samples + 1)]
    return np.array(rows, dtype=np.int64)


def random_case(rng):
    num_documents = int(rng.integers(1, 40))
    kind = rng.integers(4)
    if kind == 0:
        lengths = rng.integers(0, 6, num_documents)  # mostly shorter than a sample, some empty
    elif kind == 1:
        lengths = rng.integers(1, 300, num_documents)
    elif kind == 2:
        lengths = rng.choice([0, 1, 7, 8, 9, 16, 17], num_documents)  # around seq_length 8
    else:
        lengths = rng.lognormal(3, 1.5, num_documents).astype(int)
    epochs = int(rng.integers(1, 4))
    document_index = np.concatenate([rng.permutation(num_documents) for _ in range(epochs)])
    seq_length = int(rng.choice([1, 2, 8, 16, 33]))
    return lengths.astype(np.int32), document_index, seq_length


EDGE_CASES = {
    "documents_shorter_than_a_sample": ([3, 2, 1, 4, 2, 5, 1, 1, 3], 8),
    "single_huge_document": ([100_000], 2048),
    "zero_length_documents": ([0, 0, 5, 0, 9, 0, 0, 12, 0], 4),
    "exact_boundaries": ([8, 8, 8, 8, 8], 8),
    "boundaries_at_sample_ends": ([9, 8, 8, 8, 8], 8),
    "seq_length_one": ([1, 1, 2, 0, 3], 1),
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_sample_index_edge_cases_agree_with_brute_force(compiled, name):
    lengths, seq_length = EDGE_CASES[name]
    lengths = np.array(lengths, dtype=np.int32)
    document_index = np.arange(len(lengths))
    num_samples = index_helpers.available_samples(lengths, document_index, seq_length)
    assert num_samples > 0
    expected = brute_force_sample_index(lengths, document_index, seq_length, num_samples)
    np.testing.assert_array_equal(build_sample_index_numpy(lengths, document_index, seq_length), expected)
    np.testing.assert_array_equal(build_sample_index_cpp(lengths, document_index, seq_length), expected)


def test_sample_index_cpp_and_numpy_identical_on_random_inputs(compiled):
    rng = np.random.default_rng(1234)
    for _ in range(300):
        lengths, document_index, seq_length = random_case(rng)
        available = index_helpers.available_samples(lengths, document_index, seq_length)
        for num_samples in {None, available // 2}:
            from_numpy = build_sample_index_numpy(lengths, document_index, seq_length, num_samples)
            from_cpp = build_sample_index_cpp(lengths, document_index, seq_length, num_samples)
            assert from_numpy.dtype == from_cpp.dtype == np.int32
            np.testing.assert_array_equal(from_numpy, from_cpp)


def test_sample_index_matches_brute_force_on_random_inputs():
    rng = np.random.default_rng(99)
    for _ in range(100):
        lengths, document_index, seq_length = random_case(rng)
        available = index_helpers.available_samples(lengths, document_index, seq_length)
        expected = brute_force_sample_index(lengths, document_index, seq_length, available)
        np.testing.assert_array_equal(build_sample_index_numpy(lengths, document_index, seq_length), expected)


def test_sample_index_rejects_too_many_samples_and_bad_document_ids(compiled):
    lengths = np.array([5, 5], dtype=np.int32)
    for build in (build_sample_index_numpy, build_sample_index_cpp):
        assert len(build(lengths, [0, 1], 3)) == 4  # (10 - 1) // 3 samples
        with pytest.raises(ValueError, match="holds only 3"):
            build(lengths, [0, 1], 3, num_samples=4)
        with pytest.raises(ValueError, match=r"in \[0, 2\)"):
            build(lengths, [0, 2], 3)
        with pytest.raises(ValueError, match="seq_length"):
            build(lengths, [0, 1], 0)


def test_sample_index_dtype_widens_past_int32():
    assert index_helpers.sample_index_dtype(range(10)) == np.int32
    assert index_helpers.sample_index_dtype(range(2**31 + 1)) == np.int64


def test_blending_cpp_and_numpy_identical(compiled):
    rng = np.random.default_rng(7)
    cases = [[1.0], [0.5, 0.5], [1, 1, 1], [0.3, 0.0, 0.7], [1e-6, 1.0], rng.random(50).tolist()]
    cases += [rng.random(int(rng.integers(2, 6))).tolist() for _ in range(20)]
    for weights in cases:
        size = int(rng.integers(0, 3000))
        dataset_index, sample_index = build_blending_indices_numpy(weights, size)
        assert dataset_index.dtype == np.int16 and sample_index.dtype == np.int64
        cpp_index, cpp_sample_index = build_blending_indices_cpp(weights, size)
        np.testing.assert_array_equal(dataset_index, cpp_index)
        np.testing.assert_array_equal(sample_index, cpp_sample_index)


def test_bad_blend_weights_are_refused():
    for weights, message in [([], "empty"), ([0, 0], "sum to"), ([1, -1], ">= 0"), ([1, float("nan")], "finite")]:
        with pytest.raises(ValueError, match=message):
            build_blending_indices_numpy(weights, 10)


def test_disabling_the_helpers_falls_back_with_a_warning(compiled, monkeypatch):
    lengths, document_index = np.array([7, 3, 11, 2], dtype=np.int32), np.array([2, 0, 3, 1])
    expected = build_sample_index_cpp(lengths, document_index, 4)
    monkeypatch.setenv(index_helpers.DISABLE_CPP_ENV, "1")
    assert index_helpers.compiled_helpers() is None
    with pytest.warns(UserWarning, match=index_helpers.DISABLE_CPP_ENV):
        np.testing.assert_array_equal(index_helpers.build_sample_index(lengths, document_index, 4), expected)
    with pytest.warns(UserWarning, match=index_helpers.DISABLE_CPP_ENV):
        index_helpers.build_blending_indices([1, 2], 5)
    with pytest.raises(RuntimeError, match="unavailable"):
        build_sample_index_cpp(lengths, document_index, 4)


def test_dispatch_uses_the_compiled_helpers_quietly(compiled):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        index_helpers.build_sample_index(np.array([5, 5], dtype=np.int32), [0, 1], 2)
        index_helpers.build_blending_indices([1, 2], 5)
    assert index_helpers.compiled_helpers() is compiled


def test_save_atomically_leaves_no_temporary_file(tmp_path):
    path = str(tmp_path / "a.npy")
    index_helpers.save_atomically(path, lambda stream: np.save(stream, np.arange(3)))
    np.testing.assert_array_equal(np.load(path), np.arange(3))

    def write_half_then_fail(stream):
        stream.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        index_helpers.save_atomically(str(tmp_path / "b.npy"), write_half_then_fail)
    assert sorted(os.listdir(tmp_path)) == ["a.npy"]


def test_a_failed_build_warns_once_and_falls_back(compiled, monkeypatch):
    from torch.utils import cpp_extension

    def no_compiler(**_):
        raise RuntimeError("Error building extension\nlong compiler log")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    index_helpers._compile_helpers.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"did not build \(Error building extension\); using"):
            assert index_helpers.compiled_helpers() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(index_helpers.build_sample_index(np.array([9], dtype=np.int32), [0], 4)) == 3
    finally:
        index_helpers._compile_helpers.cache_clear()
