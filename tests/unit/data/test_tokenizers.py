"""build_tokenizer: every Megatron tokenizer type round-trips text, reports eod and vocab_size, and refuses
bad input with a ValueError that names the flag and the file."""
import json
import re

import numpy as np
import pytest
import sentencepiece
from tokenizers import ByteLevelBPETokenizer

from megatron_ds.data.tokenizers import build_tokenizer
from tests.support.corpus import run_train_tokenizer, sample_sentences, write_jsonl
from tests.support.launch import assert_succeeded

SAMPLES = ["Hello world.", "  two  spaces, a tab\tand a\nnewline ", "Ünïcode ☃ and 漢字", ""]


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sentencepiece")
    corpus = write_jsonl(folder / "corpus.jsonl", sample_sentences(300))
    result = run_train_tokenizer("--input", corpus, "--output-prefix", folder / "sp", "--vocab-size", 400,
                                 "--byte-fallback")
    assert_succeeded(result, tail=None)
    return str(folder / "sp.model")


def byte_level_bpe(folder, special_tokens):
    """A small GPT-2 style byte-level BPE saved as vocab.json + merges.txt and as tokenizer.json."""
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(sample_sentences(300), vocab_size=400, special_tokens=special_tokens,
                                show_progress=False)
    trainer.save_model(str(folder))
    trainer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    return byte_level_bpe(tmp_path_factory.mktemp("gpt2"), ["<|endoftext|>"])


def assert_round_trips(tokenizer):
    for text in SAMPLES:
        ids = tokenizer.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
        assert tokenizer.tokenize(text) == ids and tokenizer.detokenize(ids) == text


def test_sentencepiece_round_trip_eod_and_vocab_size(sentencepiece_model):
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    assert_round_trips(tokenizer)
    assert (tokenizer.name, tokenizer.vocab_size, tokenizer.eod) == ("SentencePieceTokenizer", 400, 2)
    ids = tokenizer.encode("The model reads.")
    assert tokenizer.decode(np.array(ids)) == "The model reads."


def test_sentencepiece_model_without_eos_is_refused(tmp_path):
    model_file = tmp_path / "no_eos.model"
    with open(model_file, "wb") as writer:
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(sample_sentences(100)), model_writer=writer,
                                                 vocab_size=60, eos_id=-1, minloglevel=2)
    with pytest.raises(ValueError, match=re.escape(f"--tokenizer-model {model_file}: the model has no eos piece")):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(model_file))


def test_gpt2_bpe_round_trip_eod_and_vocab_size(gpt2_files):
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(gpt2_files / "vocab.json"),
                                merge_file=str(gpt2_files / "merges.txt"))
    assert_round_trips(tokenizer)
    vocab = json.loads((gpt2_files / "vocab.json").read_text())
    assert tokenizer.vocab_size == len(vocab) == 400
    assert tokenizer.eod == vocab["<|endoftext|>"]
    assert tokenizer.encode("<|endoftext|>") == [tokenizer.eod]
    assert tokenizer.name == "GPT2BPETokenizer"


def test_gpt2_bpe_without_endoftext_is_refused(tmp_path):
    byte_level_bpe(tmp_path, special_tokens=[])
    with pytest.raises(ValueError, match=re.escape(f"--vocab-file {tmp_path / 'vocab.json'}: no <|endoftext|>")):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                        merge_file=str(tmp_path / "merges.txt"))


def test_huggingface_from_file_and_from_folder(gpt2_files):
    from_file = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(gpt2_files / "tokenizer.json"))
    from_folder = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(gpt2_files))
    for tokenizer in (from_file, from_folder):
        assert_round_trips(tokenizer)
        assert (tokenizer.vocab_size, tokenizer.eod) == (400, from_file.encode("<|endoftext|>")[0])
    assert from_file.encode("Hello world.") == from_folder.encode("Hello world.")


def test_huggingface_eos_from_tokenizer_config(tmp_path):
    byte_level_bpe(tmp_path, special_tokens=["</s>", "<|im_end|>"])
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path)).eod == 0  # </s>
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path)).eod == 1


def test_huggingface_without_eos_is_refused(tmp_path):
    byte_level_bpe(tmp_path, special_tokens=["<pad>"])
    with pytest.raises(ValueError, match="tokenizer.json: no eos token"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


def test_null_tokenizer_parses_integers():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=10)
    assert tokenizer.encode("1 2 3") == tokenizer.tokenize(" 1\n2  3 ") == [1, 2, 3]
    assert tokenizer.decode([1, 2, 3]) == tokenizer.detokenize(np.array([1, 2, 3])) == "1 2 3"
    assert (tokenizer.name, tokenizer.vocab_size, tokenizer.eod) == ("NullTokenizer", 10, 9)
    with pytest.raises(ValueError, match="'x' is not an integer"):
        tokenizer.encode("1 x")
    with pytest.raises(ValueError, match=r"token id 10 is outside \[0, 10\)"):
        tokenizer.encode("10")


@pytest.mark.parametrize("tokenizer_type, arguments, message", [
    ("SentencePieceTokenizer", {}, "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model"),
    ("GPT2BPETokenizer", {"vocab_file": "v.json"}, "--tokenizer-type GPT2BPETokenizer needs --vocab-file and "
                                                   "--merge-file"),
    ("HuggingFaceTokenizer", {}, "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
    ("NullTokenizer", {}, "--tokenizer-type NullTokenizer needs --vocab-size"),
    ("NullTokenizer", {"vocab_size": 1}, "--vocab-size >= 2, got 1"),
    ("BertWordPieceLowerCase", {}, "--tokenizer-type BertWordPieceLowerCase: unknown; choose one of "
                                   "SentencePieceTokenizer, GPT2BPETokenizer"),
])
def test_missing_arguments_and_unknown_types(tokenizer_type, arguments, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer(tokenizer_type, **arguments)


@pytest.mark.parametrize("tokenizer_type, flag", [
    ("SentencePieceTokenizer", "--tokenizer-model"), ("HuggingFaceTokenizer", "--tokenizer-model"),
    ("GPT2BPETokenizer", "--vocab-file"), ("GPT2BPETokenizer", "--merge-file")])
def test_missing_files_name_the_flag(tmp_path, gpt2_files, tokenizer_type, flag):
    absent = str(tmp_path / "absent" / "file")
    arguments = {"vocab_file": str(gpt2_files / "vocab.json"), "merge_file": str(gpt2_files / "merges.txt"),
                 flag.removeprefix("--").replace("-", "_"): absent}
    if tokenizer_type != "GPT2BPETokenizer":
        arguments = {"tokenizer_model": absent}
    with pytest.raises(ValueError, match=re.escape(f"{flag} {absent}: file not found")):
        build_tokenizer(tokenizer_type, **arguments)


def test_files_that_do_not_load_name_the_flag(tmp_path):
    garbage = tmp_path / "garbage"
    garbage.write_text("not a tokenizer")
    cases = [("SentencePieceTokenizer", {"tokenizer_model": str(garbage)},
              f"--tokenizer-model {garbage}: cannot load a SentencePiece model"),
             ("HuggingFaceTokenizer", {"tokenizer_model": str(garbage)},
              f"--tokenizer-model {garbage}: cannot load a tokenizers tokenizer.json"),
             ("GPT2BPETokenizer", {"vocab_file": str(garbage), "merge_file": str(garbage)},
              f"--vocab-file {garbage}: cannot load a GPT-2 BPE with --merge-file {garbage}")]
    for tokenizer_type, arguments, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            build_tokenizer(tokenizer_type, **arguments)
