"""tools/preprocess_data.py and tools/merge_datasets.py, run as users run them: as subprocesses."""
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_ds.data.indexed_dataset import IndexedDataset
from megatron_ds.data.tokenizers import build_tokenizer
from tests.support.launch import assert_succeeded

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
VOCAB_SIZE = 1000
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB_SIZE)]


def run_tool(name, *args):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", name), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def preprocess(input_path, prefix, *extra):
    return run_tool("preprocess_data.py", "--input", input_path, "--output-prefix", prefix, *NULL_TOKENIZER, *extra)


def corpus(count=300, seed=0):
    """Documents of whitespace-separated token ids, some long, in a reproducible order."""
    rng = np.random.default_rng(seed)
    return [" ".join(map(str, rng.integers(0, VOCAB_SIZE - 1, rng.integers(1, 40)))) for _ in range(count)]


def write_jsonl(path, texts, key="text"):
    with (gzip.open(path, "wt") if str(path).endswith(".gz") else open(path, "w")) as f:
        f.writelines(json.dumps({key: text, "id": i}) + "\n" for i, text in enumerate(texts))
    return path


def tokenized(texts, append_eod=False):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB_SIZE)
    documents = [tokenizer.encode(text) for text in texts]
    return [d + [tokenizer.eod] if append_eod else d for d in documents if d]


def read_documents(prefix):
    return [list(map(int, sequence)) for sequence in IndexedDataset(str(prefix))[:]]


def final_outputs(directory):
    return sorted(name for name in os.listdir(directory) if name.endswith((".bin", ".idx")))


@pytest.mark.parametrize("workers", [1, 2])
def test_read_back_equals_direct_tokenization_in_input_order(tmp_path, workers):
    texts = corpus()
    result = preprocess(write_jsonl(tmp_path / "in.jsonl", texts), tmp_path / "out", "--workers", workers,
                        "--chunk-size", 16)
    assert_succeeded(result, tail=None)
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert dataset.dtype == np.uint16
    assert read_documents(tmp_path / "out_text_document") == tokenized(texts)
    np.testing.assert_array_equal(dataset.document_indices, np.arange(len(texts) + 1))
    assert f"done: {len(texts)} documents" in result.stderr


def test_append_eod_ends_every_document_with_eod(tmp_path):
    texts = corpus(50)
    result = preprocess(write_jsonl(tmp_path / "in.jsonl", texts), tmp_path / "out", "--append-eod")
    assert_succeeded(result, tail=None)
    documents = read_documents(tmp_path / "out_text_document")
    assert documents == tokenized(texts, append_eod=True)
    assert all(d[-1] == VOCAB_SIZE - 1 for d in documents)


def test_gzipped_jsonl_and_several_keys(tmp_path):
    path = tmp_path / "in.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"text": "1 2 3", "title": "7"}) + "\n" + json.dumps({"text": "4", "title": "8 9"}) + "\n")
    result = preprocess(path, tmp_path / "out", "--json-keys", "text", "title", "--workers", 2)
    assert_succeeded(result, tail=None)
    assert read_documents(tmp_path / "out_text_document") == [[1, 2, 3], [4]]
    assert read_documents(tmp_path / "out_title_document") == [[7], [8, 9]]


def test_text_input_is_one_document_per_line(tmp_path):
    (tmp_path / "in.txt").write_text("1 2\n\n3 4 5\n")
    result = preprocess(tmp_path / "in.txt", tmp_path / "out")
    assert_succeeded(result, tail=None)
    assert read_documents(tmp_path / "out_text_document") == [[1, 2], [3, 4, 5]]
    assert "1 empty documents skipped" in result.stderr
    (tmp_path / "plain").write_text("6 7\n")
    result = preprocess(tmp_path / "plain", tmp_path / "forced", "--input-format", "text")
    assert read_documents(tmp_path / "forced_text_document") == [[6, 7]]


