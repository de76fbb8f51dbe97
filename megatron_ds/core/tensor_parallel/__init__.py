"""Tensor parallelism: layers whose weights are split over the TP ranks, and what moves between them.

    layers.py         column- and row-parallel linears, the vocab-parallel embedding
    mappings.py       the conjugate communication operators between replicated and TP regions (and SP)
    random.py         RNG states for TP regions; deterministic full-model initialization
    cross_entropy.py  cross entropy over vocab-parallel logits
    kl_divergence.py  the distillation term over vocab-parallel logits
    fp8.py            FP8 GEMMs (tensorwise, rowwise, DeepSeek's blockwise) forward and backward, exact under TP
    fp8_delayed.py    FP8 delayed scaling: each linear's amax history, its scales moved once per step
"""
from megatron_ds.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_ds.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron_ds.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_ds.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    init_method_normal,
    initialize_deterministically,
    model_parallel_cuda_manual_seed,
)
