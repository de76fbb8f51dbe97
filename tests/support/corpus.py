"""Small deterministic text corpora for tokenizer and data tests, indexed datasets of given documents, and
tools/train_tokenizer.py as a process."""
import json
import random
import subprocess
import sys

import numpy as np

from megatron_ds.data.indexed_dataset import IndexedDatasetBuilder
from tests.support.launch import REPO

WORDS = ("the model reads a long document and predicts every next token while the optimizer updates "
         "each weight of the network from gradients that flow back through all layers of attention").split()


def sample_sentences(count, seed=0):
    """Deterministic English-looking sentences: enough variety for a few hundred BPE merges."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16))).capitalize() + "."
            for _ in range(count)]


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts), encoding="utf-8")
    return path


def run_train_tokenizer(*flags):
    return subprocess.run([sys.executable, "tools/train_tokenizer.py", *map(str, flags)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def build_indexed_dataset(prefix, documents, dtype=np.uint16):
    """prefix.bin and prefix.idx holding `documents` (lists of token ids); the prefix as a string."""
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype) as builder:
        for tokens in documents:
            builder.add_document(tokens)
        builder.finalize(f"{prefix}.idx")
    return str(prefix)
