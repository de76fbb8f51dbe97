"""Train a SentencePiece tokenizer (BPE or unigram) from a JSONL or plain-text corpus.

    python tools/train_tokenizer.py --input data/demo_corpus.jsonl --output-prefix data/demo_sp \\
        --vocab-size 8000 --byte-fallback

Writes PREFIX.model and PREFIX.vocab for `--tokenizer-type SentencePieceTokenizer --tokenizer-model
PREFIX.model`. The ids unk 0, bos 1, eos 2 (the end-of-document id) and pad 3 are always defined.
Normalization is the identity and whitespace is kept, so decode(encode(text)) gives text back (with
--byte-fallback, for any text).
"""
import argparse
import gzip
import json
import os
import sys
import tempfile

import sentencepiece

SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}


class UsageError(Exception):
    """A problem with the user's input: reported as one line and exit status 2."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help=".jsonl, .jsonl.gz, .txt or .txt.gz")
    parser.add_argument("--input-format", choices=["jsonl", "text"], default=None,
                        help="default: text for .txt/.txt.gz (one document per line), else jsonl")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields holding the text")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--byte-fallback", action="store_true",
                        help="encode characters outside the vocabulary as UTF-8 bytes instead of <unk>")
    parser.add_argument("--user-defined-symbols", default="",
                        help="comma-separated pieces always kept whole, e.g. '<|im_start|>,<|im_end|>'")
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    parser.add_argument("--max-sentence-length", type=int, default=16384,
                        help="longer lines (bytes) are skipped by the trainer")
    parser.add_argument("--input-sentence-size", type=int, default=0,
                        help="train on a random sample of this many lines (0: all)")
    parser.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    return parser.parse_args(argv)


def input_format(args):
    if args.input_format:
        return args.input_format
    return "text" if args.input.endswith((".txt", ".txt.gz")) else "jsonl"


def open_text(path):
    if not os.path.isfile(path):
        raise UsageError(f"--input {path}: file not found")
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def read_documents(path, fmt, json_keys):
    """Yield the text of each document: each line of a text file, or each key of each JSON line."""
    with open_text(path) as f:
        try:
            for line_number, line in enumerate(f, start=1):
                if fmt == "text":
                    yield line
                elif line.strip():
                    yield from json_texts(line, json_keys, f"{path}:{line_number}")
        except (UnicodeDecodeError, gzip.BadGzipFile) as error:
            raise UsageError(f"--input {path}: cannot read as UTF-8 text ({error})") from None


def json_texts(line, json_keys, where):
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise UsageError(f"{where}: not valid JSON ({error})") from None
    if not isinstance(record, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in json_keys:
        if key not in record:
            raise UsageError(f"{where}: no key {key!r} (keys: {', '.join(record) or 'none'}); "
                             "choose the text field with --json-keys")
        if not isinstance(record[key], str):
            raise UsageError(f"{where}: {key!r} is a {type(record[key]).__name__}, not a string")
        yield record[key]


def write_training_lines(documents, path):
    """One non-empty line per sentence for the trainer; returns (lines, bytes) written."""
    lines = size = 0
    with open(path, "w", encoding="utf-8") as out:
        for document in documents:
            for line in document.splitlines():
                if line.strip():
                    out.write(line + "\n")
                    lines += 1
                    size += len(line.encode("utf-8")) + 1
    return lines, size


def train(args, lines_file, model_prefix):
    symbols = [s for s in args.user_defined_symbols.split(",") if s]
    try:
        sentencepiece.SentencePieceTrainer.train(
            input=lines_file, model_prefix=model_prefix, model_type=args.model_type,
            vocab_size=args.vocab_size, byte_fallback=args.byte_fallback, user_defined_symbols=symbols,
            character_coverage=args.character_coverage, max_sentence_length=args.max_sentence_length,
            input_sentence_size=args.input_sentence_size, shuffle_input_sentence=True,
            num_threads=args.num_threads, normalization_rule_name="identity",
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, minloglevel=2,
            **SPECIAL_IDS)
    except RuntimeError as error:  # e.g. "Vocabulary size too high" on a small corpus
        raise UsageError(f"SentencePiece training failed: {error}") from None


def publish(temporary_prefix, output_prefix):
    """Rename the trainer's files into place, so a reader never sees a half-written model."""
    for suffix in (".vocab", ".model"):
        os.replace(temporary_prefix + suffix, output_prefix + suffix)


def run(args):
    fmt = input_format(args)
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(output_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir, prefix=".train_tokenizer-") as work_dir:
        lines_file = os.path.join(work_dir, "lines.txt")
        lines, size = write_training_lines(read_documents(args.input, fmt, args.json_keys), lines_file)
        if lines == 0:
            raise UsageError(f"--input {args.input}: no text found")
        temporary_prefix = os.path.join(work_dir, "model")
        train(args, lines_file, temporary_prefix)
        publish(temporary_prefix, args.output_prefix)
    print(f"trained a {args.model_type} SentencePiece model, vocab {args.vocab_size}"
          f"{' with byte fallback' if args.byte_fallback else ''}, on {lines} lines ({size / 1e6:.2f} MB) "
          f"of {args.input}")
    print(f"wrote {args.output_prefix}.model and {args.output_prefix}.vocab; "
          + ", ".join(f"{name.removesuffix('_id')} {i}" for name, i in SPECIAL_IDS.items()))


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except UsageError as error:
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