def test_empty_documents_are_skipped_and_counted(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", ["1 2", "", "   ", "3"])
    result = preprocess(path, tmp_path / "out", "--append-eod")
    assert_succeeded(result, tail=None)
    assert read_documents(tmp_path / "out_text_document") == [[1, 2, VOCAB_SIZE - 1], [3, VOCAB_SIZE - 1]]
    assert "done: 4 documents, 2 empty documents skipped" in result.stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_line_is_an_error_with_its_line_number(tmp_path, workers):
    path = write_jsonl(tmp_path / "in.jsonl", corpus(40))
    lines = path.read_text().splitlines()
    lines[32] = '{"text": "1 2'
    path.write_text("\n".join(lines) + "\n")
    result = preprocess(path, tmp_path / "out", "--workers", workers, "--chunk-size", 8)
    assert result.returncode == 2
    assert f"{path}:33: malformed line" in result.stderr and "--skip-bad-lines" in result.stderr
    assert "Traceback" not in result.stderr
    assert final_outputs(tmp_path) == []


def test_skip_bad_lines_counts_and_skips_them(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "1"}\nnot json\n[1, 2]\n\xff\xfe\n{"text": "2 3"}\n')
    result = preprocess(path, tmp_path / "out", "--skip-bad-lines")
    assert_succeeded(result, tail=None)
    assert read_documents(tmp_path / "out_text_document") == [[1], [2, 3]]
    assert "3 bad lines skipped" in result.stderr


def test_missing_key_is_an_error_with_file_and_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "1"}\n{"body": "2"}\n')
    result = preprocess(path, tmp_path / "out")
    assert result.returncode == 2
    assert f"{path}:2: no key 'text'" in result.stderr and "Traceback" not in result.stderr
    assert final_outputs(tmp_path) == []


def test_token_ids_outside_the_vocabulary_are_an_error(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", ["1 2", f"3 {VOCAB_SIZE}"])
    result = preprocess(path, tmp_path / "out", "--workers", 2)
    assert result.returncode == 2
    assert f"{path}:2" in result.stderr and str(VOCAB_SIZE) in result.stderr
    assert "Traceback" not in result.stderr
    assert final_outputs(tmp_path) == []


def test_missing_input_file_is_an_error(tmp_path):
    result = preprocess(tmp_path / "absent.jsonl", tmp_path / "out")
    assert result.returncode == 2 and "absent.jsonl: file not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_truncated_gzip_is_an_error(tmp_path):
    whole = write_jsonl(tmp_path / "whole.jsonl.gz", corpus(2000)).read_bytes()
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    result = preprocess(tmp_path / "cut.jsonl.gz", tmp_path / "out", "--workers", 2)
    assert result.returncode == 2 and "cut.jsonl.gz: cannot read line" in result.stderr
    assert "Traceback" not in result.stderr
    assert final_outputs(tmp_path) == []


def test_progress_lines_report_throughput(tmp_path):
    result = preprocess(write_jsonl(tmp_path / "in.jsonl", corpus(100)), tmp_path / "out", "--log-interval", 10,
                        "--chunk-size", 10)
    progress = [line for line in result.stderr.splitlines() if line.startswith("processed")]
    assert len(progress) == 10 and all("docs/s" in line and "MB/s" in line for line in progress)
    assert "tokens" in result.stderr and "MB in" in result.stderr


# ---------------------------------------------------------------------------------------------- merging


def test_merge_equals_concatenation(tmp_path):
    first, second = corpus(30, seed=1), corpus(20, seed=2)
    for name, texts in (("a", first), ("b", second)):
        assert preprocess(write_jsonl(tmp_path / f"{name}.jsonl", texts), tmp_path / name).returncode == 0
    result = run_tool("merge_datasets.py", "--input", tmp_path / "a_text_document", tmp_path / "b_text_document",
                      "--output-prefix", tmp_path / "merged" / "ab")
    assert_succeeded(result, tail=None)
    merged = IndexedDataset(str(tmp_path / "merged" / "ab"))
    assert read_documents(tmp_path / "merged" / "ab") == tokenized(first) + tokenized(second)
    np.testing.assert_array_equal(merged.document_indices, np.arange(51))
    expected_bytes = (tmp_path / "a_text_document.bin").read_bytes() + (tmp_path / "b_text_document.bin").read_bytes()
    assert (tmp_path / "merged" / "ab.bin").read_bytes() == expected_bytes


def test_merge_takes_every_dataset_of_a_folder_in_name_order(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for name, text in (("shard_1", "3 4"), ("shard_0", "1 2")):
        assert preprocess(write_jsonl(tmp_path / f"{name}.jsonl", [text]), shards / name).returncode == 0
    result = run_tool("merge_datasets.py", "--input-dir", shards, "--output-prefix", tmp_path / "all")
    assert_succeeded(result, tail=None)
    assert read_documents(tmp_path / "all") == [[1, 2], [3, 4]]


def test_merge_refuses_different_dtypes_and_writes_nothing(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", ["1 2"])
    assert preprocess(path, tmp_path / "small").returncode == 0
    wide = run_tool("preprocess_data.py", "--input", path, "--output-prefix", tmp_path / "wide",
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", 70000)
    assert_succeeded(wide, tail=None)
    result = run_tool("merge_datasets.py", "--input", tmp_path / "small_text_document",
                      tmp_path / "wide_text_document", "--output-prefix", tmp_path / "merged")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "small_text_document (dtype uint16)" in result.stderr and "wide_text_document (dtype int32)" in result.stderr
    assert not any(name.startswith("merged") for name in os.listdir(tmp_path))
