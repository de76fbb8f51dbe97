"""Checkpoint conversions on top of megatron_ds.checkpointing.

    convert.py      the converter's operations: reshape to another TP/PP, export to and import from Hugging Face,
                    from and to Megatron-DeepSpeed's format
    huggingface.py  our canonical weights <-> Hugging Face `transformers` models
    hf_rope.py      Hugging Face's RoPE scaling (rope_type llama3, yarn) <-> our flags
    convert_cli.py  tools/convert_checkpoint.py's command line
"""
