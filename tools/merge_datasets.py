"""Concatenate Megatron indexed datasets (same dtype) into one, in the order given.

    python tools/merge_datasets.py --input data/a_text_document data/b_text_document \\
        --output-prefix data/ab_text_document
    python tools/merge_datasets.py --input-dir data/shards --output-prefix data/all_text_document

--input-dir takes every prefix with both a .bin and an .idx in the folder, sorted by name. The output is
written under temporary names and renamed at the end: a failed merge leaves nothing under the final names.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_ds.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    IndexedDatasetError,
    bin_path,
    dataset_exists,
    idx_path,
    read_index_header,
)


class MergeError(Exception):
    """A problem with the inputs: printed as one paragraph, exit status 2."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    inputs = parser.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--input", nargs="+", metavar="PREFIX", help="dataset prefixes (without .bin/.idx)")
    inputs.add_argument("--input-dir", help="merge every dataset in this folder, sorted by name")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    return parser.parse_args(argv)


def prefixes_in(directory):
    if not os.path.isdir(directory):
        raise MergeError(f"--input-dir {directory}: not a folder")
    names = sorted(name[:-len(".idx")] for name in os.listdir(directory) if name.endswith(".idx"))
    prefixes = [os.path.join(directory, name) for name in names if dataset_exists(os.path.join(directory, name))]
    if not prefixes:
        raise MergeError(f"--input-dir {directory}: no dataset (a .bin with its .idx) in the folder")
    return prefixes


def common_dtype(prefixes):
    """The dtype every input shares; a MergeError naming two inputs that differ."""
    first_dtype = None
    for prefix in prefixes:
        if not dataset_exists(prefix):
            raise MergeError(f"--input {prefix}: {idx_path(prefix)} or {bin_path(prefix)} not found")
        dtype = read_index_header(idx_path(prefix))[0]
        if first_dtype is None:
            first_dtype = dtype
        elif dtype != first_dtype:
            raise MergeError(f"cannot merge {prefixes[0]} (dtype {first_dtype}) with {prefix} (dtype {dtype}): "
                             f"every input must have the same token dtype; re-run preprocess_data.py with "
                             f"the same tokenizer")
    return first_dtype


def merge(prefixes, output_prefix):
    if os.path.abspath(output_prefix) in {os.path.abspath(p) for p in prefixes}:
        raise MergeError(f"--output-prefix {output_prefix} is also an input")
    dtype = common_dtype(prefixes)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    with IndexedDatasetBuilder(bin_path(output_prefix), dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(idx_path(output_prefix))


def main(argv=None):
    args = parse_args(argv)
    try:
        prefixes = args.input or prefixes_in(args.input_dir)
        merge(prefixes, args.output_prefix)
    except (MergeError, IndexedDatasetError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}.bin and .idx", file=sys.stderr)


if __name__ == "__main__":
    main()
