"""The transformer layer and its parts.

    transformer_config.py  TransformerConfig: the one validated description of a transformer's shape and numerics
    transformer_layer.py   the pre-norm layer on sequence-first tensors, with recompute
    attention.py           self-attention: QKV column-parallel, core attention, Ulysses
    ring_attention.py      context-parallel attention: K/V blocks round the ring (p2p) or gathered, causal load balance
    multi_latent_attention.py  multi-latent attention (DeepSeek-V3's): queries, keys and values through low-rank latents
    multi_token_prediction.py  multi-token prediction (DeepSeek-V3's): modules after the last layer, their loss
    mlp.py                 the MLP: GeLU or SwiGLU, column- then row-parallel
    moe.py                 Mixture of Experts on DeepSpeed-MoE's layer (Megatron-DeepSpeed's flags)
    dropless_moe.py        dropless Mixture of Experts on DeepSpeed's router and grouped experts (Megatron-Core's)
    norms.py               LayerNorm and RMSNorm parameters (the math in fusions/)
    rotary.py              rotary position embedding: the angles, scaled as LLaMA-3.1 or YaRN (rotation: fusions/)
    fused_ops.py           which fusions implementation each op of the model runs
"""
from megatron_ds.core.transformer.transformer_config import TransformerConfig
from megatron_ds.core.transformer.transformer_layer import TransformerLayer
