"""Checkpoint conversions on top of megatron_ds.checkpointing: Hugging Face mapping (huggingface), the
converter's operations (convert: reshape to another TP/PP, export to and import from Hugging Face) and
tools/convert_checkpoint.py's command line (cli)."""
