"""A weighted blend of datasets, Megatron-LM style: a fixed greedy interleaving, not random draws.

Sample i of the blend comes from the dataset whose share of the first i samples lags its weight the
most, so every prefix of the blend holds each dataset within one sample of weight x length.
"""
import math

import numpy as np

from megatron_ds.data import index_helpers

FORMAT_VERSION = 1
INDEX_NAMES = ("dataset_index", "dataset_sample_index")
# Megatron asks each dataset for 0.5% more samples than its weight's share, so that the blend never
# runs a dataset dry.
SAMPLE_MARGIN = 1.005


def parse_data_path(values):
    """`--data-path` values as (prefixes, normalised weights): either one prefix (weight 1.0) or pairs
    WEIGHT PREFIX WEIGHT PREFIX ..."""
    values = values.split() if isinstance(values, str) else list(values)
    usage = "--data-path takes one PREFIX or pairs WEIGHT PREFIX [WEIGHT PREFIX ...]"
    if len(values) == 0:
        raise ValueError(f"{usage}; got nothing")
    if len(values) == 1:
        return [values[0]], [1.0]
    if len(values) % 2:
        raise ValueError(f"{usage}; got {len(values)} values: {' '.join(values)}")
    weights = [_parse_weight(raw, values) for raw in values[0::2]]
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"--data-path weights sum to {total}; at least one must be positive "
                         f"(got {' '.join(values)})")
    return [prefix.strip() for prefix in values[1::2]], [w / total for w in weights]


def _parse_weight(raw, values):
    try:
        weight = float(raw)
    except ValueError:
        raise ValueError(f"--data-path weight {raw!r} is not a number; the flag takes pairs WEIGHT PREFIX "
                         f"(got {' '.join(values)})") from None
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"--data-path weight {raw!r} must be finite and >= 0 (got {' '.join(values)})")
    return weight


def blended_samples_per_dataset(weights, num_samples):
    """Samples to build in each dataset of a blend of num_samples: ceil(num_samples x weight x 1.005)."""
    return [int(math.ceil(num_samples * weight * SAMPLE_MARGIN))
            for weight in index_helpers.normalize_weights(weights)]


class BlendedDataset:
    """len(blend) == size; blend[i] is datasets[dataset_index[i]][dataset_sample_index[i]].

    cache_path: where the two index arrays are cached; by default the first dataset's cache_dir. Caching
    needs every dataset to carry a `unique_identity` (as GPTDataset does); otherwise the indices are
    built in memory (fast with the C++ helpers).
    """

    def __init__(self, datasets, weights, size, cache_path=None):
        self.datasets = list(datasets)
        self.weights = index_helpers.normalize_weights(weights)
        if len(self.datasets) != len(self.weights):
            raise ValueError(f"{len(self.datasets)} datasets but {len(self.weights)} weights")
        self.size = int(size)
        self.description = self._describe()
        self.unique_identity = index_helpers.description_hash(self.description)
        self.cache_dir = self._cache_dir(cache_path)
        arrays, self.loaded_from_cache = index_helpers.load_or_build(
            self.cache_dir, f"{self.unique_identity}-BlendedDataset", INDEX_NAMES, self._build_indices,
            self.description, label=f"BlendedDataset ({len(self.datasets)} datasets, {self.size} samples)")
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        self._check_datasets_are_large_enough()

    def _identities(self):
        return [getattr(dataset, "unique_identity", None) for dataset in self.datasets]

    def _describe(self):
        return {"class": "BlendedDataset", "format_version": FORMAT_VERSION, "size": self.size,
                "weights": self.weights.tolist(), "datasets": self._identities()}

    def _cache_dir(self, cache_path):
        if None in self._identities():
            return None
        if cache_path is not None:
            return str(cache_path)
        return getattr(self.datasets[0], "cache_dir", None)

    def _build_indices(self):
        dataset_index, dataset_sample_index = index_helpers.build_blending_indices(self.weights, self.size)
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    def _check_datasets_are_large_enough(self):
        needed = np.bincount(np.asarray(self.dataset_index, dtype=np.int64), minlength=len(self.datasets))
        for number, (dataset, count) in enumerate(zip(self.datasets, needed)):
            if count > len(dataset):
                raise ValueError(f"the blend takes {count} samples from dataset {number} but it has "
                                 f"{len(dataset)}; build it with blended_samples_per_dataset()")

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size}")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]

    def documents_of(self, idx):
        return self.datasets[int(self.dataset_index[idx])].documents_of(int(self.dataset_sample_index[idx]))
