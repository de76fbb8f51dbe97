import logging
import os

import numpy as np
import pytest
import torch

from megatron_ds.data import index_helpers
from megatron_ds.data.gpt_dataset import (GPTDataset, GPTDatasetConfig, get_ltor_masks_and_position_ids,
                                          plan_epochs, split_documents)
from megatron_ds.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


@pytest.fixture(scope="module", autouse=True)
def compiled_helpers():
    """Build (or load) the C++ helpers once for the module."""
    return index_helpers.compiled_helpers()


def write_documents(path_prefix, documents):
    builder = IndexedDatasetBuilder(f"{path_prefix}.bin", np.uint16)
    for tokens in documents:
        builder.add_document(tokens)
    builder.finalize(f"{path_prefix}.idx")
    return IndexedDataset(str(path_prefix))


def random_documents(seed, count, max_length=40, vocab=60000):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, int(rng.integers(0, max_length))) for _ in range(count)]


@pytest.fixture
def corpus(tmp_path):
    documents = random_documents(0, 50)
    prefix = tmp_path / "corpus"
    return write_documents(prefix, documents), documents, str(prefix)


def make(corpus, document_ids=None, cache=None, **config):
    indexed, documents, prefix = corpus
    document_ids = np.arange(len(documents)) if document_ids is None else document_ids
    settings = dict(seq_length=16, seed=1234, num_samples=30, split_name="train")
    settings.update(config)
    return GPTDataset(indexed, document_ids, GPTDatasetConfig(data_cache_path=cache, **settings), prefix)


def reference_samples(dataset, documents):
    """Every sample, unshuffled, cut from a brute-force concatenation of the documents in stream order."""
    stream = np.concatenate([documents[d] for d in dataset.document_index]).astype(np.int64)
    seq_length = dataset.config.seq_length
    count = (len(stream) - 1) // seq_length
    return [stream[i * seq_length: i * seq_length + seq_length + 1] for i in range(count)]


def test_samples_are_windows_of_the_shuffled_document_stream(corpus):
    dataset = make(corpus, num_samples=100)
    expected = reference_samples(dataset, corpus[1])
    assert len(dataset) == len(expected) >= 100
    for i in range(len(dataset)):
        sample = dataset[i]
        assert sample.dtype == np.int64 and sample.shape == (17,)
        np.testing.assert_array_equal(sample, expected[dataset.shuffle_index[i]])
    assert sorted(dataset.shuffle_index) == list(range(len(dataset)))


def test_samples_cross_document_boundaries_and_overlap_by_one_token(corpus):
    dataset = make(corpus)
    spans = dataset.sample_index[1:, 0] - dataset.sample_index[:-1, 0]
    assert spans.max() >= 2
    unshuffled = {int(s): dataset[i] for i, s in enumerate(dataset.shuffle_index)}
    for i in range(len(dataset) - 1):
        assert unshuffled[i][-1] == unshuffled[i + 1][0]


def test_document_index_shuffles_each_epoch_of_the_split(corpus):
    split = np.arange(10, 30)
    dataset = make(corpus, document_ids=split, num_samples=200)
    epochs = len(dataset.document_index) // len(split)
    assert epochs > 1 and len(dataset.document_index) == epochs * len(split)
    for epoch in np.split(np.asarray(dataset.document_index), epochs):
        np.testing.assert_array_equal(np.sort(epoch), split)
    assert not np.array_equal(dataset.document_index[:len(split)], split)


def test_enough_epochs_for_num_samples_and_no_more(corpus):
    indexed, documents, _ = corpus
    tokens = int(indexed.sequence_lengths.sum())
    for num_samples in (1, 50, 123, 400):
        dataset = make(corpus, num_samples=num_samples)
        epochs = len(dataset.document_index) // len(documents)
        assert len(dataset) >= num_samples
        assert epochs == 1 or ((epochs - 1) * tokens - 1) // 16 < num_samples


def test_plan_epochs_separates_a_small_final_epoch():
    assert plan_epochs(1000, 10, 50).num_epochs == 1
    assert plan_epochs(1000, 10, 99).num_epochs == 1
    assert plan_epochs(1000, 10, 100).num_epochs == 2
    small_final = plan_epochs(1000, 10, 110)  # 10 of 99 samples from the final epoch: separate
    assert small_final.num_epochs == 2 and small_final.samples_before_final_epoch == 99
    assert plan_epochs(1000, 10, 190).samples_before_final_epoch is None
    with pytest.raises(ValueError, match="no tokens"):
        plan_epochs(0, 10, 1)


def test_separate_final_epoch_serves_full_epochs_first(corpus):
    indexed = corpus[0]
    per_epoch = (int(indexed.sequence_lengths.sum()) - 1) // 16
    dataset = make(corpus, num_samples=per_epoch + 2)
    before_final = plan_epochs(int(indexed.sequence_lengths.sum()), 16, per_epoch + 2).samples_before_final_epoch
    assert before_final is not None
    assert sorted(dataset.shuffle_index[:before_final]) == list(range(before_final))


def test_same_seed_same_samples_other_seed_other_samples(tmp_path, corpus):
    first = make(corpus, seed=5, cache=str(tmp_path / "a"))
    again = make(corpus, seed=5, cache=str(tmp_path / "b"))
    other = make(corpus, seed=6, cache=str(tmp_path / "c"))
    assert not again.loaded_from_cache
    samples = [np.stack([d[i] for i in range(30)]) for d in (first, again, other)]
    np.testing.assert_array_equal(samples[0], samples[1])
    assert not np.array_equal(samples[0], samples[2])


