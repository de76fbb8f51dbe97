"""A SentencePiece .model file, as trained by tools/train_tokenizer.py."""
import sentencepiece

from .base import MegatronTokenizer, as_int_list, load_error, require_file


class SentencePieceTokenizer(MegatronTokenizer):
    name = "SentencePieceTokenizer"

    def __init__(self, model_file):
        require_file("--tokenizer-model", model_file)
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as error:
            raise load_error("--tokenizer-model", model_file, "a SentencePiece model", error) from None
        self.vocab_size = self._processor.vocab_size()
        self.eod = self._processor.eos_id()
        if self.eod < 0:
            raise ValueError(f"--tokenizer-model {model_file}: the model has no eos piece, so there is no "
                             "end-of-document id; train it with one (tools/train_tokenizer.py does: eos id 2)")

    def encode(self, text):
        return self._processor.encode(text)

    def decode(self, ids):
        return self._processor.decode(as_int_list(ids))
