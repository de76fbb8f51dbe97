"""The data checked before training (data/builder.py data_problems): a split training or evaluation reads that is
empty, a validation split smaller than one evaluation, and damaged .idx/.bin files are refused with the numbers
and the flags, each in one line; pretrain.py prints them without a traceback, exit status 2, before building
anything. A non-empty training split is enough: GPT datasets repeat it in epochs."""
import numpy as np
import pytest

from megatron_ds.arguments import parse_args
from megatron_ds.data.builder import data_problems
from tests.support.corpus import build_indexed_dataset
from tests.support.launch import run_alone

DOCUMENTS = 20
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size", "100", "--tokenizer-type",
         "NullTokenizer", "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1"]
EVALUATION = ("each evaluation reads 4 samples (--eval-iters 1 x --global-batch-size 4, every --eval-interval 2 "
              "iterations)")


@pytest.fixture
def data(tmp_path):
    """Prefixes of a small dataset (20 documents of 40 tokens), an empty one and three damaged copies."""
    documents = [np.arange(40) % 90 + d % 7 for d in range(DOCUMENTS)]
    prefixes = {name: build_indexed_dataset(tmp_path / name, documents) for name in ("small", "truncated", "magic", "sizes")}
    prefixes["empty"] = build_indexed_dataset(tmp_path / "empty", [])
    with open(prefixes["truncated"] + ".bin", "r+b") as handle:
        handle.truncate(100)
    with open(prefixes["magic"] + ".idx", "r+b") as handle:
        handle.write(b"XXXX")
    with open(prefixes["sizes"] + ".idx", "ab") as handle:
        handle.write(bytes(8))
    return prefixes


def _problems(*flags):
    return data_problems(parse_args(FLAGS + list(flags), world_size=1).data)


def test_an_empty_validation_split_is_refused_when_training_evaluates(data):
    small = data["small"]
    assert _problems("--data-path", small, "--split", "98,2,0") == [
        f"the validation split of --data-path {small} is empty: 0 of its 20 documents (--split 98,2,0), 0 tokens; "
        f"{EVALUATION}. Give it a larger validation weight in --split 98,2,0, or more documents, or pass --eval-iters "
        f"0 to train without evaluation"]
    assert _problems("--data-path", small, "--split", "98,2,0", "--eval-iters", "0") == []
    assert _problems("--data-path", small, "--split", "98,2,0", "--eval-interval", "5") == []  # never reached
    assert _problems("--data-path", small, "--split", "90,10,0") == []


def test_a_validation_split_smaller_than_one_evaluation_is_refused(data):
    small = data["small"]
    assert _problems("--data-path", small, "--split", "90,10,0", "--eval-iters", "2") == [
        f"the validation split has 4 samples of --seq-length 16 (80 tokens in 2 of its 20 documents (--split "
        f"90,10,0) of --data-path {small}), but each evaluation reads 8 samples (--eval-iters 2 x --global-batch-size "
        f"4, every --eval-interval 2 iterations): an evaluation would repeat samples. Give it a larger validation "
        f"weight in --split 90,10,0, or more documents, or pass --eval-iters 0 to train without evaluation"]


def test_an_empty_dataset_and_an_empty_training_split_are_refused(data):
    small, empty = data["small"], data["empty"]
    assert _problems("--train-data-path", empty, "--eval-iters", "0") == [
        f"--train-data-path {empty} holds no documents: {empty}.idx indexes none"]
    assert _problems("--data-path", small, "--split", "0,100,0") == [
        f"the training split of --data-path {small} is empty: 0 of its 20 documents (--split 0,100,0), 0 tokens; "
        f"training reads 16 samples (--train-iters 4 x --global-batch-size 4). Give training data: a larger training "
        f"weight in --split 0,100,0, or more documents"]


def test_a_training_split_smaller_than_the_run_is_accepted(data):
    """2 documents of 40 tokens hold 4 samples, 16 are read: GPTDataset repeats them in epochs
    (tests/unit/data/test_gpt_dataset.py)."""
    assert _problems("--data-path", data["small"], "--split", "10,90,0") == []


def test_each_damaged_file_is_one_problem_naming_it(data):
    blend = [item for name in ("truncated", "magic", "sizes", "small") for item in ("0.25", data[name])]
    assert _problems("--data-path", *blend, "--split", "90,10,0") == [
        f"{data['truncated']}.bin is 100 bytes but its index addresses 1600: the file is truncated",
        f"{data['magic']}.idx is not a Megatron MMIDIDX index: it starts with b'XXXXIDX\\x00\\x00', expected "
        f"b'MMIDIDX\\x00\\x00'",
        f"{data['sizes']}.idx is 450 bytes but its header (20 sequences, 21 document indices) needs 442: the file is "
        f"too long"]


def test_pretrain_refuses_bad_data_in_one_line_each_without_a_traceback(data):
    blend = [item for name in ("truncated", "empty", "small") for item in ("0.3", data[name])]
    result = run_alone(["pretrain.py"], FLAGS + ["--data-path", *blend, "--split", "98,2,0"])
    assert result.returncode == 2 and "Traceback" not in result.stdout, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("megatron_ds: error: ")]
    assert [line.split(" ")[2] for line in errors] == [f"{data['truncated']}.bin", "--data-path", "the"], errors
    assert "validation split of --data-path" in errors[2] and "megatron_ds: world size" not in result.stdout


def test_mock_data_needs_no_check():
    assert _problems("--mock-data") == []
