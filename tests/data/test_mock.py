import torch

from megatron_ds.data.mock import MockGPTDataset, micro_batches


def test_samples_are_deterministic_and_splits_differ():
    train = MockGPTDataset(vocab_size=100, seq_length=16, seed=3)
    assert torch.equal(train[5], MockGPTDataset(100, 16, 3)[5])
    assert train[5].shape == (17,) and int(train[5].max()) < 100
    assert not torch.equal(train[5], MockGPTDataset(100, 16, 3, split="valid")[5])
    assert not torch.equal(train[5], train[6])


def test_data_parallel_ranks_split_each_step_of_the_global_batch():
    dataset = MockGPTDataset(vocab_size=100, seq_length=8, seed=1)
    single = micro_batches(dataset, 0, micro_batch_size=4, data_parallel_rank=0, data_parallel_size=1)
    halves = [micro_batches(dataset, 0, 2, rank, 2) for rank in range(2)]
    for _ in range(3):
        inputs, labels = next(single)
        parts = [next(h) for h in halves]
        assert torch.equal(inputs, torch.cat([p[0] for p in parts]))
        assert torch.equal(labels, torch.cat([p[1] for p in parts]))
        assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_start_from_consumed_samples():
    dataset = MockGPTDataset(vocab_size=100, seq_length=8, seed=1)
    from_zero = micro_batches(dataset, 0, 2, 0, 1)
    next(from_zero)
    assert torch.equal(next(from_zero)[0], next(micro_batches(dataset, 2, 2, 0, 1))[0])
