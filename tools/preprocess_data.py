"""Tokenize a JSONL (or one-document-per-line text) corpus into Megatron indexed datasets, one per JSON key.

    python tools/preprocess_data.py --input data/demo_corpus.jsonl --output-prefix data/demo \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/demo_sp.model --append-eod --workers 2

writes data/demo_text_document.bin and .idx (Megatron-LM's names and byte format), documents in input
order. Inputs: .jsonl, .jsonl.gz, .txt, .txt.gz (text: one document per line, stored under the first
--json-keys name). Empty documents are skipped and counted. Errors (missing input, a malformed line
without --skip-bad-lines, a missing key, a token id outside the vocabulary) exit with status 2 and leave
no output file under its final name.
"""
import argparse
import gzip
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_ds.data.indexed_dataset import IndexedDatasetBuilder, IndexedDatasetError, best_fitting_dtype  # noqa: E402
from megatron_ds.data.tokenizers import build_tokenizer  # noqa: E402


class PreprocessError(Exception):
    """A problem with the input or the flags: printed as one paragraph, exit status 2."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input")
    group.add_argument("--input", required=True, help=".jsonl, .jsonl.gz, .txt or .txt.gz")
    group.add_argument("--input-format", choices=["jsonl", "text"], default=None,
                       help="default: text for .txt/.txt.gz (one document per line), else jsonl")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="JSON fields to tokenize, each into its own dataset (default: text)")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="count and skip lines that are not valid UTF-8 JSON objects instead of failing")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True,
                       help="SentencePieceTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer or NullTokenizer")
    group.add_argument("--tokenizer-model", default=None)
    group.add_argument("--vocab-file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document id to each document")
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True,
                       help="writes PREFIX_<key>_document.bin/.idx for each JSON key")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes (1: tokenize in-process)")
    group.add_argument("--chunk-size", type=int, default=64, help="lines per task handed to a worker")
    group.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    args = parser.parse_args(argv)
    for flag in ("workers", "chunk_size", "log_interval"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def input_format(args):
    if args.input_format:
        return args.input_format
    return "text" if args.input.endswith((".txt", ".txt.gz")) else "jsonl"


def output_prefixes(args):
    """{json key: Megatron's dataset prefix for it}."""
    return {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}


# ---------------------------------------------------------------------------------------------- encoding


@dataclass(frozen=True)
class EncoderSettings:
    """Everything a worker needs to rebuild the encoder (picklable, unlike some tokenizers)."""
    input_name: str
    input_format: str
    json_keys: tuple
    append_eod: bool
    skip_bad_lines: bool
    token_dtype: str
    tokenizer_type: str
    tokenizer_kwargs: dict


@dataclass
class EncodedChunk:
    """A chunk of input lines, tokenized: per key, the concatenated tokens and each document's length."""
    tokens: dict
    lengths: dict
    documents: int = 0
    empty: int = 0
    bad_lines: int = 0
    bytes_in: int = 0


class _BadLine(Exception):
    pass


class DocumentEncoder:
    def __init__(self, settings, tokenizer):
        self.settings = settings
        self.tokenizer = tokenizer

    def encode_chunk(self, first_line_number, lines):
        ids = {key: [] for key in self.settings.json_keys}
        lengths = {key: [] for key in self.settings.json_keys}
        chunk = EncodedChunk(tokens={}, lengths=lengths, bytes_in=sum(len(line) for line in lines))
        for line_number, line in enumerate(lines, first_line_number):
            try:
                fields = self._fields(line, line_number)
            except _BadLine:
                chunk.bad_lines += 1
                continue
            chunk.documents += 1
            for key, text in fields.items():
                document = self._token_ids(text, line_number, key)
                if not document:
                    chunk.empty += 1
                    continue
                if self.settings.append_eod:
                    document.append(self.tokenizer.eod)
                ids[key].extend(document)
                lengths[key].append(len(document))
        chunk.tokens = {key: np.array(ids[key], dtype=self.settings.token_dtype) for key in ids}
        return chunk

    def _where(self, line_number):
        return f"{self.settings.input_name}:{line_number}"

    def _fields(self, line, line_number):
        """{key: text} of one input line; _BadLine when the line is malformed and --skip-bad-lines is set."""
        try:
            text = line.decode("utf-8")
            if self.settings.input_format == "text":
                return {self.settings.json_keys[0]: text.rstrip("\r\n")}
            if not text.strip():
                return {key: "" for key in self.settings.json_keys}
            record = json.loads(text)
            if not isinstance(record, dict):
                raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        except ValueError as error:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
            if self.settings.skip_bad_lines:
                raise _BadLine() from None
            raise PreprocessError(f"{self._where(line_number)}: malformed line ({error}); fix the line or "
                                  f"pass --skip-bad-lines to count and skip such lines") from None
        return {key: self._text_field(record, key, line_number) for key in self.settings.json_keys}

    def _text_field(self, record, key, line_number):
        if key not in record:
            raise PreprocessError(f"{self._where(line_number)}: no key {key!r} (the line has "
                                  f"{sorted(record)}); choose the field with --json-keys")
        if not isinstance(record[key], str):
            raise PreprocessError(f"{self._where(line_number)}: key {key!r} holds a "
                                  f"{type(record[key]).__name__}, not a string")
        return record[key]

    def _token_ids(self, text, line_number, key):
        try:
            ids = list(self.tokenizer.encode(text))
        except ValueError as error:
            raise PreprocessError(f"{self._where(line_number)}: cannot tokenize key {key!r}: {error}") from None
        if ids and (min(ids) < 0 or max(ids) >= self.tokenizer.vocab_size):
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise PreprocessError(f"{self._where(line_number)}: key {key!r} has token id {bad}, outside the "
                                  f"vocabulary [0, {self.tokenizer.vocab_size}) of --tokenizer-type "
                                  f"{self.settings.tokenizer_type}")
        return ids


_worker_encoder = None  # one per worker process, set by _start_worker


def _start_worker(settings):
    global _worker_encoder
    tokenizer = build_tokenizer(settings.tokenizer_type, **settings.tokenizer_kwargs)
    _worker_encoder = DocumentEncoder(settings, tokenizer)


def _encode_in_worker(numbered_lines):
    return _worker_encoder.encode_chunk(*numbered_lines)


# ---------------------------------------------------------------------------------------------- pipeline


def open_input(path):
    if not os.path.isfile(path):
        raise PreprocessError(f"--input {path}: file not found")
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_chunks(path, chunk_size):
    """(number of the first line, [raw lines]) for every chunk_size lines of the input."""
    lines, first = [], 1
    try:
        with open_input(path) as stream:
            for line_number, line in enumerate(stream, 1):
                lines.append(line)
                if len(lines) == chunk_size:
                    yield first, lines
                    lines, first = [], line_number + 1
    except (OSError, EOFError) as error:  # a corrupt or truncated .gz
        raise PreprocessError(f"--input {path}: cannot read line {first + len(lines)} ({error})") from None
    if lines:
        yield first, lines


def encoded_chunks(args, settings, tokenizer):
    """EncodedChunks in input order: in this process for --workers 1, else from a pool."""
    chunks = read_chunks(args.input, args.chunk_size)
    if args.workers == 1:
        encoder = DocumentEncoder(settings, tokenizer)
        yield from (encoder.encode_chunk(*chunk) for chunk in chunks)
        return
    with multiprocessing.Pool(args.workers, initializer=_start_worker, initargs=(settings,)) as pool:
        yield from pool.imap(_encode_in_worker, chunks)


@dataclass
class Progress:
    log_interval: int
    started: float = field(default_factory=time.monotonic)
    documents: int = 0
    empty: int = 0
    bad_lines: int = 0
    tokens: int = 0
    bytes_in: int = 0
    next_log: int = 0

    def __post_init__(self):
        self.next_log = self.log_interval

    def add(self, chunk):
        self.documents += chunk.documents
        self.empty += chunk.empty
        self.bad_lines += chunk.bad_lines
        self.tokens += sum(int(tokens.size) for tokens in chunk.tokens.values())
        self.bytes_in += chunk.bytes_in
        if self.documents >= self.next_log:
            self.next_log = (self.documents // self.log_interval + 1) * self.log_interval
            print(f"processed {self.documents} documents ({self.documents / self.seconds():.0f} docs/s, "
                  f"{self.megabytes_per_second():.2f} MB/s)", file=sys.stderr, flush=True)

    def seconds(self):
        return max(time.monotonic() - self.started, 1e-9)

    def megabytes_per_second(self):
        return self.bytes_in / 1e6 / self.seconds()

    def summary(self):
        return (f"done: {self.documents} documents, {self.empty} empty documents skipped, {self.bad_lines} bad "
                f"lines skipped, {self.tokens} tokens, {self.bytes_in / 1e6:.2f} MB in {self.seconds():.2f} s "
                f"({self.megabytes_per_second():.2f} MB/s)")


def build_settings(args, tokenizer_kwargs, tokenizer):
    fmt = input_format(args)
    if fmt == "text" and len(args.json_keys) > 1:
        raise PreprocessError(f"--input-format text has one field per line, but --json-keys names "
                              f"{len(args.json_keys)}: {' '.join(args.json_keys)}")
    return EncoderSettings(input_name=args.input, input_format=fmt, json_keys=tuple(args.json_keys),
                           append_eod=args.append_eod, skip_bad_lines=args.skip_bad_lines,
                           token_dtype=best_fitting_dtype(tokenizer.vocab_size).str,
                           tokenizer_type=args.tokenizer_type, tokenizer_kwargs=tokenizer_kwargs)


def load_tokenizer(args):
    kwargs = dict(tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file, merge_file=args.merge_file,
                  vocab_size=args.vocab_size)
    try:
        return kwargs, build_tokenizer(args.tokenizer_type, **kwargs)
    except (ValueError, OSError) as error:
        raise PreprocessError(str(error)) from None


def open_builders(prefixes, token_dtype):
    for prefix in prefixes.values():
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    return {key: IndexedDatasetBuilder(prefix + ".bin", token_dtype) for key, prefix in prefixes.items()}


def preprocess(args):
    """Tokenize args.input into one dataset per key; returns the Progress totals."""
    if not os.path.isfile(args.input):
        raise PreprocessError(f"--input {args.input}: file not found")
    tokenizer_kwargs, tokenizer = load_tokenizer(args)
    settings = build_settings(args, tokenizer_kwargs, tokenizer)
    prefixes = output_prefixes(args)
    builders = open_builders(prefixes, settings.token_dtype)
    progress = Progress(args.log_interval)
    try:
        for chunk in encoded_chunks(args, settings, tokenizer):
            for key, builder in builders.items():
                builder.add_documents(chunk.tokens[key], chunk.lengths[key])
            progress.add(chunk)
        for key, builder in builders.items():
            builder.finalize(prefixes[key] + ".idx")
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    return progress


def main(argv=None):
    args = parse_args(argv)
    try:
        progress = preprocess(args)
    except (PreprocessError, IndexedDatasetError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(progress.summary(), file=sys.stderr)
    for prefix in output_prefixes(args).values():
        print(f"wrote {prefix}.bin and {prefix}.idx", file=sys.stderr)


if __name__ == "__main__":
    main()
