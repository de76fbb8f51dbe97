"""Checkpoint formats megatron_ds did not write: read, converted and recognised.

    megatron_deepspeed.py   Megatron-DeepSpeed's checkpoints read as our own, and written in its format
    deepspeed_universal.py  DeepSpeed's universal checkpoint format, both ways
    recognition.py          checkpoints of other kinds named for what they hold
"""
