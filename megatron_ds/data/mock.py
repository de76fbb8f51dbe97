"""A deterministic synthetic token stream, so the engine trains before real datasets exist.

Sample i is an arithmetic progression modulo the vocabulary with a start and step drawn from a
generator seeded by (seed, split, i): learnable (the loss falls) and identical for every layout.
"""
import numpy as np
import torch

_SPLIT_OFFSETS = {"train": 0, "valid": 1, "test": 2}


class MockGPTDataset:
    def __init__(self, vocab_size, seq_length, seed, split="train", max_step=8):
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        self.split_offset = _SPLIT_OFFSETS[split]
        self.max_step = max_step

    def documents_of(self, index):
        """Each mock sample is its own document."""
        return {"mock data": [index]}

    def __getitem__(self, index):
        """seq_length + 1 tokens: inputs are [:-1], labels [1:]."""
        rng = np.random.default_rng([self.seed, self.split_offset, index])
        start = rng.integers(self.vocab_size)
        step = rng.integers(1, self.max_step + 1)
        positions = np.arange(self.seq_length + 1, dtype=np.int64)
        return torch.from_numpy((start + step * positions) % self.vocab_size)

