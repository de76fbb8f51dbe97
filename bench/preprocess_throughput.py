"""Throughput of tools/preprocess_data.py with 1 and 2 workers, beside the tokenizer's own encode rate.

    python bench/preprocess_throughput.py
    python bench/preprocess_throughput.py --input my.jsonl --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model my.model

Every rate is MB of the input file per second, so the ratios compare like with like: "x encode" is how
preprocess_data (JSON parsing, tokenizing, writing the dataset) compares with calling tokenizer.encode on
the same texts in one process, with nothing else. The preprocess rate is the tool's own summary (from
after the tokenizer is loaded to the end, worker start-up included); the best of --repeat runs is kept.

Defaults: the corpus data/demo_corpus.jsonl (built with tools/make_demo_corpus.py when missing, or a
synthetic English-like corpus when that tool is absent) and a SentencePiece BPE trained on it by
tools/train_tokenizer.py (or, when that tool is absent, NullTokenizer over a corpus of random ids).
Every fallback is printed.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_ds.data.tokenizers import build_tokenizer  # noqa: E402

DEFAULT_CORPUS = os.path.join(REPO, "data", "demo_corpus.jsonl")
WORDS = ("the model data of a to and in is that for training layer parallel tensor pipeline with each rank "
         "token sequence batch gradient memory we this it are on by as be from can which all one step loss "
         "weight attention head hidden size time when not or an each group process optimizer state").split()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", default=None, help=f"JSONL corpus (default {os.path.relpath(DEFAULT_CORPUS)})")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--tokenizer-type", default=None, help="default: a SentencePiece BPE trained here")
    parser.add_argument("--tokenizer-model", default=None)
    parser.add_argument("--vocab-file", default=None)
    parser.add_argument("--merge-file", default=None)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="NullTokenizer's vocabulary, or the size of the SentencePiece model trained here")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best is kept")
    return parser.parse_args(argv)


def run_tool(name, *args):
    result = subprocess.run([sys.executable, os.path.join(REPO, "tools", name), *map(str, args)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"tools/{name} failed:\n{result.stderr}")
    return result


def tool_exists(name):
    return os.path.isfile(os.path.join(REPO, "tools", name))


# ---------------------------------------------------------------------------------------------- inputs


def synthetic_text_corpus(path, documents=3000, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(documents):
            sentences = [" ".join(rng.choice(WORDS, rng.integers(5, 20))).capitalize() + "."
                         for _ in range(rng.integers(3, 40))]
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")


def random_id_corpus(path, vocab_size, documents=3000, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(map(str, rng.integers(0, vocab_size - 1, rng.integers(50, 800))))})
                    + "\n")


def ensure_corpus(args, work_dir):
    """(corpus path, how it was obtained)."""
    if args.input:
        return args.input, "given"
    if os.path.isfile(DEFAULT_CORPUS):
        return DEFAULT_CORPUS, "existing"
    if tool_exists("make_demo_corpus.py"):
        run_tool("make_demo_corpus.py", "--output", DEFAULT_CORPUS)
        return DEFAULT_CORPUS, "built now by tools/make_demo_corpus.py"
    path = os.path.join(work_dir, "synthetic_corpus.jsonl")
    synthetic_text_corpus(path)
    return path, "SYNTHETIC English-like text (tools/make_demo_corpus.py is absent)"


def tokenizer_flags(args, corpus, work_dir):
    """(preprocess_data tokenizer flags, corpus, a note), training a SentencePiece model when none is given."""
    if args.tokenizer_type:
        named = {"--tokenizer-model": args.tokenizer_model, "--vocab-file": args.vocab_file,
                 "--merge-file": args.merge_file, "--vocab-size": args.vocab_size}
        flags = ["--tokenizer-type", args.tokenizer_type]
        flags += [str(x) for flag, value in named.items() if value is not None for x in (flag, value)]
        return flags, corpus, "given"
    if tool_exists("train_tokenizer.py"):
        vocab_size = args.vocab_size or 8000
        prefix = os.path.join(work_dir, "bench_sp")
        run_tool("train_tokenizer.py", "--input", corpus, "--json-keys", args.json_key, "--output-prefix", prefix,
                 "--vocab-size", vocab_size, "--byte-fallback")
        flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", prefix + ".model"]
        return flags, corpus, f"SentencePiece BPE, vocab {vocab_size}, trained now by tools/train_tokenizer.py"
    vocab_size = args.vocab_size or 32000
    corpus = os.path.join(work_dir, "random_ids.jsonl")
    random_id_corpus(corpus, vocab_size)
    return (["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size)], corpus,
            "NullTokenizer over RANDOM IDS, not the text corpus (tools/train_tokenizer.py is absent)")


def tokenizer_from_flags(flags):
    pairs = dict(zip(flags[::2], flags[1::2]))
    vocab_size = pairs.get("--vocab-size")
    return build_tokenizer(pairs["--tokenizer-type"], tokenizer_model=pairs.get("--tokenizer-model"),
                           vocab_file=pairs.get("--vocab-file"), merge_file=pairs.get("--merge-file"),
                           vocab_size=int(vocab_size) if vocab_size else None)


# ---------------------------------------------------------------------------------------------- measuring


def encode_seconds(tokenizer, texts, repeat):
    """Best time to encode every text, one process, nothing else."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for text in texts:
            tokenizer.encode(text)
        best = min(best, time.perf_counter() - started)
    return best


def preprocess_megabytes_per_second(corpus, json_key, flags, workers, work_dir, repeat):
    """Best MB/s reported by preprocess_data's own summary line."""
    rates = []
    for attempt in range(repeat):
        result = run_tool("preprocess_data.py", "--input", corpus, "--json-keys", json_key, "--output-prefix",
                          os.path.join(work_dir, f"bench_w{workers}_{attempt}"), "--append-eod", "--workers", workers,
                          *flags)
        rates.append(float(re.search(r"\(([\d.]+) MB/s\)\s*$", result.stderr.split("\nwrote")[0]).group(1)))
    return max(rates)


def read_texts(corpus, json_key):
    with open(corpus, encoding="utf-8") as f:
        return [json.loads(line)[json_key] for line in f if line.strip()]


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="preprocess_bench-") as work_dir:
        corpus, corpus_note = ensure_corpus(args, work_dir)
        flags, corpus, tokenizer_note = tokenizer_flags(args, corpus, work_dir)
        texts, megabytes = read_texts(corpus, args.json_key), os.path.getsize(corpus) / 1e6
        tokenizer = tokenizer_from_flags(flags)
        encode_rate = megabytes / encode_seconds(tokenizer, texts, args.repeat)
        rates = {w: preprocess_megabytes_per_second(corpus, args.json_key, flags, w, work_dir, args.repeat)
                 for w in args.workers}
    print(f"corpus: {corpus} ({megabytes:.2f} MB, {len(texts)} documents; {corpus_note})")
    print(f"tokenizer: {tokenizer!r} ({tokenizer_note}); {os.cpu_count()} CPU cores; best of {args.repeat}")
    print(f"{'':34}{'MB/s':>8}{'x encode':>10}")
    print(f"{'tokenizer.encode, one process':34}{encode_rate:8.2f}{1.0:10.2f}")
    for workers, rate in rates.items():
        print(f"{f'preprocess_data --workers {workers}':34}{rate:8.2f}{rate / encode_rate:10.2f}")
    if 1 in rates and len(rates) > 1:
        print("speed-up over --workers 1: " + ", ".join(
            f"{w} workers {rate / rates[1]:.2f}x" for w, rate in rates.items() if w != 1))


if __name__ == "__main__":
    main()
