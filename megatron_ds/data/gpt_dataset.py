"""GPT samples over an indexed dataset, with Megatron-LM's semantics.

The split's documents, each epoch shuffled, form one token stream. Sample i is the seq_length + 1 tokens
starting at stream token i * seq_length: samples cross document boundaries and consecutive ones share a
token (the last label of one is the first input of the next). Three index arrays make this random access:

    document index   int[epochs * documents]   document ids in stream order
    sample index     int[samples + 1, 2]       (position in the document index, offset) of each start
    shuffle index    int[samples]              the order in which samples are served

They are cached as .npy files named by a hash of everything that shapes them. To build once in a job,
construct the dataset on rank 0 first, barrier, then construct it on the other ranks (they load).
"""
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megatron_ds.data import index_helpers

FORMAT_VERSION = 1
SPLIT_NAMES = ("train", "valid", "test")
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
# Megatron: a last epoch that contributes under 80% of an epoch's samples is shuffled on its own, so the
# samples served first come from full epochs.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass
class GPTDatasetConfig:
    seq_length: int
    seed: int
    num_samples: int
    split_name: str = "train"
    data_cache_path: Optional[str] = None  # None: a cache/ folder beside the data

    def __post_init__(self):
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}")
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {self.num_samples}")
        if self.split_name not in SPLIT_NAMES:
            raise ValueError(f"split_name must be one of {SPLIT_NAMES}, got {self.split_name!r}")


class GPTDataset:
    """dataset[i] is an int64 array of seq_length + 1 tokens; len(dataset) >= config.num_samples."""

    def __init__(self, indexed_dataset, document_ids, config, path_prefix):
        self.indexed_dataset = indexed_dataset
        self.document_ids = _checked_document_ids(document_ids, len(indexed_dataset))
        self.config = config
        self.path_prefix = str(path_prefix)
        self.description = describe(indexed_dataset, self.document_ids, config, self.path_prefix)
        self.unique_identity = index_helpers.description_hash(self.description, self.document_ids)
        self.cache_dir = cache_directory(config, self.path_prefix)
        arrays, self.loaded_from_cache = index_helpers.load_or_build(
            self.cache_dir, self._cache_stem(), INDEX_NAMES, self._build_indices, self.description,
            label=f"GPTDataset {config.split_name} ({self.path_prefix}, {config.num_samples} samples)")
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    @staticmethod
    def is_built(indexed_dataset, document_ids, config, path_prefix):
        """Whether the indices for these arguments are already in the cache."""
        document_ids = _checked_document_ids(document_ids, len(indexed_dataset))
        identity = index_helpers.description_hash(
            describe(indexed_dataset, document_ids, config, str(path_prefix)), document_ids)
        return index_helpers.is_cached(cache_directory(config, str(path_prefix)),
                                       _cache_stem(identity, config.split_name), INDEX_NAMES)

    def _cache_stem(self):
        return _cache_stem(self.unique_identity, self.config.split_name)

    def _build_indices(self):
        lengths = self.indexed_dataset.sequence_lengths
        plan = plan_epochs(int(self.description["split_tokens"]), self.config.seq_length,
                           self.config.num_samples)
        rng = np.random.RandomState(self.config.seed)
        document_index = build_document_index(self.document_ids, plan.num_epochs, rng)
        sample_index = index_helpers.build_sample_index(lengths, document_index, self.config.seq_length)
        shuffle_index = build_shuffle_index(len(sample_index) - 1, plan.samples_before_final_epoch, rng)
        return {"document_index": document_index, "sample_index": sample_index,
                "shuffle_index": shuffle_index}

    def __len__(self):
        return len(self.shuffle_index)

    def __getitem__(self, idx):
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        sample = int(self.shuffle_index[idx])
        first_position, first_offset = (int(v) for v in self.sample_index[sample])
        last_position, last_offset = (int(v) for v in self.sample_index[sample + 1])
        return np.concatenate(self._pieces(first_position, first_offset, last_position, last_offset)
                              ).astype(np.int64)

    def documents_of(self, idx):
        """{path prefix: [document ids]} of the documents sample idx is cut from."""
        sample = int(self.shuffle_index[idx])
        first, last = int(self.sample_index[sample][0]), int(self.sample_index[sample + 1][0])
        return {self.path_prefix: [int(document) for document in self.document_index[first:last + 1]]}

    def _pieces(self, first_position, first_offset, last_position, last_offset):
        """The token runs of one sample: the end (last_position, last_offset) is inclusive."""
        document = self.document_index
        if first_position == last_position:
            return [self.indexed_dataset.get(int(document[first_position]), first_offset,
                                             last_offset - first_offset + 1)]
        pieces = [self.indexed_dataset.get(int(document[first_position]), first_offset)]
        pieces += [self.indexed_dataset.get(int(document[p])) for p in range(first_position + 1, last_position)]
        pieces.append(self.indexed_dataset.get(int(document[last_position]), 0, last_offset + 1))
        return pieces


def _checked_document_ids(document_ids, num_documents):
    ids = np.asarray(document_ids, dtype=np.int64).ravel()
    if ids.size and (ids.min() < 0 or ids.max() >= num_documents):
        raise ValueError(f"document ids must lie in [0, {num_documents}), got [{ids.min()}, {ids.max()}]")
    return ids


def _cache_stem(identity, split_name):
    return f"{identity}-GPTDataset-{split_name}"


