import torch

from megatron_ds.data.mock import MockGPTDataset
from megatron_ds.data.samplers import micro_batch_samples


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
