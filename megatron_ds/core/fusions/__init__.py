"""Fused operations, one file each, every one with a plain-PyTorch reference (the definition of correct, and
what the model runs when an op's fusion is off or unavailable), Triton kernels (forward and backward), a
torch.compile path, apex for the norms when importable, and a registry that picks one per op from
`--fusion-backend` {auto, triton, compile, apex, reference}:

    bias_gelu = get_fused_op("bias_gelu", args.fusion_backend)      # once, at model build

Ops (all backends of an op share its signature):
    scale_mask_softmax(scores, mask=None, scale=1.0, causal=False)
    layer_norm(x, weight, bias=None, eps=1e-5), rms_norm(x, weight, bias=None, eps=1e-5)
    rotary_pos_emb(q, k, cos, sin) -> (q, k)
    bias_gelu(x, bias=None, approximate="none")
    bias_dropout_add(x, bias, residual, p, training)
    swiglu(x)
    cross_entropy(logits, target, chunk_rows=None)
    flash_attention(query, key, value, dropout_p, seed) (causal; seed from counter_hash.draw_seed)

The references compute in fp32 yet save for backward only what the fused kernels save (inputs or outputs
in their own dtype, 1-byte dropout masks). Every dropout, fused or not, keeps what the counter hash of one seed
drawn per call keeps (counter_hash.py, dropout.py); the fused kernels hash the mask where they use it and save
the seed.

    backends.py                which implementation serves each op; the registry and --fusion-backend
    fused_softmax.py           scale + mask + softmax of attention scores
    fused_layer_norm.py        LayerNorm and RMSNorm, statistics in fp32
    fused_rope.py              rotary embedding of query and key in one call
    fused_bias_gelu.py         bias + GeLU
    fused_bias_dropout_add.py  residual + dropout(x + bias)
    fused_swiglu.py            SwiGLU
    fused_cross_entropy.py     vocab-parallel cross entropy without fp32 logits all at once
    flash_attention.py         causal attention with dropout in blocks of queries
    dropout.py                 the one dropout mask of the model
    counter_hash.py            the counter-based hash every dropout mask comes from
    _triton.py                 the Triton import shim the ops share
    _recompute.py              autograd that saves an op's inputs alone
"""
from megatron_ds.core.fusions.backends import (
    BACKENDS,
    FLAG,
    FusedOp,
    auto_order,
    get_fused_op,
    is_available,
    registered_ops,
    select_backend,
    unavailable_reason,
)
from megatron_ds.core.fusions.dropout import dropout_keep_mask
from megatron_ds.core.fusions.flash_attention import (
    flash_attention_compile,
    flash_attention_reference,
    flash_attention_triton,
)
from megatron_ds.core.fusions.fused_bias_dropout_add import (
    bias_dropout_add_compile,
    bias_dropout_add_reference,
    bias_dropout_add_triton,
)
from megatron_ds.core.fusions.fused_bias_gelu import bias_gelu_compile, bias_gelu_reference, bias_gelu_triton
from megatron_ds.core.fusions.fused_cross_entropy import (
    cross_entropy_compile,
    cross_entropy_reference,
    cross_entropy_triton,
)
from megatron_ds.core.fusions.fused_layer_norm import (
    APEX_IMPORT_ERROR,
    layer_norm_apex,
    layer_norm_compile,
    layer_norm_reference,
    layer_norm_triton,
    rms_norm_apex,
    rms_norm_compile,
    rms_norm_reference,
    rms_norm_triton,
)
from megatron_ds.core.fusions.fused_rope import rotary_pos_emb_compile, rotary_pos_emb_reference, rotary_pos_emb_triton
from megatron_ds.core.fusions.fused_softmax import (
    causal_mask,
    scale_mask_softmax_compile,
    scale_mask_softmax_reference,
    scale_mask_softmax_triton,
)
from megatron_ds.core.fusions.fused_swiglu import swiglu_compile, swiglu_reference, swiglu_triton
