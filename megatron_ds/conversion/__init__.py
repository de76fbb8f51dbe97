"""Checkpoint formats and conversions: the on-disk folder (files), canonical names and TP/PP splitting
(layout), reading and writing model and optimizer state (state), Hugging Face mapping (huggingface), and
the converter's operations (convert)."""
