"""Inference on a trained checkpoint.

    generation.py  text generation with a KV cache on a tensor-parallel GPTModel (tools/generate.py)
"""
