"""Cross entropy over logits whose vocabulary dimension is split across TP ranks (the full logits are never
gathered on one rank), under Megatron-Core's name: the reference of core/fusions' cross_entropy op.

    vocab_parallel_cross_entropy(vocab_parallel_logits [..., V/tp], target [...]) -> per-token loss [...]
"""
from megatron_ds.core.fusions.fused_cross_entropy import cross_entropy_reference as vocab_parallel_cross_entropy

__all__ = ["vocab_parallel_cross_entropy"]
