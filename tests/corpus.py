"""Small deterministic text corpora for tokenizer and data tests, and tools/train_tokenizer.py as a process."""
import json
import random
import subprocess
import sys

from tests.launch import REPO

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
