import os

import numpy as np
import pytest

from megatron_ds.data import index_helpers
from megatron_ds.data.blended_dataset import BlendedDataset, blended_samples_per_dataset, parse_data_path
from megatron_ds.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_ds.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


@pytest.fixture(scope="module", autouse=True)
def compiled_helpers():
    return index_helpers.compiled_helpers()


def prefix_counts(dataset_index, num_datasets):
    """counts[n - 1, d]: samples of dataset d among the first n of the blend."""
    one_hot = np.zeros((len(dataset_index), num_datasets))
    one_hot[np.arange(len(dataset_index)), dataset_index] = 1
    return np.cumsum(one_hot, axis=0)


def lead_over_weight(weights, size):
    weights = index_helpers.normalize_weights(weights)
    dataset_index, _ = index_helpers.build_blending_indices(weights, size)
    return prefix_counts(dataset_index, len(weights)) - np.arange(1, size + 1)[:, None] * weights


def test_two_datasets_stay_within_one_sample_of_their_weight_on_every_prefix():
    rng = np.random.default_rng(0)
    for weights in [[0.3, 0.7], [0.5, 0.5], [1e-3, 1.0]] + [rng.random(2).tolist() for _ in range(30)]:
        assert np.abs(lead_over_weight(weights, 3000)).max() <= 1


def test_no_dataset_is_ever_a_full_sample_ahead_of_its_weight():
    """The greedy pick takes a dataset only while it lags, so counts stay below weight x n + 1 (hence at
    most ceil(weight x n) samples per dataset). With 3+ datasets one can lag by more than a sample, but
    the leads sum to zero, so never by k - 1."""
    rng = np.random.default_rng(1)
    for _ in range(40):
        k = int(rng.integers(3, 10))
        lead = lead_over_weight(rng.random(k) ** 3, 3000)
        assert lead.max() < 1 and lead.min() > -(k - 1)


def test_blend_follows_the_weights_statistically():
    weights = [0.2, 0.5, 0.3]
    dataset_index, _ = index_helpers.build_blending_indices(weights, 100_000)
    fractions = np.bincount(dataset_index, minlength=3) / 100_000
    np.testing.assert_allclose(fractions, weights, atol=1e-4)
    for window in np.split(dataset_index[:10_000], 10):  # also locally: no long runs of one dataset
        np.testing.assert_allclose(np.bincount(window, minlength=3) / 1000, weights, atol=0.01)


def test_each_dataset_is_read_in_order():
    dataset_index, dataset_sample_index = index_helpers.build_blending_indices([0.25, 0.25, 0.5], 1000)
    for d in range(3):
        np.testing.assert_array_equal(dataset_sample_index[dataset_index == d], np.arange((dataset_index == d).sum()))


def test_getitem_delegates_to_the_chosen_dataset():
    datasets = [[("a", i) for i in range(40)], [("b", i) for i in range(80)]]
    blend = BlendedDataset(datasets, [1, 2], 100)
    assert len(blend) == 100 and blend.cache_dir is None
    assert [blend[i] for i in range(6)] == [("b", 0), ("a", 0), ("b", 1), ("a", 1), ("b", 2), ("b", 3)]
    assert sorted(blend[i] for i in range(100)) == sorted(datasets[0][:34] + datasets[1][:66])
    with pytest.raises(IndexError):
        blend[100]


def test_too_small_a_dataset_is_refused():
    with pytest.raises(ValueError, match="takes 50 samples from dataset 0 but it has 10"):
        BlendedDataset([list(range(10)), list(range(100))], [1, 1], 100)


def write_corpus(path_prefix, seed):
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{path_prefix}.bin", np.uint16)
    for _ in range(30):
        builder.add_document(rng.integers(1, 1000, int(rng.integers(1, 50))))
    builder.finalize(f"{path_prefix}.idx")
    return IndexedDataset(str(path_prefix))


def gpt_datasets(tmp_path, num_samples_each):
    datasets = []
    for number, num_samples in enumerate(num_samples_each):
        prefix = str(tmp_path / f"corpus{number}")
        indexed = write_corpus(prefix, number)
        config = GPTDatasetConfig(seq_length=8, seed=1, num_samples=num_samples)
        datasets.append(GPTDataset(indexed, np.arange(len(indexed)), config, prefix))
    return datasets


def test_blend_of_gpt_datasets_is_cached_beside_them(tmp_path):
    weights, size = [0.3, 0.7], 500
    datasets = gpt_datasets(tmp_path, blended_samples_per_dataset(weights, size))
    built = BlendedDataset(datasets, weights, size)
    loaded = BlendedDataset(datasets, weights, size)
    assert (built.loaded_from_cache, loaded.loaded_from_cache) == (False, True)
    assert built.cache_dir == str(tmp_path / "cache")
    stem = f"{built.unique_identity}-BlendedDataset"
    assert os.path.isfile(os.path.join(built.cache_dir, f"{stem}-dataset_index.npy"))
    for i in range(0, size, 7):
        np.testing.assert_array_equal(built[i], loaded[i])
    reweighted = BlendedDataset(datasets, [0.31, 0.69], size)
    resized = BlendedDataset(datasets, weights, size - 1, cache_path=str(tmp_path / "elsewhere"))
    assert not reweighted.loaded_from_cache and not resized.loaded_from_cache
    assert len({built.unique_identity, reweighted.unique_identity, resized.unique_identity}) == 3
    assert os.listdir(tmp_path / "elsewhere")


def test_samples_per_dataset_has_megatrons_margin():
    assert blended_samples_per_dataset([3, 7], 1000) == [302, 704]  # ceil(1000 x w x 1.005)
    assert blended_samples_per_dataset([1], 10) == [11]


def test_parse_data_path():
    assert parse_data_path(["corpus"]) == (["corpus"], [1.0])
    prefixes, weights = parse_data_path(["0.3", "a", "0.7", "b"])
    assert prefixes == ["a", "b"]
    np.testing.assert_allclose(weights, [0.3, 0.7])
    assert parse_data_path("1 a 3 b") == (["a", "b"], [0.25, 0.75])


@pytest.mark.parametrize("values, message", [
    ([], "got nothing"),
    (["0.3", "a", "0.7"], "got 3 values"),
    (["a", "b"], "weight 'a' is not a number"),
    (["0.5", "a", "x1", "b"], "weight 'x1' is not a number"),
    (["0.5", "a", "-0.1", "b"], "weight '-0.1' must be finite and >= 0"),
    (["nan", "a", "1", "b"], "weight 'nan' must be finite"),
    (["0", "a", "0.0", "b"], "sum to 0.0"),
])
def test_bad_data_paths_name_the_flag_and_values(values, message):
    with pytest.raises(ValueError, match="--data-path") as error:
        parse_data_path(values)
    assert message in str(error.value)


def test_bad_blend_weights_are_refused():
    with pytest.raises(ValueError, match="2 datasets but 3 weights"):
        BlendedDataset([[0], [1]], [1, 1, 1], 1)
    with pytest.raises(ValueError, match="sum to"):
        BlendedDataset([[0], [1]], [0, 0], 1)
