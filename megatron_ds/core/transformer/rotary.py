"""Rotary position embedding (RoPE), rotate-half convention (as in LLaMA and Hugging Face): the angles here,
the rotation in core/fusions/fused_rope.py (re-exported: apply_rotary_pos_emb rotates one tensor)."""
import torch

from megatron_ds.core.fusions.fused_rope import apply_rotary_pos_emb

__all__ = ["RotaryEmbedding", "apply_rotary_pos_emb"]


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim, base=10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dimension, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len, device, offset=0):
        """cos, sin of shape [s, 1, 1, d] for positions offset .. offset + seq_len - 1."""
        positions = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.to(device))
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        return angles.cos(), angles.sin()

