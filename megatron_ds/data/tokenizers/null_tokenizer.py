"""No tokenizer: the text is already whitespace-separated token ids (benchmarks, tests)."""
from .base import MegatronTokenizer, as_int_list


class NullTokenizer(MegatronTokenizer):
    name = "NullTokenizer"

    def __init__(self, vocab_size):
        if vocab_size < 2:
            raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1

    def encode(self, text):
        return [self._parse_id(word) for word in text.split()]

    def decode(self, ids):
        return " ".join(str(i) for i in as_int_list(ids))

    def _parse_id(self, word):
        try:
            token = int(word)
        except ValueError:
            raise ValueError(f"NullTokenizer: {word!r} is not an integer token id") from None
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"NullTokenizer: token id {token} is outside [0, {self.vocab_size})")
        return token
