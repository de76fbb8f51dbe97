"""Models, layouts and flags shared by the planning unit tests (tests/unit/planning/) and the tool's
tests (tests/unit/tools/test_plan.py). Each case also has the pretrain.py/tools/plan.py flags that describe it, so the
tool's tests can check that the flags resolve to the very model and layout the unit tests work out by hand."""
import dataclasses

import torch

from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.launch.devices import device_spec
from megatron_ds.planning.model import Cluster, Layout, ModelSpec

FAMILIES = {
    "gpt2": dict(),
    "llama": dict(normalization="RMSNorm", gated_linear_unit=True, bias=False, position_embedding_type="rope",
                  num_query_groups=4, ffn_hidden_size=96),
}
FAMILY_FLAGS = {   # the same families as pretrain.py flags
    "gpt2": [],
    "llama": ["--normalization", "RMSNorm", "--swiglu", "--use-rotary-position-embeddings", "--disable-bias-linear",
              "--num-key-value-heads", "4", "--ffn-hidden-size", "96"],
}


def small_model(family="gpt2", tied=True, layers=4, vocab_size=300, divisible_by=8):
    """h 32, a 8 (d 4), s 16, 16 positions; llama: 4 kv heads, SwiGLU FFN 96, RMSNorm, RoPE, no biases."""
    config = TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=8, **FAMILIES[family])
    return ModelSpec(config, vocab_size=vocab_size, make_vocab_size_divisible_by=divisible_by,
                     max_position_embeddings=16, seq_length=16, tied_embeddings=tied)


def count_parameters(module):
    return sum(param.numel() for param in module.parameters())


# ---------------------------------------------------------------- the by-hand case

HAND_CASE_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                   "--vocab-size", "256", "--bf16", "--tensor-model-parallel-size", "2",
                   "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "16",
                   "--world-size", "8", "--device", "cpu"]


def hand_case():
    """GPT-2 shape: l 4, h 64, a 4, s 32, V 256 (no padding at TP 2), bf16, tied; TP 2 x PP 2 x DP 2,
    micro batch 2, global batch 16 -> 4 micro-batches, ZeRO-1."""
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, params_dtype=torch.bfloat16)
    model = ModelSpec(config, vocab_size=256, make_vocab_size_divisible_by=128, max_position_embeddings=32,
                      seq_length=32, tied_embeddings=True)
    return model, Layout(tp=2, pp=2, dp=2, micro_batch_size=2, global_batch_size=16)


ULYSSES_CASE_FLAGS = HAND_CASE_FLAGS[:-4] + ["--ds-sequence-parallel-size", "2", "--world-size", "16",
                                             "--device", "cpu"]


def ulysses_case():
    """The hand case with DeepSpeed-Ulysses 2: TP 2 x Ulysses 2 x PP 2 x DP 2 on 16 ranks
    (tests/unit/planning/test_ulysses.py)."""
    model, layout = hand_case()
    return model, dataclasses.replace(layout, ulysses=2)


def cpu_cluster(world_size=8, gpus_per_node=8):
    """The nominal "cpu" device: 2 TFLOP/s, 64 GiB, HBM 100 GB/s, 20 GB/s within a node, 1.25 GB/s between."""
    return Cluster(device_spec("cpu"), world_size, gpus_per_node)


# ---------------------------------------------------------------- the pipeline-time case

TIME_CASE_FLAGS = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                   "--pipeline-model-parallel-size", "4", "--micro-batch-size", "1", "--global-batch-size", "8",
                   "--world-size", "8", "--device", "cpu"]


def time_case():
    """GPT-2 shape: l 8, h 64, a 4, s 32, the planner's default vocabulary 51200, fp32, tied; TP 1 x PP 4 x
    DP 2 (world 8), micro batch 1, global batch 8 -> 4 micro-batches."""
    config = TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4)
    model = ModelSpec(config, vocab_size=51200, make_vocab_size_divisible_by=128, max_position_embeddings=32,
                      seq_length=32, tied_embeddings=True)
    return model, Layout(tp=1, pp=4, dp=2, micro_batch_size=1, global_batch_size=8)
