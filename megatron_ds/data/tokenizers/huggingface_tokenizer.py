"""Any tokenizer saved as a `tokenizers` tokenizer.json (Llama, Mistral, GPT-NeoX, ...), read from disk only."""
import json
import os

from tokenizers import Tokenizer

from .base import MegatronTokenizer, as_int_list, load_error

# Tried in order when no tokenizer_config.json beside tokenizer.json names the eos token.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")


class HuggingFaceTokenizer(MegatronTokenizer):
    name = "HuggingFaceTokenizer"

    def __init__(self, path):
        tokenizer_file = _tokenizer_json(path)
        try:
            self._tokenizer = Tokenizer.from_file(tokenizer_file)
        except Exception as error:  # the library raises a bare Exception for unreadable files
            raise load_error("--tokenizer-model", tokenizer_file, "a tokenizers tokenizer.json", error) from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod = self._eos_id(tokenizer_file)

    def encode(self, text):
        """Text tokens only: no BOS/EOS from the tokenizer's post-processor (the dataset appends eod)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self._tokenizer.decode(as_int_list(ids), skip_special_tokens=False)

    def _eos_id(self, tokenizer_file):
        candidates = [_configured_eos_token(tokenizer_file), *EOS_CANDIDATES]
        for token in candidates:
            if token is not None and self._tokenizer.token_to_id(token) is not None:
                return self._tokenizer.token_to_id(token)
        raise ValueError(f"--tokenizer-model {tokenizer_file}: no eos token (looked for "
                         f"{', '.join(EOS_CANDIDATES)}), so there is no end-of-document id")


def _tokenizer_json(path):
    """path if it is a file, path/tokenizer.json if it is a folder; else a ValueError."""
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer-model {path}: file not found")
    return path


def _configured_eos_token(tokenizer_file):
    """The eos_token of a tokenizer_config.json next to tokenizer.json, if there is one."""
    config_file = os.path.join(os.path.dirname(tokenizer_file), "tokenizer_config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos
