"""Rotary position embedding (RoPE), rotate-half convention (as in LLaMA and Hugging Face): the angles here,
the rotation in core/fusions/fused_rope.py (re-exported: apply_rotary_pos_emb rotates one tensor).

Partial rotary (Megatron's --rotary-percent, GPT-NeoX's rotary_pct): the embedding is built over
rotary_dim = int(head_dim * rotary_percent) channels (its frequencies over rotary_dim), `apply_rotary`
rotates the leading rotary_dim channels of each query and key head (rotate-half within them) and passes
the others through unchanged. At rotary_dim == head_dim it is the plain rotation, with no slicing."""
import torch

from megatron_ds.core.fusions.fused_rope import apply_rotary_pos_emb, rotary_pos_emb_reference

__all__ = ["RotaryEmbedding", "apply_rotary", "apply_rotary_pos_emb"]


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rotary_dim, base=10000.0):
        """rotary_dim: the channels of a head it rotates (the head dimension, or fewer for partial rotary)."""
        super().__init__()
        if rotary_dim % 2 or rotary_dim < 2:
            raise ValueError(f"rotary embeddings need an even rotary dimension >= 2, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len, device, offset=0):
        """cos, sin of shape [s, 1, 1, rotary_dim] for positions offset .. offset + seq_len - 1."""
        positions = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.to(device))
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        return angles.cos(), angles.sin()


def apply_rotary(query, key, cos, sin, rotary_pos_emb=rotary_pos_emb_reference):
    """(query, key) [s, b, heads, d] with their leading r = cos.size(-1) channels rotated by rotary_pos_emb (a
    core.fusions rotary_pos_emb op) and the other d - r channels passed through; r == d: rotary_pos_emb itself."""
    r = cos.size(-1)
    if r == query.size(-1):
        return rotary_pos_emb(query, key, cos, sin)
    query_rot, key_rot = rotary_pos_emb(query[..., :r], key[..., :r], cos, sin)
    return torch.cat((query_rot, query[..., r:]), dim=-1), torch.cat((key_rot, key[..., r:]), dim=-1)
