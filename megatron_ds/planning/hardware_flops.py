"""FLOPs per iteration on a layout: model FLOPs (the model's own formula, core/models/gpt/flops.py) and
hardware FLOPs (what recompute adds).

Hardware FLOPs (docs/formulas.md): selective recompute doubles the attention-score term (s/(6h) -> s/(3h));
full recompute adds one forward of every recomputed layer (all of them with the "uniform" method:
72 -> 96, V/(12lh) -> V/(16lh); "block" recomputes only N layers per stage, the first N of it, which
matters with MoE layers: they cost the router and k experts' MLPs, core/models/gpt/flops.py); a multi-token
prediction module's layer is its own chunk, recomputed under either method.

FP8 (config.fp8_format): the weight GEMMs of the layers config.fp8_in_layer names (QKV, projection, MLP, MLA's
projections, the experts; forward, input and weight gradient, recompute's forward again) and each multi-token
prediction projection run in FP8; the router, the shared expert's gate, PR-MoE's coefficient, attention's
scores and context, and the output head stay in 16-bit (docs/fp8.md).
"""
from megatron_ds.core.models.gpt import flops as model_flops
from megatron_ds.core.pipeline_split import first_layers
from megatron_ds.planning.model import Layout, ModelSpec


def forward_flops_per_token(model: ModelSpec, tp: int = 1) -> model_flops.ForwardFlopsPerToken:
    """Vocabulary padded as for TP `tp` (as training's MFU counts it)."""
    return model_flops.forward_flops_per_token(model.config, model.seq_length, model.padded_vocab_size(tp))


def recompute_flops_per_token(model: ModelSpec, layout: Layout, num_layers: int, first_layer: int = 1) -> float:
    """Extra FLOPs per token that recompute adds on a stage of `num_layers` layers from global layer
    `first_layer` (MoE layers cost more, so which layers full recompute reruns matters)."""
    per_token = forward_flops_per_token(model, layout.tp)
    if layout.recompute == "selective":
        return num_layers * 3 * per_token.attention_scores
    return per_token.layers(first_layer, layout.recomputed_layers(num_layers))


def mtp_recompute_flops_per_token(model: ModelSpec, layout: Layout) -> float:
    """What recompute adds for the multi-token prediction modules' layers (on the head's stage): full recompute
    reruns each one's forward (every module's layer is its own chunk, whatever the method); selective its
    attention scores, as for any layer."""
    per_token = forward_flops_per_token(model, layout.tp)
    depths = len(per_token.mtp_layers_gemms)
    if layout.recompute == "selective":
        return depths * 3 * per_token.attention_scores
    if layout.recompute == "full":
        return sum(per_token.mtp_layers_gemms) + depths * per_token.attention_scores
    return 0.0


def stage_first_layers(model: ModelSpec, layout: Layout):
    """(first global layer, layers) of each pipeline stage (core/pipeline_split.py)."""
    counts = layout.split.stage_layers(model.config.num_layers, layout.pp, layout.pipeline_schedule,
                                       layout.virtual_stages)
    return [(first + 1, count) for first, count in zip(first_layers(counts), counts)]


def model_flops_per_iteration(model: ModelSpec, layout: Layout) -> float:
    return model_flops.model_flops_per_iteration(model.config, model.padded_vocab_size(layout.tp),
                                                 layout.global_batch_size, model.seq_length)


def hardware_flops_per_iteration(model: ModelSpec, layout: Layout) -> float:
    tokens = layout.global_batch_size * model.seq_length
    extra = (sum(recompute_flops_per_token(model, layout, count, first) for first, count in
                 stage_first_layers(model, layout)) + mtp_recompute_flops_per_token(model, layout)) * tokens
    return model_flops_per_iteration(model, layout) + extra


def stage_hardware_flops_per_micro_batch(model: ModelSpec, layout: Layout, num_layers: int, last: bool,
                                         first_layer: int = 1) -> float:
    """Hardware FLOPs one device of a stage (`num_layers` layers from global layer `first_layer`) runs for one
    micro-batch (forward + backward + recompute). Each TP rank runs 1/t of the layers' FLOPs; for MoE layers
    that holds for the experts (whole on each rank, but each TP rank gets 1/t of the dispatched tokens from
    DeepSpeed), not for the router and residual MLP every TP rank runs whole. Each Ulysses rank runs those of
    its s/U tokens: the attention scores of its a/(tU) heads over the whole s cost as much as s/U tokens' share
    of a/t heads (4 s a d / t per token), so the FLOPs per rank are the micro-batch's / (t U). CP's ranks split
    the attention evenly too (each holds chunks i and 2 CP - 1 - i: as many visible (query, key) pairs as any
    other), so with CP they are the micro-batch's / (t U CP)."""
    per_token = forward_flops_per_token(model, layout.tp)
    flops = 3 * per_token.layers(first_layer, num_layers) + recompute_flops_per_token(model, layout, num_layers,
                                                                                       first_layer)
    if last:
        flops += 3 * (per_token.head + per_token.mtp) + mtp_recompute_flops_per_token(model, layout)
    return flops * layout.micro_batch_size * layout.tokens_per_rank(model.seq_length, split_over_tp=False) / layout.tp


def fp8_gemm_flops_per_token(config, layer_number) -> float:
    """Forward FLOPs per token of layer `layer_number`'s GEMMs that run in FP8: its weight GEMMs less the 16-bit
    routing ones (the router 2hE; the shared expert's gate 2h; PR-MoE's coefficient 2 x 2h); 0 in a bf16 layer."""
    if not config.fp8_in_layer(layer_number):
        return 0.0
    h = config.hidden_size
    if config.dropless_moe_in_layer(layer_number):
        routing = 2 * h * config.num_moe_experts + (2 * h if config.moe_shared_expert_gate else 0)
    else:
        experts = config.experts_in_layer(layer_number)
        routing = 0 if experts == 1 else 2 * h * experts + (2 * 2 * h if config.moe_residual else 0)
    return model_flops.layer_gemm_flops_per_token(config, layer_number) - routing


def _mtp_fp8_flops_per_token(config, recomputed: bool) -> float:
    """The multi-token prediction modules' FP8 GEMMs per token: each projection (2h -> h) and layer, 3 x forward,
    and under full recompute each layer's forward again."""
    if config.fp8_format is None:
        return 0.0
    layers = [fp8_gemm_flops_per_token(config, config.num_layers + depth)
              for depth in range(1, config.mtp_num_layers + 1)]
    projections = config.mtp_num_layers * 2 * 2 * config.hidden_size ** 2
    return 3 * (sum(layers) + projections) + (sum(layers) if recomputed else 0.0)


def stage_fp8_flops_per_micro_batch(model: ModelSpec, layout: Layout, num_layers: int, last: bool,
                                    first_layer: int = 1) -> float:
    """Of stage_hardware_flops_per_micro_batch, the FLOPs of GEMMs that run in FP8 (0 without --fp8-format)."""
    config = model.config
    if config.fp8_format is None:
        return 0.0
    layers = [fp8_gemm_flops_per_token(config, n) for n in range(first_layer, first_layer + num_layers)]
    flops = 3 * sum(layers) + sum(layers[:layout.recomputed_layers(num_layers)])
    if last:
        flops += _mtp_fp8_flops_per_token(config, layout.recompute == "full")
    return flops * layout.micro_batch_size * layout.tokens_per_rank(model.seq_length, split_over_tp=False) / layout.tp
