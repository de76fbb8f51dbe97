"""tools/train_tokenizer.py: trains a SentencePiece model from JSONL or text, with eos defined; bad input is
one line on stderr and exit status 2."""
import gzip

import sentencepiece

from tests.support.corpus import run_train_tokenizer, sample_sentences, write_jsonl
from tests.support.launch import assert_succeeded


def assert_usage_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_trains_from_jsonl_with_special_ids_and_leaves_no_temporary_files(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", sample_sentences(300))
    result = run_train_tokenizer("--input", corpus, "--output-prefix", tmp_path / "out" / "sp",
                                 "--vocab-size", 300, "--byte-fallback")
    assert_succeeded(result, tail=None)
    assert "trained a bpe SentencePiece model, vocab 300" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["sp.model", "sp.vocab"]
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "out" / "sp.model"))
    assert processor.vocab_size() == 300
    assert [processor.unk_id(), processor.bos_id(), processor.eos_id(), processor.pad_id()] == [0, 1, 2, 3]
    text = "The network reads  every token.\nÜber ☃"
    assert processor.decode(processor.encode(text)) == text


def test_trains_unigram_from_gzipped_text_detected_by_extension(tmp_path):
    corpus = tmp_path / "corpus.txt.gz"
    with gzip.open(corpus, "wt", encoding="utf-8") as f:
        f.write("\n".join(sample_sentences(300)) + "\n")
    result = run_train_tokenizer("--input", corpus, "--output-prefix", tmp_path / "uni", "--model-type",
                                 "unigram", "--vocab-size", 80)
    assert_succeeded(result, tail=None)
    assert "on 300 lines" in result.stdout
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "uni.model"))
    assert processor.vocab_size() == 80 and processor.eos_id() == 2


def test_user_defined_symbols_stay_whole(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", sample_sentences(200))
    result = run_train_tokenizer("--input", corpus, "--output-prefix", tmp_path / "sp", "--vocab-size", 100,
                                 "--user-defined-symbols", "<|im_start|>,<|im_end|>")
    assert_succeeded(result, tail=None)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert processor.piece_to_id("<|im_start|>") == 4
    assert processor.encode("<|im_end|>", out_type=str)[-1] == "<|im_end|>"


def test_missing_input_is_a_usage_error(tmp_path):
    result = run_train_tokenizer("--input", tmp_path / "absent.jsonl", "--output-prefix", tmp_path / "sp")
    assert_usage_error(result, "absent.jsonl: file not found")


def test_missing_json_key_names_the_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n', encoding="utf-8")
    result = run_train_tokenizer("--input", corpus, "--output-prefix", tmp_path / "sp")
    assert_usage_error(result, f"{corpus}:3: no key 'text' (keys: body)", "--json-keys")


def test_invalid_json_names_the_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a"}\nnot json\n', encoding="utf-8")
    assert_usage_error(run_train_tokenizer("--input", corpus, "--output-prefix", tmp_path / "sp"),
                       f"{corpus}:2: not valid JSON")


def test_vocabulary_too_large_for_the_corpus_is_a_usage_error(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", ["tiny corpus"])
    result = run_train_tokenizer("--input", corpus, "--output-prefix", tmp_path / "sp", "--vocab-size", 5000)
    assert_usage_error(result, "SentencePiece training failed")
    assert not (tmp_path / "sp.model").exists()
