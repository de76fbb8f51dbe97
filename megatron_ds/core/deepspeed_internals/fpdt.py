"""DeepSpeed's FPDT attention (deepspeed.sequence.fpdt_layer.FPDT_Attention: Ulysses over chunks of the sequence,
the chunks' keys and values optionally kept in host memory), and the two flash-attn functions it calls, given
where the flash-attn package is missing (a CPU here; a GPU without it).

FPDT calls flash-attn's private `_flash_attn_forward` / `_flash_attn_backward` (2.7's signatures when
`flash_attn_version` says 2.7) through its module's globals, which stay None without the package, and then refuses
to build. `provide_flash_attn_functions` sets them to blocks the caller computes (attention.py hands in
ring_attention's attention_block / attention_block_backward: torch's flash kernels on a CPU, plain math in fp32
otherwise), in flash-attn's layout: q [b, l, heads, d], k and v [b, l, kv heads, d], the log-sum-exp [b, heads, l]
in fp32, the gradients written into the buffers given. Without dropout only: these blocks keep no dropout state
between forward and backward.
"""
from types import SimpleNamespace

import torch

_FLASH_ATTN_SIGNATURES = "2.7.0"  # the version whose argument lists the functions below take


def provide_flash_attn_functions(block, block_backward):
    """FPDT's flash-attn functions where flash-attn is not installed: block(q, k, v, scale, causal) -> (out, lse)
    and block_backward(q, k, v, out, grad_out, lse, scale, causal) -> (dq, dk, dv) on [b, heads, l, d] tensors.
    True when ours are in place."""
    from deepspeed.sequence import fpdt_layer
    from packaging import version
    if fpdt_layer._flash_attn_forward is not None and not getattr(fpdt_layer._flash_attn_forward, "ours", False):
        return False
    fpdt_layer._flash_attn_forward = _flash_forward(block)
    fpdt_layer._flash_attn_backward = _flash_backward(block_backward)
    fpdt_layer.flash_attn_version = version.parse(_FLASH_ATTN_SIGNATURES)
    return True


def _heads_first(tensor):
    return tensor.transpose(1, 2)


def _flash_forward(block):
    def forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                alibi_slopes=None, return_softmax=False):
        """flash-attn 2.7's _flash_attn_forward: (out [b, l, heads, d], lse [b, heads, l], None, None)."""
        _refuse_what_blocks_lack(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
        out, lse = block(_heads_first(q), _heads_first(k), _heads_first(v), softmax_scale, causal)
        return _heads_first(out).to(q.dtype), lse.float(), None, None
    forward.ours = True
    return forward


def _flash_backward(block_backward):
    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left=-1,
                 window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None):
        """flash-attn 2.7's _flash_attn_backward: dq, dk and dv written into the buffers given."""
        _refuse_what_blocks_lack(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
        grads = block_backward(_heads_first(q), _heads_first(k), _heads_first(v), _heads_first(out),
                               _heads_first(dout), softmax_lse, softmax_scale, causal)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer.copy_(_heads_first(grad))
        return dq, dk, dv
    return backward


def _refuse_what_blocks_lack(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes):
    if dropout_p or softcap or alibi_slopes is not None or (window_size_left, window_size_right) != (-1, -1):
        raise NotImplementedError(
            f"FPDT without the flash-attn package: its blocks here take no dropout, softcap, ALiBi or window (got "
            f"dropout {dropout_p}, softcap {softcap}, window ({window_size_left}, {window_size_right}))")


def fpdt_attention(hidden_states, qkv_weight, qkv_bias, dense_weight, rotary_angles, heads, kv_heads, group,
                   chunk_size, offloading, blocks):
    """DeepSpeed's FPDT_Attention over this TP rank's heads on [s, b, h]: the QKV weight's rows laid out [Q; K; V]
    (its layout, not ours), a bias always (zeros where the layer has none), rotary_angles the cos and sin
    [S, 1, 1, d] of the whole sequence (or None); returns the output projection's partial sum over these heads,
    [s, b, h], without bias. blocks: provide_flash_attn_functions' pair, used where flash-attn is missing."""
    from deepspeed.sequence.fpdt_layer import FPDT_Attention
    provide_flash_attn_functions(*blocks)
    head_dim = dense_weight.size(1) // heads
    config = SimpleNamespace(kv_channels=head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             hidden_size=dense_weight.size(0), attention_dropout=0.0)
    if qkv_bias is None:
        qkv_bias = torch.zeros(qkv_weight.size(0), dtype=qkv_weight.dtype, device=qkv_weight.device)
    module = FPDT_Attention(config, qkv_weight, qkv_bias, dense_weight, None, group, return_bias=True,
                            chunk_size=chunk_size)
    output, _ = module(hidden_states, None, None, rotary_angles, offloading)
    return output
