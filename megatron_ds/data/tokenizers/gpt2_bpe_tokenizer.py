"""GPT-2's byte-level BPE from its vocab.json and merges.txt, run by the `tokenizers` library."""
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from .base import MegatronTokenizer, as_int_list, load_error, require_file

END_OF_TEXT = "<|endoftext|>"


class GPT2BPETokenizer(MegatronTokenizer):
    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file, merge_file):
        require_file("--vocab-file", vocab_file)
        require_file("--merge-file", merge_file)
        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as error:  # the library raises a bare Exception for unreadable files
            raise load_error("--vocab-file", vocab_file, f"a GPT-2 BPE with --merge-file {merge_file}",
                             error) from None
        self._tokenizer = Tokenizer(bpe)
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        eod = self._tokenizer.token_to_id(END_OF_TEXT)
        if eod is None:
            raise ValueError(f"--vocab-file {vocab_file}: no {END_OF_TEXT} token, so there is no "
                             "end-of-document id")
        # Registered as special so that a literal "<|endoftext|>" in text encodes to the one eod id.
        self._tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True)])
        self.eod = eod
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text):
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self._tokenizer.decode(as_int_list(ids), skip_special_tokens=False)
