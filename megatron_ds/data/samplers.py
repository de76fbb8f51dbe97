"""Megatron's pretraining sampler: the global sample position is the data position."""
import numpy as np
import torch


def micro_batch_samples(dataset, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size):
    """Endless [micro_batch_size, seq_length + 1] token batches for this data-parallel rank, starting at the
    global sample position `consumed_samples`. Each step of micro_batch_size x DP consecutive samples is
    split between the data-parallel ranks, so restarting at any position repeats the uninterrupted run."""
    position = consumed_samples
    while True:
        first = position + data_parallel_rank * micro_batch_size
        yield torch.stack([torch.as_tensor(np.asarray(dataset[i]), dtype=torch.long)
                           for i in range(first, first + micro_batch_size)])
        position += micro_batch_size * data_parallel_size