def test_cache_is_written_then_loaded(corpus, caplog):
    indexed, documents, prefix = corpus
    ids = np.arange(len(documents))
    config = GPTDatasetConfig(seq_length=16, seed=3, num_samples=40, split_name="valid")
    assert not GPTDataset.is_built(indexed, ids, config, prefix)
    with caplog.at_level(logging.INFO, logger="megatron_ds.data.index_helpers"):
        built = GPTDataset(indexed, ids, config, prefix)
        loaded = GPTDataset(indexed, ids, config, prefix)
    assert GPTDataset.is_built(indexed, ids, config, prefix)
    cache_dir = os.path.join(os.path.dirname(prefix), "cache")
    assert built.cache_dir == cache_dir
    names = sorted(os.listdir(cache_dir))
    assert names == sorted(f"{built.unique_identity}-GPTDataset-valid-{kind}" for kind in
                           ("description.json", "document_index.npy", "sample_index.npy", "shuffle_index.npy"))
    assert (built.loaded_from_cache, loaded.loaded_from_cache) == (False, True)
    messages = [record.getMessage() for record in caplog.records]
    assert any("built indices" in m for m in messages) and any("loaded indices" in m for m in messages)
    for i in range(len(built)):
        np.testing.assert_array_equal(built[i], loaded[i])


def test_every_shaping_parameter_changes_the_cache_file(corpus, tmp_path):
    indexed, documents, prefix = corpus
    base = dict(seq_length=16, seed=3, num_samples=40, split_name="train")
    variants = [{}, {"seq_length": 15}, {"seed": 4}, {"num_samples": 41}, {"split_name": "test"}]
    identities = {make(corpus, cache=str(tmp_path), **{**base, **change}).unique_identity for change in variants}
    identities.add(make(corpus, document_ids=np.arange(1, len(documents)), cache=str(tmp_path), **base).unique_identity)
    renamed = write_documents(tmp_path / "other", documents)
    identities.add(make((renamed, documents, str(tmp_path / "other")), cache=str(tmp_path), **base).unique_identity)
    assert len(identities) == len(variants) + 2
    assert len([n for n in os.listdir(tmp_path) if n.endswith("shuffle_index.npy")]) == len(identities)


def test_config_and_document_ids_are_validated(corpus):
    with pytest.raises(ValueError, match="split_name"):
        GPTDatasetConfig(seq_length=8, seed=1, num_samples=1, split_name="eval")
    with pytest.raises(ValueError, match="seq_length"):
        GPTDatasetConfig(seq_length=0, seed=1, num_samples=1)
    with pytest.raises(ValueError, match=r"in \[0, 50\)"):
        make(corpus, document_ids=np.array([0, 50]))
    with pytest.raises(IndexError):
        make(corpus)[10_000]


def test_empty_split_with_no_samples_is_empty(corpus):
    assert len(make(corpus, document_ids=np.array([], dtype=np.int64), num_samples=0)) == 0


@pytest.mark.parametrize("num_documents, split, expected", [
    (1000, "969,30,1", [(0, 969), (969, 999), (999, 1000)]),
    (10, "1,1,1", [(0, 4), (4, 7), (7, 10)]),
    (100, "100", [(0, 100), (100, 100), (100, 100)]),
    (7, "98/2", [(0, 7), (7, 7), (7, 7)]),
    (11, "0.5,0.5", [(0, 5), (5, 11), (11, 11)]),  # round(5.5) = 6 twice: 1 too many, off every boundary
])
def test_split_documents_follows_megatron_rounding(num_documents, split, expected):
    assert split_documents(num_documents, split) == expected


@pytest.mark.parametrize("split", ["a,b", "1,-1", "0,0,0", "1,1,1,1"])
def test_bad_split_strings_name_the_flag(split):
    with pytest.raises(ValueError, match="--split"):
        split_documents(100, split)


EOD = 0


def test_masks_and_position_ids_without_resets():
    tokens = torch.tensor([[5, 6, EOD, 7, 8, EOD]])
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, EOD, False, False, False)
    assert attention_mask.shape == (1, 1, 6, 6) and attention_mask.dtype == torch.bool
    assert torch.equal(attention_mask[0, 0], ~torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    assert torch.equal(loss_mask, torch.ones(1, 6))
    assert torch.equal(position_ids, torch.arange(6).unsqueeze(0))


def test_masks_and_position_ids_reset_at_each_eod():
    tokens = torch.tensor([[5, 6, EOD, 7, 8, EOD, 9],
                           [EOD, 1, 2, 3, EOD, EOD, 4]])
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, EOD, True, True, True)
    assert position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 0, 1, 2, 3, 0, 0]]
    assert loss_mask.tolist() == [[1, 1, 0, 1, 1, 0, 1], [0, 1, 1, 1, 0, 0, 1]]
    assert loss_mask.dtype == torch.float and position_ids.dtype == torch.long
    documents = [[0, 0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 2, 3]]  # an eod closes its own document
    expected = torch.tensor([[[not (k <= q and doc[k] == doc[q]) for k in range(7)] for q in range(7)]
                             for doc in documents]).unsqueeze(1)
    assert attention_mask.shape == (2, 1, 7, 7)
    assert torch.equal(attention_mask, expected)


def test_masks_reset_flags_are_independent():
    tokens = torch.tensor([[5, EOD, 7, 8]])
    mask, _, positions = get_ltor_masks_and_position_ids(tokens, EOD, True, False, False)
    assert positions.tolist() == [[0, 1, 0, 1]]
    assert torch.equal(mask[0, 0], ~torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    mask, _, positions = get_ltor_masks_and_position_ids(tokens, EOD, False, True, False)
    assert positions.tolist() == [[0, 1, 2, 3]]
    assert mask[0, 0, 2].tolist() == [True, True, False, True]
