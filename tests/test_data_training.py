"""pretrain.py on preprocessed indexed datasets: a blend of two prefixes with --reset-position-ids,
--reset-attention-mask and --eod-mask-loss. The (2,2,2) layout, where each data-parallel rank reads its
half of every global batch and the masks travel through the pipeline, matches the single-rank run;
the sample indices are built once and re-used."""
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.launch import REPO, launch, losses

pytestmark = pytest.mark.e2e  # launches several real processes

VOCAB = 250
ITERATIONS = 8


def _write_corpus(path, seed, documents):
    """Whitespace-separated token ids (NullTokenizer): arithmetic progressions of random length."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as handle:
        for _ in range(documents):
            start, step, length = rng.integers(VOCAB - 1), rng.integers(1, 6), rng.integers(5, 60)
            ids = (start + step * np.arange(length)) % (VOCAB - 1)
            handle.write(json.dumps({"text": " ".join(map(str, ids))}) + "\n")


@pytest.fixture(scope="module")
def blended_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    prefixes = []
    for name, seed in (("a", 1), ("b", 2)):
        corpus = root / f"{name}.jsonl"
        _write_corpus(corpus, seed, documents=400)
        subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix",
                        str(root / name), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
                        "--append-eod", "--workers", "1"], cwd=REPO, check=True, capture_output=True)
        prefixes.append(str(root / f"{name}_text_document"))
    return root, prefixes


def _run(blended_data, tp, pp, dp):
    root, (a, b) = blended_data
    flags = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERATIONS),
             "--lr", "2e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5",
             "--data-path", "0.3", a, "0.7", b, "--split", "90,10,0", "--data-cache-path", str(root / "cache"),
             "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
             "--make-vocab-size-divisible-by", str(256 // tp),
             "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
             "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1",
             "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    result = launch(tp * pp * dp, flags)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def test_blended_data_with_resets_matches_across_layouts(blended_data):
    first = _run(blended_data, 1, 1, 1)
    assert "built indices" in first
    expected = losses(first)
    assert sorted(expected) == list(range(1, ITERATIONS + 1))
    assert expected[ITERATIONS] < expected[1]
    assert "validation loss at iteration 8" in first

    second = _run(blended_data, 2, 2, 2)
    assert "loaded indices" in second and "built indices" not in second
    observed = losses(second)
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-4), (iteration, observed, expected)
