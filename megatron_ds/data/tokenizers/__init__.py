"""Tokenizers by Megatron's `--tokenizer-type` names, built from local files only (never a download).

    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model="data/demo.model")
    ids = tokenizer.encode("Hello world") + [tokenizer.eod]

    base.py                     what every tokenizer offers
    sentencepiece_tokenizer.py  a SentencePiece .model file
    gpt2_bpe_tokenizer.py       GPT-2's byte-level BPE (vocab.json, merges.txt)
    huggingface_tokenizer.py    a `tokenizers` tokenizer.json, read from disk only
    null_tokenizer.py           no tokenizer: the text is token ids
"""
from .base import MegatronTokenizer
from .gpt2_bpe_tokenizer import GPT2BPETokenizer
from .huggingface_tokenizer import HuggingFaceTokenizer
from .null_tokenizer import NullTokenizer
from .sentencepiece_tokenizer import SentencePieceTokenizer

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
# Megatron-DeepSpeed's names for the same tokenizers: its GPTSentencePieceTokenizer is a plain SentencePiece
# model whose eos is the end-of-document token, as ours
TOKENIZER_ALIASES = {"GPTSentencePieceTokenizer": "SentencePieceTokenizer", "HFTokenizer": "HuggingFaceTokenizer"}


def build_tokenizer(tokenizer_type, *, tokenizer_model=None, vocab_file=None, merge_file=None, vocab_size=None):
    """The tokenizer named by tokenizer_type; a ValueError naming the flag when an argument is missing."""
    tokenizer_type = TOKENIZER_ALIASES.get(tokenizer_type, tokenizer_type)
    if tokenizer_type == "SentencePieceTokenizer":
        _require(tokenizer_type, ("--tokenizer-model", tokenizer_model))
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        _require(tokenizer_type, ("--vocab-file", vocab_file), ("--merge-file", merge_file))
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        _require(tokenizer_type, ("--tokenizer-model", tokenizer_model))
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        _require(tokenizer_type, ("--vocab-size", vocab_size))
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type {tokenizer_type}: unknown; choose one of {', '.join(TOKENIZER_TYPES)}")


def _require(tokenizer_type, *flags_and_values):
    if any(value is None for _, value in flags_and_values):
        needed = " and ".join(flag for flag, _ in flags_and_values)
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {needed}")


__all__ = ["build_tokenizer", "MegatronTokenizer", "SentencePieceTokenizer", "GPT2BPETokenizer",
           "HuggingFaceTokenizer", "NullTokenizer", "TOKENIZER_ALIASES", "TOKENIZER_TYPES"]
