"""Rotary position embedding (RoPE), rotate-half convention (as in LLaMA and Hugging Face): the angles here,
the rotation in core/fusions/fused_rope.py (re-exported: apply_rotary_pos_emb rotates one tensor).

Partial rotary (Megatron's --rotary-percent, GPT-NeoX's rotary_pct): the embedding is built over
rotary_dim = int(head_dim * rotary_percent) channels (its frequencies over rotary_dim), `apply_rotary`
rotates the leading rotary_dim channels of each query and key head (rotate-half within them) and passes
the others through unchanged. At rotary_dim == head_dim it is the plain rotation, with no slicing.

RoPE scaling, computed as transformers' rope init functions compute it (so converted models match):
  - LLaMA-3.1's (Megatron's --use-rope-scaling, transformers' rope_type "llama3"): each inverse frequency by
    its wavelength against the original context: shorter than original / high_freq_factor kept, longer than
    original / low_freq_factor divided by the factor, those between blended smoothly.
  - YaRN (--rope-type yarn, rope_type "yarn", DeepSeek-V3's context extension): each inverse frequency
    blended between the extrapolated (base's) and the interpolated (base's / factor) by a linear ramp over
    the frequencies between those turning beta_fast and beta_slow times over the original context; cos and
    sin multiplied by the attention factor get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)."""
import math
from dataclasses import dataclass

import torch

from megatron_ds.core.fusions.fused_rope import apply_rotary_pos_emb, rotary_pos_emb_reference

__all__ = ["Llama3Scaling", "RotaryEmbedding", "YarnScaling", "apply_rotary", "apply_rotary_pos_emb",
           "inverse_frequencies", "rope_scaling_of", "yarn_get_mscale"]


def inverse_frequencies(rotary_dim, base):
    """Plain RoPE's 1 / base^(2i / rotary_dim), i < rotary_dim / 2."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


@dataclass(frozen=True)
class Llama3Scaling:
    """LLaMA-3.1's RoPE scaling; Megatron fixes all but the factor at LLaMA-3.1's values."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor = 1.0

    def scale(self, inv_freq, rotary_dim, base):
        original = self.original_max_position_embeddings
        wavelength = 2 * math.pi / inv_freq
        kept_or_divided = torch.where(wavelength > original / self.low_freq_factor, inv_freq / self.factor, inv_freq)
        smooth = (original / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * kept_or_divided / self.factor + smooth * kept_or_divided
        between = ~(wavelength < original / self.high_freq_factor) * ~(wavelength > original / self.low_freq_factor)
        return torch.where(between, blended, kept_or_divided)


def yarn_get_mscale(scale, mscale=1.0):
    """YaRN's attention scale for a context extended `scale` times: 0.1 mscale ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's RoPE scaling (the correction range's ends rounded to whole frequencies, as Megatron-Core and
    transformers do by default)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @property
    def attention_factor(self):
        return float(yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim))

    def scale(self, inv_freq, rotary_dim, base):
        powers = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
        interpolated = 1.0 / (self.factor * powers)
        low, high = self._ramp_ends(rotary_dim, base)
        if low == high:
            high += 0.001  # transformers' guard against a ramp of zero width, kept for identical frequencies
        extrapolated_share = 1 - torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low)
                                             / (high - low), 0, 1)
        return interpolated * (1 - extrapolated_share) + inv_freq * extrapolated_share

    def _ramp_ends(self, rotary_dim, base):
        """The frequency indices where the ramp starts (beta_fast turns) and ends (beta_slow turns)."""
        def index_turning(turns):
            return rotary_dim * math.log(self.original_max_position_embeddings / (turns * 2 * math.pi)) / \
                (2 * math.log(base))
        return max(math.floor(index_turning(self.beta_fast)), 0), \
            min(math.ceil(index_turning(self.beta_slow)), rotary_dim - 1)


def rope_scaling_of(config):
    """The RoPE scaling a TransformerConfig asks for: Llama3Scaling, YarnScaling or None (plain RoPE)."""
    if config.use_rope_scaling:
        return Llama3Scaling(factor=config.rope_scaling_factor)
    if config.rope_type == "yarn":
        return YarnScaling(config.rotary_scaling_factor, config.original_max_position_embeddings, config.beta_fast,
                           config.beta_slow, config.mscale, config.mscale_all_dim)
    return None


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rotary_dim, base=10000.0, scaling=None):
        """rotary_dim: the channels of a head it rotates (the head dimension, or fewer for partial rotary);
        scaling: a Llama3Scaling or YarnScaling, or None."""
        super().__init__()
        if rotary_dim % 2 or rotary_dim < 2:
            raise ValueError(f"rotary embeddings need an even rotary dimension >= 2, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        inv_freq = inverse_frequencies(rotary_dim, base)
        if scaling is not None:
            inv_freq = scaling.scale(inv_freq, rotary_dim, base)
        self.attention_factor = 1.0 if scaling is None else scaling.attention_factor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def from_config(cls, config):
        return cls(config.rotary_dim, config.rotary_base, rope_scaling_of(config))

    def forward(self, seq_len, device, offset=0, positions=None):
        """cos, sin of shape [s, 1, 1, rotary_dim] for positions offset .. offset + seq_len - 1, or for the given
        positions (a LongTensor of seq_len: a rank's tokens under context parallelism); YaRN: times its attention
        factor."""
        positions = (torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32) if positions is None
                     else positions.to(device=device, dtype=torch.float32))
        freqs = torch.outer(positions, self.inv_freq.to(device))
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        if self.attention_factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rotary(query, key, cos, sin, rotary_pos_emb=rotary_pos_emb_reference):
    """(query, key) [s, b, heads, d] with their leading r = cos.size(-1) channels rotated by rotary_pos_emb (a
    core.fusions rotary_pos_emb op) and the other d - r channels passed through; r == d: rotary_pos_emb itself."""
    r = cos.size(-1)
    if r == query.size(-1):
        return rotary_pos_emb(query, key, cos, sin)
    query_rot, key_rot = rotary_pos_emb(query[..., :r], key[..., :r], cos, sin)
    return torch.cat((query_rot, query[..., r:]), dim=-1), torch.cat((key_rot, key[..., r:]), dim=-1)
