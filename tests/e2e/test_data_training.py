"""pretrain.py on preprocessed indexed datasets: a blend of two prefixes with --reset-position-ids,
--reset-attention-mask and --eod-mask-loss. The (2,2,2) layout, where each data-parallel rank reads its
half of every global batch and the masks travel through the pipeline, matches the single-rank run;
the sample indices are built once and re-used; reading in the training process (--num-workers 0) trains
like the default 2 DataLoader workers."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.support.launch import REPO, assert_succeeded, launch, losses

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


def _run(blended_data, tp, pp, dp, *extra):
    root, (a, b) = blended_data
    flags = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERATIONS),
             "--lr", "2e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5",
             "--data-path", "0.3", a, "0.7", b, "--split", "90,10,0", "--data-cache-path", str(root / "cache"),
             "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
             "--make-vocab-size-divisible-by", str(256 // tp),
             "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
             "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1",
             "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]
    result = launch(tp * pp * dp, flags)
    assert_succeeded(result, tail=4000)
    return result.stdout


@pytest.fixture(scope="module")
def single_rank_output(blended_data):
    """The first launch of the module (it builds the indices), with the default --num-workers 2."""
    return _run(blended_data, 1, 1, 1)


def test_blended_data_with_resets_matches_across_layouts(blended_data, single_rank_output):
    first = single_rank_output
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


def test_dataloader_workers_do_not_change_training(blended_data, single_rank_output):
    """--num-workers 0 (read in the training process) trains and validates bitwise like the default 2 workers."""
    in_process = _run(blended_data, 1, 1, 1, "--num-workers", "0")
    assert losses(in_process) == losses(single_rank_output)
    validation = re.compile(r"validation loss at iteration \d+ \| lm loss value: \S+")
    assert validation.findall(in_process) == validation.findall(single_rank_output) != []
