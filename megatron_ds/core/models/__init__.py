"""Models built from core's layers.

    gpt/  GPT: GPTModel, its layer specs for DeepSpeed's pipeline, its loss and FLOPs
"""