def cache_directory(config, path_prefix):
    if config.data_cache_path is not None:
        return str(config.data_cache_path)
    return os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "cache")


def describe(indexed_dataset, document_ids, config, path_prefix):
    """Everything that shapes the indices (the document ids enter the hash as bytes)."""
    split_tokens = int(np.asarray(indexed_dataset.sequence_lengths)[document_ids].sum(dtype=np.int64))
    return {"class": "GPTDataset", "format_version": FORMAT_VERSION, "path_prefix": path_prefix,
            "split_name": config.split_name, "seq_length": config.seq_length, "seed": config.seed,
            "num_samples": config.num_samples, "num_documents": int(len(document_ids)),
            "split_tokens": split_tokens}


# ---------------------------------------------------------------------------------------- index building


@dataclass
class EpochPlan:
    num_epochs: int
    samples_before_final_epoch: Optional[int]  # None: the final epoch is shuffled with the others


def plan_epochs(tokens_per_epoch, seq_length, num_samples):
    """The fewest epochs whose stream holds num_samples samples, and Megatron's separate-final-epoch
    decision."""
    if tokens_per_epoch <= 0:
        if num_samples == 0:
            return EpochPlan(1, None)
        raise ValueError(f"the split has no tokens; it cannot give {num_samples} samples")
    # sample count of e epochs: (e * tokens_per_epoch - 1) // seq_length
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    if num_epochs == 1:
        return EpochPlan(1, None)
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    from_final_epoch = num_samples - samples_before_final
    separate = from_final_epoch < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)
    return EpochPlan(num_epochs, samples_before_final if separate else None)


def build_document_index(document_ids, num_epochs, rng):
    """The document ids once per epoch, each epoch in its own random order."""
    dtype = np.int32 if len(document_ids) == 0 or document_ids.max() <= np.iinfo(np.int32).max else np.int64
    ids = document_ids.astype(dtype)
    return np.concatenate([rng.permutation(ids) for _ in range(num_epochs)])


def build_shuffle_index(num_samples, samples_before_final_epoch, rng):
    """A permutation of the samples; with a separate final epoch its samples are shuffled among themselves
    and served last."""
    dtype = np.int32 if num_samples <= np.iinfo(np.int32).max else np.int64
    split = num_samples if samples_before_final_epoch is None else samples_before_final_epoch
    first = np.arange(split, dtype=dtype)
    rest = np.arange(split, num_samples, dtype=dtype)
    rng.shuffle(first)
    rng.shuffle(rest)
    return np.concatenate([first, rest])


# ---------------------------------------------------------------------------------------- splits


def parse_split(split_string):
    """'969,30,1' (or '969/30/1', fewer parts padded with 0) as three weights summing to 1."""
    parts = [part.strip() for part in re.split(r"[,/]", str(split_string))]
    if not 1 <= len(parts) <= len(SPLIT_NAMES):
        raise ValueError(f"--split takes up to 3 weights (train,valid,test), got {split_string!r}")
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        raise ValueError(f"--split weights must be numbers, got {split_string!r}") from None
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split weights must be >= 0 and not all 0, got {split_string!r}")
    weights += [0.0] * (len(SPLIT_NAMES) - len(weights))
    return [w / sum(weights) for w in weights]


def split_documents(num_documents, split_string):
    """[(begin, end)] document ranges of train, valid, test, with Megatron's rounding: each boundary is
    the running sum of round(weight * num_documents); the rounding excess comes off every boundary."""
    boundaries = [0]
    for weight in parse_split(split_string):
        boundaries.append(boundaries[-1] + int(round(weight * float(num_documents))))
    excess = boundaries[-1] - num_documents
    boundaries = [boundaries[0]] + [b - excess for b in boundaries[1:]]
    return list(zip(boundaries[:-1], boundaries[1:]))


# ---------------------------------------------------------------------------------------- masks


def get_ltor_masks_and_position_ids(tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss,
                                    with_attention_mask=True):
    """For a [b, s] batch of left-to-right tokens: (attention_mask [b or 1, 1, s, s] bool, True = masked, or None
    when not with_attention_mask (it costs s^2 per sample); loss_mask [b, s] float; position_ids [b, s] long).
    A document ends at (and includes) each eod token; reset_position_ids restarts positions at 0 after it,
    reset_attention_mask stops attention across it, eod_mask_loss gives the eod tokens zero loss."""
    batch, seq = tokens.shape
    is_eod = tokens == eod
    positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, seq)
    attention_mask = None
    if with_attention_mask:
        blocked = ~torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=tokens.device))
        if reset_attention_mask:
            document = torch.cumsum(is_eod, dim=1) - is_eod.long()  # eods strictly before each token
            blocked = blocked | (document.unsqueeze(2) != document.unsqueeze(1))
        attention_mask = blocked.view(-1, 1, seq, seq)

    loss_mask = torch.ones(batch, seq, dtype=torch.float, device=tokens.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    if reset_position_ids:
        after_eod = torch.where(is_eod, positions + 1, torch.zeros_like(positions))
        document_start = torch.zeros_like(positions)
        document_start[:, 1:] = torch.cummax(after_eod, dim=1).values[:, :-1]
        position_ids = positions - document_start
    else:
        position_ids = positions.clone()
    return attention_mask, loss_mask, position_ids
