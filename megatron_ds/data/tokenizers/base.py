"""What every tokenizer offers, and the checks shared by their constructors."""
import os


class MegatronTokenizer:
    """A tokenizer with `vocab_size` (special tokens included), `eod` (the end-of-document id the dataset
    appends after each document), `encode`/`decode`, and Megatron's names `tokenize`/`detokenize`."""

    name = "MegatronTokenizer"
    vocab_size: int
    eod: int

    def encode(self, text):
        raise NotImplementedError

    def decode(self, ids):
        raise NotImplementedError

    def tokenize(self, text):
        return self.encode(text)

    def detokenize(self, ids):
        return self.decode(ids)

    def __repr__(self):
        return f"{self.name}(vocab_size={self.vocab_size}, eod={self.eod})"


def require_file(flag, path):
    """path itself, or a ValueError naming the flag when the file does not exist."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: file not found")
    return path


def load_error(flag, path, what, error):
    return ValueError(f"{flag} {path}: cannot load {what} ({error})")


def as_int_list(ids):
    """Plain ints from a list, a numpy array or a tensor: the C++ backends reject numpy/torch scalars."""
    return [int(i) for i in ids]
