from itertools import islice

import numpy as np
import pytest
import torch

from megatron_ds.data import index_helpers
from megatron_ds.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_ds.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_ds.data.mock import MockGPTDataset
from megatron_ds.data.samplers import micro_batch_samples

MICRO_BATCH, DP, STEPS = 2, 2, 12


def test_mock_samples_are_deterministic_and_splits_differ():
    train = MockGPTDataset(vocab_size=100, seq_length=16, seed=3)
    assert torch.equal(train[5], MockGPTDataset(100, 16, 3)[5])
    assert train[5].shape == (17,) and int(train[5].max()) < 100
    assert not torch.equal(train[5], MockGPTDataset(100, 16, 3, split="valid")[5])
    assert not torch.equal(train[5], train[6])


def test_data_parallel_ranks_split_each_step_of_the_global_batch():
    dataset = MockGPTDataset(vocab_size=100, seq_length=8, seed=1)
    single = micro_batch_samples(dataset, 0, micro_batch_size=4, data_parallel_rank=0, data_parallel_size=1)
    halves = [micro_batch_samples(dataset, 0, 2, rank, 2) for rank in range(2)]
    for _ in range(3):
        assert torch.equal(next(single), torch.cat([next(half) for half in halves]))


def test_start_from_consumed_samples():
    dataset = MockGPTDataset(vocab_size=100, seq_length=8, seed=1)
    from_zero = micro_batch_samples(dataset, 0, 2, 0, 1)
    next(from_zero)
    assert torch.equal(next(from_zero), next(micro_batch_samples(dataset, 2, 2, 0, 1)))


@pytest.fixture(scope="module")
def gpt_dataset(tmp_path_factory):
    """A real GPTDataset (shuffled windows of an indexed corpus), enough samples for every test here."""
    index_helpers.compiled_helpers()
    prefix = str(tmp_path_factory.mktemp("corpus") / "corpus")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(60):
        builder.add_document(rng.integers(1, 60000, int(rng.integers(1, 40))))
    builder.finalize(f"{prefix}.idx")
    config = GPTDatasetConfig(seq_length=16, seed=1234, num_samples=120, split_name="train")
    return GPTDataset(IndexedDataset(prefix), np.arange(60), config, prefix)


def first_micro_batches(dataset, consumed_samples, rank, num_workers):
    return list(islice(micro_batch_samples(dataset, consumed_samples, MICRO_BATCH, rank, DP, num_workers), STEPS))


def indexed_micro_batch(dataset, consumed_samples, rank, step):
    """Rank `rank`'s share of step `step` of micro_batch_size x DP consecutive samples, by direct indexing."""
    first = consumed_samples + step * MICRO_BATCH * DP + rank * MICRO_BATCH
    return torch.stack([torch.from_numpy(dataset[i].astype(np.int64)) for i in range(first, first + MICRO_BATCH)])


@pytest.mark.parametrize("consumed_samples", [0, 22])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_reads_each_ranks_samples_in_order(gpt_dataset, consumed_samples, num_workers):
    for rank in range(DP):
        batches = first_micro_batches(gpt_dataset, consumed_samples, rank, num_workers)
        assert all(batch.dtype == torch.long and batch.shape == (MICRO_BATCH, 17) for batch in batches)
        for step, batch in enumerate(batches):
            assert torch.equal(batch, indexed_micro_batch(gpt_dataset, consumed_samples, rank, step)), (rank, step)


def test_reading_with_workers_leaves_the_global_rng_untouched(gpt_dataset):
    """Training's dropout masks and the bitwise-exact resume depend on the global RNG state."""
    torch.manual_seed(7)
    before = torch.get_rng_state()
    for num_workers in (0, 2):
        first_micro_batches(gpt_dataset, 0, 1, num_workers)
    assert torch.equal(torch.get_rng_state(), before)
