"""FLOPs per iteration on a layout: model FLOPs (the model's own formula, core/models/gpt/flops.py) and
hardware FLOPs (what recompute adds).

Hardware FLOPs (docs/formulas.md): selective recompute doubles the attention-score term (s/(6h) -> s/(3h));
full recompute adds one forward of every recomputed layer (all of them with the "uniform" method:
72 -> 96, V/(12lh) -> V/(16lh); "block" recomputes only N layers per stage).
"""
from megatron_ds.core.models.gpt import flops as model_flops
from megatron_ds.planning.model import Layout, ModelSpec


def forward_flops_per_token(model: ModelSpec, tp: int = 1) -> model_flops.ForwardFlopsPerToken:
    """Vocabulary padded as for TP `tp` (as training's MFU counts it)."""
    return model_flops.forward_flops_per_token(model.config, model.seq_length, model.padded_vocab_size(tp))


def recompute_flops_per_token(model: ModelSpec, layout: Layout, num_layers: int) -> float:
    """Extra FLOPs per token that recompute adds on a stage of `num_layers` layers."""
    per_token = forward_flops_per_token(model, layout.tp)
    if layout.recompute == "selective":
        return num_layers * 3 * per_token.attention_scores
    return layout.recomputed_layers(num_layers) * per_token.layer


def model_flops_per_iteration(model: ModelSpec, layout: Layout) -> float:
    return model_flops.model_flops_per_iteration(model.config, model.padded_vocab_size(layout.tp),
                                                 layout.global_batch_size, model.seq_length)


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
