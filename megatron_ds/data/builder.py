"""From the data flags to each rank's micro-batch iterators.

Sources: --mock-data; --data-path (one prefix, or weighted prefixes blended) split by --split; or
--train-data-path / --valid-data-path / --test-data-path. Indices are built by rank 0 first (cached
under --data-cache-path), then loaded by the other ranks that read data: only the first pipeline
stage (inputs) and the last (labels) do.
"""
import numpy as np
import torch.distributed as dist

from megatron_ds.core import parallel_state, sequence_split
from megatron_ds.core.models.gpt import pack_model_inputs
from megatron_ds.data.blended_dataset import BlendedDataset, blended_samples_per_dataset, parse_data_path
from megatron_ds.data.gpt_dataset import (GPTDataset, GPTDatasetConfig, get_ltor_masks_and_position_ids,
                                          parse_split, split_documents)
from megatron_ds.data.indexed_dataset import IndexedDataset, IndexedDatasetError, idx_path
from megatron_ds.data.mock import MockGPTDataset
from megatron_ds.data.samplers import micro_batch_samples

SPLITS = ("train", "valid", "test")


def samples_per_split(data):
    """Samples each split must provide for the whole run (Megatron's accounting)."""
    evaluations = (data.train_iters // data.eval_interval + 1) if data.eval_interval and data.eval_iters else 0
    return {"train": data.train_iters * data.global_batch_size,
            "valid": evaluations * data.eval_iters * data.global_batch_size,
            "test": data.eval_iters * data.global_batch_size}


def _gpt_dataset(data, prefix, document_ids, split, num_samples):
    config = GPTDatasetConfig(seq_length=data.seq_length, seed=data.seed, num_samples=num_samples,
                              split_name=split, data_cache_path=data.data_cache_path)
    return GPTDataset(IndexedDataset(prefix), document_ids, config, prefix)


def _blend(data, split, weighted_prefixes, num_samples, documents_of):
    """One GPTDataset per prefix (documents_of(prefix) picks its documents), blended by weight."""
    prefixes, weights = weighted_prefixes
    counts = blended_samples_per_dataset(weights, num_samples) if len(prefixes) > 1 else [num_samples]
    datasets = [_gpt_dataset(data, prefix, documents_of(prefix), split, count)
                for prefix, count in zip(prefixes, counts)]
    if len(datasets) == 1:
        return datasets[0]
    return BlendedDataset(datasets, weights, num_samples, cache_path=data.data_cache_path)


def _source_flag(data, split):
    """The flag naming a split's datasets: --data-path (every split's, cut by --split), else
    --{split}-data-path; None for mock data or a split without a path."""
    if data.mock_data:
        return None
    if data.data_path:
        return "--data-path"
    return f"--{split}-data-path" if getattr(data, f"{split}_data_path") else None


def _weighted_prefixes(data, flag):
    return parse_data_path(getattr(data, flag[2:].replace("-", "_")))


def _document_range(data, split, dataset):
    """(begin, end): the split's documents of an indexed dataset, --split's share with --data-path, else all."""
    if data.data_path:
        return split_documents(len(dataset), data.split)[SPLITS.index(split)]
    return 0, len(dataset)


def _split_document_ids(data, split, prefix):
    return np.arange(*_document_range(data, split, IndexedDataset(prefix)), dtype=np.int64)


def build_split_dataset(data, split, num_samples):
    """The dataset of one split, or None when no samples are wanted, it has no source, or its share of a source
    is empty (data_problems refuses that before training for the splits training reads)."""
    if num_samples == 0:
        return None
    if data.mock_data:
        return MockGPTDataset(data.vocab_size, data.seq_length, data.seed, split)
    flag = _source_flag(data, split)
    if flag is None:
        return None
    prefixes, weights = _weighted_prefixes(data, flag)
    if any(begin == end for begin, end in (_document_range(data, split, IndexedDataset(p)) for p in prefixes)):
        return None
    return _blend(data, split, (prefixes, weights), num_samples,
                  lambda prefix: _split_document_ids(data, split, prefix))


def has_validation_data(data):
    """Decided from the flags alone, so every rank (data readers or not) agrees on whether to evaluate."""
    if data.mock_data or data.valid_data_path:
        return True
    return bool(data.data_path) and parse_split(data.split)[SPLITS.index("valid")] > 0


def will_evaluate(data):
    """Whether training evaluates: --eval-iters, an --eval-interval within --train-iters, and validation data."""
    return bool(data.eval_iters and data.eval_interval and data.eval_interval <= data.train_iters
                and has_validation_data(data))


# --- checked before training --------------------------------------------------------------------------

_SPLIT_WORDS = {"train": "training", "valid": "validation"}


def data_problems(data):
    """Why the data cannot feed this run, found from the datasets' indices before anything is built; [] when it
    can. A damaged or inconsistent .idx/.bin pair is one problem naming the file. The training split must hold
    tokens: a GPT dataset repeats its split in epochs, so any non-empty one gives every sample asked for. When
    training evaluates, so must the validation split, with at least one evaluation's samples (fewer would repeat
    samples within an evaluation). The test split is not read in training."""
    problems = _split_problems(data, "train", None)
    if will_evaluate(data):
        problems += _split_problems(data, "valid", data.eval_iters * data.global_batch_size)
    return list(dict.fromkeys(problems))  # a damaged file is found by each split


def _split_problems(data, split, samples_per_evaluation):
    flag = _source_flag(data, split)
    if flag is None:  # mock data: endless; a split without a path is not read
        return []
    problems, samples, parts = [], 0, []
    for prefix in _weighted_prefixes(data, flag)[0]:
        try:
            dataset = IndexedDataset(prefix)
        except (IndexedDatasetError, OSError) as error:  # OSError: an unreadable file, named by the error
            problems.append(str(error))
            continue
        if len(dataset) == 0:
            problems.append(f"{flag} {prefix} holds no documents: {idx_path(prefix)} indexes none")
            continue
        begin, end = _document_range(data, split, dataset)
        tokens = int(dataset.sequence_lengths[begin:end].sum(dtype=np.int64))
        share = f"{end - begin} of its {len(dataset)} documents" + (f" (--split {data.split})" if data.data_path
                                                                    else "")
        if tokens == 0:
            problems.append(f"the {_SPLIT_WORDS[split]} split of {flag} {prefix} is empty: {share}, 0 tokens; "
                            f"{_what_reads(data, split)}. {_remedy(data, split)}")
        samples += max(0, (tokens - 1) // data.seq_length)  # GPTDataset's count of one epoch
        parts.append(f"{tokens} tokens in {share} of {flag} {prefix}")
    if samples_per_evaluation and not problems and samples < samples_per_evaluation:
        problems.append(f"the {_SPLIT_WORDS[split]} split has {samples} samples of --seq-length {data.seq_length} "
                        f"({'; '.join(parts)}), but {_what_reads(data, split)}: an evaluation would repeat "
                        f"samples. {_remedy(data, split)}")
    return problems


def _what_reads(data, split):
    if split == "train":
        return (f"training reads {data.train_iters * data.global_batch_size} samples (--train-iters "
                f"{data.train_iters} x --global-batch-size {data.global_batch_size})")
    return (f"each evaluation reads {data.eval_iters * data.global_batch_size} samples (--eval-iters "
            f"{data.eval_iters} x --global-batch-size {data.global_batch_size}, every --eval-interval "
            f"{data.eval_interval} iterations)")


def _remedy(data, split):
    more = (f"a larger {_SPLIT_WORDS[split]} weight in --split {data.split}, or more documents" if data.data_path
            else "more documents")
    if split == "train":
        return f"Give training data: {more}"
    return f"Give it {more}, or pass --eval-iters 0 to train without evaluation"


def _reads_data():
    return parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()


def build_datasets(data):
    """{split: dataset or None} on ranks that read data, built by rank 0 first; {} on the others."""
    wanted = samples_per_split(data)
    datasets = {}
    if dist.get_rank() == 0:
        datasets = {split: build_split_dataset(data, split, wanted[split]) for split in SPLITS}
    dist.barrier()
    if dist.get_rank() != 0 and _reads_data():
        datasets = {split: build_split_dataset(data, split, wanted[split]) for split in SPLITS}
    return datasets


def model_batch(tokens, data, device):
    """tokens [b, s + 1] -> (model inputs, labels) in the form the pipeline engine takes. With Ulysses or context
    parallelism each rank keeps its part of the tokens, labels, loss mask and (global) position ids
    (core/sequence_split.py)."""
    tokens = tokens.to(device, non_blocking=True)  # from the loader's pinned memory: no wait for the copy
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    sliced = sequence_split.is_split()
    if not (data.reset_position_ids or data.reset_attention_mask or data.eod_mask_loss or sliced):
        return input_ids, labels
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        input_ids, data.eod, data.reset_position_ids, data.reset_attention_mask, data.eod_mask_loss,
        with_attention_mask=data.reset_attention_mask)
    if sliced:  # (--reset-attention-mask is refused with Ulysses and CP)
        input_ids, labels, loss_mask, position_ids = (sequence_split.local_part(t) for t in
                                                      (input_ids, labels, loss_mask, position_ids))
    inputs = pack_model_inputs(input_ids, position_ids if data.reset_position_ids or sliced else None,
                               attention_mask if data.reset_attention_mask else None)
    return inputs, ((labels, loss_mask) if data.eod_mask_loss else labels)


def batch_iterator(dataset, data, consumed_samples, device, curriculum=None, replicas_over=0):
    """Endless (inputs, labels) micro-batches of this data-parallel rank from the global sample position
    consumed_samples, read by --num-workers DataLoader processes from the first next(); None when this rank
    reads no data. With a sequence-length curriculum (engine/curriculum.py) each micro-batch is cut to the
    length current when it is taken. replicas_over=k: the micro-batches of the data-parallel rank k after this
    one instead (a replay on other devices, training/resilience/rerun.py)."""
    if dataset is None:
        return None
    replicas = parallel_state.get_data_parallel_world_size()
    samples = micro_batch_samples(dataset, consumed_samples, data.micro_batch_size,
                                  (parallel_state.get_data_parallel_rank() + replicas_over) % replicas, replicas,
                                  data.num_workers)
    if curriculum is None:
        return (model_batch(tokens, data, device) for tokens in samples)
    return (model_batch(tokens[:, :curriculum.length + 1], data, device) for tokens in samples)


def describe_samples(dataset, first, count):
    """Samples first .. first + count - 1 of a dataset and the documents they are cut from, for a message."""
    documents = {}
    for index in range(first, first + count):
        for prefix, ids in dataset.documents_of(index).items():
            documents.setdefault(prefix, []).extend(ids)
    listed = "; ".join(f"{prefix} documents {sorted(set(ids))}" for prefix, ids in documents.items())
    return f"samples {first}-{first + count - 1} ({listed})"
