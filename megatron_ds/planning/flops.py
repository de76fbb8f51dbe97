"""FLOPs per iteration: model FLOPs (what the model needs) and hardware FLOPs (what recompute adds).

Forward FLOPs per token: each layer 2 x (QKV + projection + MLP weights) for its GEMMs and 4 s a d for
QK^T and attention x V (no causal halving, Megatron's convention); the head 2 h V. Training = 3 x forward.
For a GPT-2 shape, model FLOPs = 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (DESIGN.md), the same number as
`model_flops_per_iteration`. Hardware FLOPs (DESIGN.md): selective recompute doubles the attention-score
term (s/(6h) -> s/(3h)); full recompute adds one forward of every recomputed layer (all of them with the
"uniform" method: 72 -> 96, V/(12lh) -> V/(16lh); "block" recomputes only N layers per stage).
"""
from dataclasses import dataclass

from megatron_ds.planning.model import Layout, ModelSpec


@dataclass(frozen=True)
class ForwardFlopsPerToken:
    layer_gemms: float       # one layer's weight GEMMs
    attention_scores: float  # one layer's QK^T and attention x V
    head: float              # the output head

    @property
    def layer(self) -> float:
        return self.layer_gemms + self.attention_scores


def forward_flops_per_token(model: ModelSpec, tp: int = 1) -> ForwardFlopsPerToken:
    """Vocabulary padded as for TP `tp` (as training's MFU counts it)."""
    config, s = model.config, model.seq_length
    h, d, heads = config.hidden_size, config.kv_channels, config.num_attention_heads
    qkv = h * (heads + 2 * config.num_query_groups) * d
    mlp = h * config.ffn_hidden_size * (3 if config.gated_linear_unit else 2)
    return ForwardFlopsPerToken(layer_gemms=2 * (qkv + heads * d * h + mlp), attention_scores=4 * s * heads * d,
                                head=2 * h * model.padded_vocab_size(tp))


def recompute_flops_per_token(model: ModelSpec, layout: Layout, num_layers: int) -> float:
    """Extra FLOPs per token that recompute adds on a stage of `num_layers` layers."""
    per_token = forward_flops_per_token(model, layout.tp)
    if layout.recompute == "selective":
        return num_layers * 3 * per_token.attention_scores
    return layout.recomputed_layers(num_layers) * per_token.layer


def model_flops_per_iteration(model: ModelSpec, layout: Layout) -> float:
    per_token = forward_flops_per_token(model, layout.tp)
    tokens = layout.global_batch_size * model.seq_length
    return 3 * (model.config.num_layers * per_token.layer + per_token.head) * tokens


def hardware_flops_per_iteration(model: ModelSpec, layout: Layout) -> float:
    tokens = layout.global_batch_size * model.seq_length
    extra = layout.pp * recompute_flops_per_token(model, layout, model.config.num_layers // layout.pp) * tokens
    return model_flops_per_iteration(model, layout) + extra


def stage_hardware_flops_per_micro_batch(model: ModelSpec, layout: Layout, num_layers: int, last: bool) -> float:
    """Hardware FLOPs one device of a stage runs for one micro-batch (forward + backward + recompute)."""
    per_token = forward_flops_per_token(model, layout.tp)
    flops = 3 * num_layers * per_token.layer + recompute_flops_per_token(model, layout, num_layers)
    if last:
        flops += 3 * per_token.head
    return flops * layout.micro_batch_size * model.seq_length / layout.tp
