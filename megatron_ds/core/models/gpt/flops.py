"""The model's FLOPs: the one formula that MFU in training and tools/plan.py both use.

Forward FLOPs per token: each layer 2 x (QKV + projection + MLP weights) for its GEMMs and 4 s a d for
QK^T and attention x V (no causal halving, Megatron's convention); the head 2 h V. Training = 3 x forward
(no recompute). For a GPT-2 shape this is Megatron's 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (Narayanan et
al. 2021, arXiv 2104.04473; see docs/formulas.md).
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardFlopsPerToken:
    layer_gemms: float       # one layer's weight GEMMs
    attention_scores: float  # one layer's QK^T and attention x V
    head: float              # the output head

    @property
    def layer(self) -> float:
        return self.layer_gemms + self.attention_scores


def forward_flops_per_token(config, seq_length, vocab_size) -> ForwardFlopsPerToken:
    """config: a TransformerConfig; vocab_size: the rows of the output head (padded)."""
    h, d, heads = config.hidden_size, config.kv_channels, config.num_attention_heads
    qkv = h * (heads + 2 * config.num_query_groups) * d
    mlp = h * config.ffn_hidden_size * (3 if config.gated_linear_unit else 2)
    return ForwardFlopsPerToken(layer_gemms=2 * (qkv + heads * d * h + mlp),
                                attention_scores=4 * seq_length * heads * d, head=2 * h * vocab_size)


def model_flops_per_iteration(config, vocab_size, global_batch_size, seq_length):
    """Model FLOPs of one training iteration (forward + backward = 3 x forward; recompute not counted)."""
    per_token = forward_flops_per_token(config, seq_length, vocab_size)
    return 3 * (config.num_layers * per_token.layer + per_token.head) * global_batch_size * seq_length
