"""Megatron's pretraining sampler: the global sample position is the data position."""
import os

import numpy as np
import torch


class MicroBatchSampler:
    """Megatron's MegatronPretrainingSampler: endless lists of the dataset indices of this data-parallel rank's
    micro-batches, from the global sample position `consumed_samples`. Each step of micro_batch_size x DP
    consecutive samples is split between the data-parallel ranks, so restarting at any position repeats the
    uninterrupted run."""

    def __init__(self, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size):
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    def __iter__(self):
        position = self.consumed_samples
        while True:
            first = position + self.data_parallel_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))
            position += self.micro_batch_size * self.data_parallel_size


def collate_tokens(samples):
    """Samples of seq_length + 1 token ids (numpy arrays or tensors) -> a torch.long [len(samples), seq_length + 1]."""
    return torch.stack([torch.as_tensor(np.asarray(sample), dtype=torch.long) for sample in samples])


def _out_of_the_launchers_process_group(worker_id):
    """A worker leaves the training process's process group: a launcher that signals the whole group (SIGTERM)
    must reach the training process's handler (--exit-signal-handler: finish the iteration, save, exit), not
    kill the workers under it, which the DataLoader would report as a crash. A worker still ends with the
    training process: the DataLoader shuts it down, or it sees its parent gone."""
    os.setpgrp()


def micro_batch_loader(dataset, sampler, num_workers=0):
    """A DataLoader reading the micro-batches of `sampler` in order, in num_workers processes (0: in this one)."""
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate_tokens, num_workers=num_workers,
        worker_init_fn=_out_of_the_launchers_process_group,
        persistent_workers=False, pin_memory=torch.cuda.is_available(),
        # its own generator: starting an iterator draws the workers' base seed from it, and drawing from the
        # global RNG would shift training's dropout masks and break the bitwise-exact resume
        generator=torch.Generator())


def micro_batch_samples(dataset, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size,
                        num_workers=0):
    """Endless [micro_batch_size, seq_length + 1] token batches for this data-parallel rank, starting at the
    global sample position `consumed_samples` (see MicroBatchSampler). Lazy: the DataLoader and its workers
    start at the first next()."""
    sampler = MicroBatchSampler(consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
    yield from micro_batch_loader(dataset, sampler, num_workers)
