"""From the data flags to each rank's micro-batch iterators.

Sources: --mock-data; --data-path (one prefix, or weighted prefixes blended) split by --split; or
--train-data-path / --valid-data-path / --test-data-path. Indices are built by rank 0 first (cached
under --data-cache-path), then loaded by the other ranks that read data: only the first pipeline
stage (inputs) and the last (labels) do.
"""
import numpy as np
import torch.distributed as dist

from megatron_ds.core import parallel_state
from megatron_ds.core.models.gpt import pack_model_inputs
from megatron_ds.data.blended_dataset import BlendedDataset, blended_samples_per_dataset, parse_data_path
from megatron_ds.data.gpt_dataset import (GPTDataset, GPTDatasetConfig, get_ltor_masks_and_position_ids,
                                          parse_split, split_documents)
from megatron_ds.data.indexed_dataset import IndexedDataset
from megatron_ds.data.mock import MockGPTDataset
from megatron_ds.data.samplers import micro_batch_samples

SPLITS = ("train", "valid", "test")


def samples_per_split(args):
    """Samples each split must provide for the whole run (Megatron's accounting)."""
    evaluations = (args.train_iters // args.eval_interval + 1) if args.eval_interval and args.eval_iters else 0
    return {"train": args.train_iters * args.global_batch_size,
            "valid": evaluations * args.eval_iters * args.global_batch_size,
            "test": args.eval_iters * args.global_batch_size}


def _gpt_dataset(args, prefix, document_ids, split, num_samples):
    config = GPTDatasetConfig(seq_length=args.seq_length, seed=args.seed, num_samples=num_samples,
                              split_name=split, data_cache_path=args.data_cache_path)
    return GPTDataset(IndexedDataset(prefix), document_ids, config, prefix)


def _blend(args, split, weighted_prefixes, num_samples, documents_of):
    """One GPTDataset per prefix (documents_of(prefix) picks its documents), blended by weight."""
    prefixes, weights = weighted_prefixes
    counts = blended_samples_per_dataset(weights, num_samples) if len(prefixes) > 1 else [num_samples]
    datasets = [_gpt_dataset(args, prefix, documents_of(prefix), split, count)
                for prefix, count in zip(prefixes, counts)]
    if len(datasets) == 1:
        return datasets[0]
    return BlendedDataset(datasets, weights, num_samples, cache_path=args.data_cache_path)


def _split_documents_of(args, split):
    index = SPLITS.index(split)

    def documents_of(prefix):
        begin, end = split_documents(len(IndexedDataset(prefix)), args.split)[index]
        return np.arange(begin, end, dtype=np.int64)
    return documents_of


def _all_documents(prefix):
    return np.arange(len(IndexedDataset(prefix)), dtype=np.int64)


def build_split_dataset(args, split, num_samples):
    """The dataset of one split, or None when it has no source or no samples are wanted."""
    if num_samples == 0:
        return None
    if args.mock_data:
        return MockGPTDataset(args.vocab_size, args.seq_length, args.seed, split)
    if args.data_path:
        if _split_is_empty(args, split):
            return None
        return _blend(args, split, parse_data_path(args.data_path), num_samples, _split_documents_of(args, split))
    paths = getattr(args, f"{split}_data_path")
    return _blend(args, split, parse_data_path(paths), num_samples, _all_documents) if paths else None


def _split_is_empty(args, split):
    prefix = parse_data_path(args.data_path)[0][0]
    begin, end = split_documents(len(IndexedDataset(prefix)), args.split)[SPLITS.index(split)]
    return begin == end


def has_validation_data(args):
    """Decided from the flags alone, so every rank (data readers or not) agrees on whether to evaluate."""
    if args.mock_data or args.valid_data_path:
        return True
    return bool(args.data_path) and parse_split(args.split)[SPLITS.index("valid")] > 0


def _reads_data():
    return parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()


def build_datasets(args):
    """{split: dataset or None} on ranks that read data, built by rank 0 first; {} on the others."""
    wanted = samples_per_split(args)
    datasets = {}
    if dist.get_rank() == 0:
        datasets = {split: build_split_dataset(args, split, wanted[split]) for split in SPLITS}
    dist.barrier()
    if dist.get_rank() != 0 and _reads_data():
        datasets = {split: build_split_dataset(args, split, wanted[split]) for split in SPLITS}
    return datasets


def _model_batch(tokens, args, device):
    """tokens [b, s + 1] -> (model inputs, labels) in the form the pipeline engine takes. With Ulysses each
    sequence-parallel rank keeps its slice of the tokens, labels, loss mask and (global) position ids."""
    tokens = tokens.to(device)
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    sliced = parallel_state.get_sequence_parallel_world_size() > 1
    if not (args.reset_position_ids or args.reset_attention_mask or args.eod_mask_loss or sliced):
        return input_ids, labels
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        input_ids, args.eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss,
        with_attention_mask=args.reset_attention_mask)
    if sliced:  # (--reset-attention-mask is refused with Ulysses)
        input_ids, labels, loss_mask, position_ids = (_sequence_slice(t) for t in
                                                      (input_ids, labels, loss_mask, position_ids))
    inputs = pack_model_inputs(input_ids, position_ids if args.reset_position_ids or sliced else None,
                               attention_mask if args.reset_attention_mask else None)
    return inputs, ((labels, loss_mask) if args.eod_mask_loss else labels)


def _sequence_slice(tensor):
    """This Ulysses rank's contiguous slice of a [b, s] tensor."""
    ranks, rank = parallel_state.get_sequence_parallel_world_size(), parallel_state.get_sequence_parallel_rank()
    length = tensor.size(1) // ranks
    return tensor[:, rank * length:(rank + 1) * length].contiguous()


def batch_iterator(dataset, args, consumed_samples, device, curriculum=None):
    """Endless (inputs, labels) micro-batches of this data-parallel rank from the global sample position
    consumed_samples, read by --num-workers DataLoader processes from the first next(); None when this rank
    reads no data. With a sequence-length curriculum (glue/curriculum.py) each micro-batch is cut to the
    length current when it is taken."""
    if dataset is None:
        return None
    samples = micro_batch_samples(dataset, consumed_samples, args.micro_batch_size,
                                  parallel_state.get_data_parallel_rank(),
                                  parallel_state.get_data_parallel_world_size(), args.num_workers)
    if curriculum is None:
        return (_model_batch(tokens, args, device) for tokens in samples)
    return (_model_batch(tokens[:, :curriculum.length + 1], args, device) for tokens in samples)
