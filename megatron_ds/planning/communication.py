"""Communication volume per iteration on each parallel axis, in bytes sent per device (ring algorithms:
an all-reduce of P bytes over n ranks sends 2 (n-1)/n P per rank, an all-gather or reduce-scatter
(n-1)/n P), and which links each axis uses.

TP, per transformer layer and micro-batch (payload P = s b h activation bytes, s/U tokens with Ulysses): without
SP, 2 all-reduces in
forward (attention projection, fc2) and 2 in backward (the inputs of QKV and fc1); with SP, 2 all-gathers
+ 2 reduce-scatters in forward, and in backward their conjugates plus 2 all-gathers of the saved input
shards for the weight gradients (megatron_ds keeps only the [s/t, b, h] shard). Full recompute repeats
the forward's collectives for each recomputed layer; selective recompute repeats none.
PP, per micro-batch and stage boundary that crosses ranks: the activation forward and its gradient backward,
payload s b h each (s/t b h with SP, / U with Ulysses); a rank sends one message per boundary it sits on each way
(core/pipeline_schedules.pipeline_messages_per_micro_batch: a 1F1B middle rank an activation and a gradient, the
end ranks one of them). Where DeepSpeed splits the messages over TP (pipe_partitioned / grad_partitioned, its
default: not with SP, DualPipeV or interleaving) each TP rank sends 1/t of the payload and the receiving side
all-gathers it over TP, on the TP link: the received activation (forward), the stage's own partitioned output
(before its backward) and the received gradient, each (t-1)/t x payload sent per rank.
Ulysses (DeepSpeed's DistributedAttention, --ds-sequence-parallel-size U), per transformer layer and
micro-batch: 4 all-to-alls over the Ulysses group in forward (q, k and v, k and v already expanded to every
query head, from the sequence split to the head split, and the context back) and their 4 conjugates in
backward, each of this rank's s/U x b x (a/t) x d elements (d = kv_channels), of which (U - 1)/U leaves the
rank: per direction 4 (U - 1)/U x s/U b (a d / t) x bytes. Full recompute repeats the forward's 4 for each
recomputed layer; selective recompute reruns only the core attention, between the all-to-alls.
CP (context parallelism, core/transformer/ring_attention.py), per transformer layer and micro-batch, K the bytes of
one key/value block (this rank's s/CP tokens of the key and value heads the ring carries: GQA's g/t unexpanded, or
a/(tU) expanded ones with Ulysses): the ring (p2p) sends K to the next rank CP - 1 times in forward, and in
backward K again CP - 1 times and the block's dK and dV (fp32, 2K with 16-bit activations) CP times (a full turn
home); allgather all-gathers K in forward and again in backward, (CP - 1) K sent, and reduce-scatters dK and dV,
(CP - 1) x the fp32 block. Selective recompute reruns the core attention, ring included, for every layer; full
recompute each recomputed layer's forward.
DP, per iteration: the gradient all-reduce over the data-parallel group (U x CP x DP ranks with Ulysses and CP: the
weights are replicated on a sample's U x CP ranks, which DeepSpeed counts as data-parallel), 2 (dp-1)/dp x gradient
bytes (fp32 with bf16: DeepSpeed's BF16_Optimizer reduces its fp32 accumulation buffer), then with ZeRO-1 the
updated 16-bit weights are all-gathered ((dp-1)/dp x weight bytes). ZeRO-2 and 3 reduce-scatter the gradients
after every micro-batch, m (dp-1)/dp x gradient bytes; ZeRO-3 all-gathers the weights for every micro-batch's
forward and backward (and recomputed forward): 2m (3m) x (dp-1)/dp x weight bytes, instead of once. With tied
embeddings and PP > 1 the first and last stages also all-reduce the embedding gradient. With MoE the experts'
gradients are reduced (and their 16-bit weights all-gathered) over the expert-data-parallel group (TP x DP / EP
ranks) instead.
EP (Mixture of Experts), per MoE layer and micro-batch: DeepSpeed-MoE's dispatch and combine all-to-alls in
forward and their two conjugates in backward, 4 all-to-alls over the expert-parallel group of the
[E, C, h] capacity buffer (E experts x C slots each x h elements: E C ~ k x capacity factor x the s b tokens
of the micro-batch), of which (EP - 1)/EP leaves the rank; full recompute repeats the forward's 2 for each
recomputed MoE layer. At TP > 1 DeepSpeed first drops each TP rank's duplicate tokens (C / t
each) and all-gathers them over TP after the combine (that all-gather not counted here).
The dropless MoE layer (Megatron-Core's flags, its alltoall dispatcher), per MoE layer and micro-batch, T = b s /
(U t) the tokens a rank routes (under TP each rank routes its share) and k T its (token, expert) rows: forward,
an all-to-all of the E per-expert counts (int64) and two all-to-alls with uneven splits of the rows, k T x h
elements out and the experts' outputs back; backward their two conjugates. Routing is taken as uniform: a rank
receives as many rows as it sends, (EP - 1)/EP of each all-to-all leaving it (DeepSeek-V3 at EP 64: 63/64);
full recompute repeats the forward's three. TP changes against a dense layer: dropless_layers_tensor_parallel_change
(with expert TP it counts the gather of the received rows over TP and the reduce-scatter of the partial outputs).
FP8 (--fp8-format), per FP8 layer and micro-batch at TP > 1 (fp8_amax_reductions_per_layer): the amaxes whose
scaling region spans what TP splits are all-reduced (MAX) over TP, fp32: tensorwise a column-parallel linear's
weight (forward) and output gradient (backward), a row-parallel one's input and weight (forward); rowwise the
same operands' per-row amaxes where the row runs along the split (column-parallel: W^T's rows forward, the
gradient's tokens backward; row-parallel: the input's tokens and the weight's rows forward); blockwise none. With
SP multi-latent attention's down projections, whole on each rank over its own tokens, reduce those that span the
tokens: tensorwise the input (forward) and the output gradient (backward), rowwise x^T's rows (forward) and dY^T's
(backward). A few bytes each, so their time is latency: the time model charges each one a latency
(performance.py). Full recompute repeats the forward's. With SP an FP8 column-parallel linear keeps the gathered
tokens in FP8, so its backward all-gathers no saved input shard again (fp8_tensor_parallel_change). Counted for
the attention's linears (QKV and the projection, or all of MLA's), a dense MLP, a dropless layer's shared expert
and, with expert TP, every DeepSpeed-MoE expert on the rank (without it the experts run whole: nothing reduced).
"""
import math
from dataclasses import dataclass
from typing import List, Optional

from megatron_ds.core.pipeline_schedules import messages_split_over_tensor_parallel, pipeline_messages_per_micro_batch
from megatron_ds.planning.model import Cluster, Layout, ModelSpec, expert_data_parallel_size
from megatron_ds.planning.pipeline import head_rank


def all_reduce_bytes(ranks: int, payload: float) -> float:
    return 2 * (ranks - 1) / ranks * payload


def all_gather_bytes(ranks: int, payload: float) -> float:
    """Also a reduce-scatter's."""
    return (ranks - 1) / ranks * payload


def activation_element_bytes(model: ModelSpec) -> int:
    return 2 if model.sixteen_bit else 4


@dataclass(frozen=True)
class TensorParallelTraffic:
    """Per transformer layer and micro-batch, bytes sent by one device."""
    payload: float
    forward: float
    backward: float
    recompute: float      # per recomputed layer
    collectives: str


def layers_bytes_per_micro_batch(traffic, layout: Layout, num_layers: int) -> float:
    """Bytes of a stage with `num_layers` layers per micro-batch from one layer's traffic: every layer's forward
    and backward, and the recomputed layers' forward again."""
    return num_layers * (traffic.forward + traffic.backward) + layout.recomputed_layers(num_layers) * traffic.recompute


def tensor_parallel_traffic_per_layer(model: ModelSpec, layout: Layout) -> TensorParallelTraffic:
    t = layout.tp
    tokens = layout.tokens_per_rank(model.seq_length, split_over_tp=False)
    payload = tokens * layout.micro_batch_size * model.config.hidden_size * activation_element_bytes(model)
    linear_inputs, rotary_key = attention_input_shares(model.config)
    inputs = sum(linear_inputs)
    if layout.sequence_parallel:
        forward = (3 + inputs + rotary_key) * all_gather_bytes(t, payload)
        backward = (4 + 2 * inputs + rotary_key) * all_gather_bytes(t, payload) + \
            _sequence_parallel_gradient_bytes(model, t, final_norm=False)
        collectives = ("2 all-gather + 2 reduce-scatter in forward; backward 2 reduce-scatter + 2 all-gather "
                       "+ 2 all-gathers again of the saved input shards, and an all-reduce of each norm weight's "
                       "and row-parallel bias's gradient")
    else:
        forward = 2 * all_reduce_bytes(t, payload)
        backward = (1 + inputs + rotary_key) * all_reduce_bytes(t, payload)
        collectives = "2 all-reduce in forward, 2 in backward"
    recompute = forward if layout.recompute == "full" else 0.0
    if recompute:
        collectives += "; full recompute repeats the forward's"
    return TensorParallelTraffic(payload, forward, backward, recompute, collectives)


def attention_input_shares(config):
    """The attention's column-parallel inputs as shares of the hidden size (each all-gathered with SP, its gradient
    all-reduced without), and the rotary key's share (multi-latent attention: gathered with SP, its gradient
    reduce-scattered; all-reduced without). QKV attention: ([1], 0); MLA: ([q_r or h, kv_r] / h, r / h)."""
    if not config.multi_latent_attention:
        return [1.0], 0.0
    h = config.hidden_size
    return [(config.q_lora_rank or h) / h, config.kv_lora_rank / h], config.qk_pos_emb_head_dim / h


def sequence_parallel_gradients(config, final_norm: bool) -> List[int]:
    """Sizes of the parameters whose gradients Megatron SP all-reduces over TP in every backward (they see only
    this rank's tokens): a layer's two norms' weights (and biases, LayerNorm) and the row-parallel biases of
    attention's projection and fc2; or (final_norm) the final norm's."""
    norm = [config.hidden_size] * (2 if config.normalization == "LayerNorm" else 1)
    if final_norm:
        return norm
    return 2 * norm + ([config.hidden_size] * 2 if config.bias else []) + _mla_replicated_sizes(config)


def _mla_replicated_sizes(config):
    """Multi-latent attention's down projections and their norms: whole on every TP rank, on its tokens with SP."""
    if not config.multi_latent_attention:
        return []
    h, q_rank, kv_rank = config.hidden_size, config.q_lora_rank, config.kv_lora_rank
    norm = 2 if config.normalization == "LayerNorm" else 1
    query = [h * q_rank] + [q_rank] * norm if q_rank else []
    return query + [h * (kv_rank + config.qk_pos_emb_head_dim)] + [kv_rank] * norm


def _sequence_parallel_gradient_bytes(model: ModelSpec, t: int, final_norm: bool) -> float:
    return sum(all_reduce_bytes(t, size * activation_element_bytes(model))
               for size in sequence_parallel_gradients(model.config, final_norm))


def tensor_parallel_bytes_per_micro_batch(model: ModelSpec, layout: Layout, num_layers: int) -> float:
    """TP bytes one device of a stage with `num_layers` layers sends per micro-batch."""
    if layout.tp == 1:
        return 0.0
    return layers_bytes_per_micro_batch(tensor_parallel_traffic_per_layer(model, layout), layout, num_layers)


@dataclass(frozen=True)
class UlyssesTraffic:
    """One transformer layer, one micro-batch: bytes one device sends over its Ulysses group."""
    payload: float          # one all-to-all's tensor on this rank: s/U x b x (a/t) x d elements, bytes
    per_all_to_all: float   # (U - 1)/U of it
    forward: float          # q, k, v and the context
    backward: float         # their 4 conjugates
    recompute: float        # per recomputed layer (full recompute): the forward's 4 again


def ulysses_traffic_per_layer(model: ModelSpec, layout: Layout) -> UlyssesTraffic:
    config = model.config
    tokens = layout.tokens_per_rank(model.seq_length, split_over_tp=False)
    per_channel = tokens * layout.micro_batch_size * config.num_attention_heads / layout.tp \
        * activation_element_bytes(model)
    dims = _ulysses_head_dims(config)
    sent = [all_to_all_bytes(layout.ulysses, per_channel * dim) for dim in dims]
    forward = sum(sent)
    recompute = forward if layout.recompute == "full" else 0.0
    return UlyssesTraffic(per_channel * dims[0], sent[0], forward, forward, recompute)


def _ulysses_head_dims(config):
    """Each head's channels in the query, key, value and context all-to-alls (every key and value head expanded to
    the query heads first): d each, or multi-latent attention's query and key qk + r and value and context v."""
    if not config.multi_latent_attention:
        return (config.kv_channels,) * 4
    query = config.qk_head_dim + config.qk_pos_emb_head_dim
    return query, query, config.v_head_dim, config.v_head_dim


def ulysses_bytes_per_micro_batch(model: ModelSpec, layout: Layout, num_layers: int) -> float:
    """Ulysses all-to-all bytes one device of a stage with `num_layers` layers sends per micro-batch."""
    if layout.ulysses == 1:
        return 0.0
    return layers_bytes_per_micro_batch(ulysses_traffic_per_layer(model, layout), layout, num_layers)


@dataclass(frozen=True)
class ContextTraffic:
    """One transformer layer, one micro-batch: bytes one device sends over its CP group (the module docstring)."""
    exchange: str              # "p2p" (the ring) or "allgather"
    block: float               # K: one key/value block of this rank's s/CP tokens
    gradient_block: float      # its dK and dV, in fp32
    forward: float
    backward: float
    recompute: float           # per rerun of the core attention (selective: every layer; full: recomputed ones)


def context_block_bytes(model: ModelSpec, layout: Layout) -> float:
    """One key/value block as the ring carries it: b x s/CP tokens x the key/value heads of the rank (GQA's g/t,
    never expanded; with Ulysses a/(tU), expanded before its all-to-all) x (key + value head dims) x bytes."""
    config = model.config
    key_dim, value_dim = context_head_dims(config)
    heads = (config.num_attention_heads / layout.ulysses if layout.ulysses > 1 or config.multi_latent_attention
             else config.num_query_groups) / layout.tp
    tokens = layout.micro_batch_size * model.seq_length / layout.context
    return tokens * heads * (key_dim + value_dim) * activation_element_bytes(model)


def context_head_dims(config):
    """(key head dim, value head dim) of core attention: d and d, multi-latent attention's qk + r and v."""
    if config.multi_latent_attention:
        return config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim
    return config.kv_channels, config.kv_channels


RING_GRADIENT_BYTES = 4    # dK and dV accumulate and travel in fp32 (ring_attention.compute_dtype)


def context_traffic_per_layer(model: ModelSpec, layout: Layout) -> ContextTraffic:
    cp, block = layout.context, context_block_bytes(model, layout)
    gradient_block = block * RING_GRADIENT_BYTES / activation_element_bytes(model)
    forward = (cp - 1) * block
    gradients = (cp if layout.cp_comm_type == "p2p" else cp - 1) * gradient_block
    recompute = forward if layout.recompute in ("selective", "full") else 0.0
    return ContextTraffic(layout.cp_comm_type, block, gradient_block, forward, forward + gradients, recompute)


def context_recomputed_layers(layout: Layout, num_layers: int) -> int:
    """Layers whose core attention (the ring with it) runs forward twice: every layer under selective recompute
    (it checkpoints the core attention), the recomputed ones under full."""
    return num_layers if layout.recompute == "selective" else layout.recomputed_layers(num_layers)


def context_bytes_per_micro_batch(model: ModelSpec, layout: Layout, num_layers: int) -> float:
    """CP bytes one device of a stage with `num_layers` layers sends per micro-batch."""
    if layout.context == 1:
        return 0.0
    traffic = context_traffic_per_layer(model, layout)
    return num_layers * (traffic.forward + traffic.backward) + \
        context_recomputed_layers(layout, num_layers) * traffic.recompute


def pipeline_payload_per_micro_batch(model: ModelSpec, layout: Layout) -> float:
    """Bytes of one activation (= one activation gradient) crossing a stage boundary, per TP, Ulysses and CP rank."""
    tokens = layout.tokens_per_rank(model.seq_length)
    return tokens * layout.micro_batch_size * model.config.hidden_size * activation_element_bytes(model)


def _messages(layout: Layout, rank: int) -> dict:
    return pipeline_messages_per_micro_batch(layout.pipeline_schedule, layout.pp, rank, layout.virtual_stages)


def split_over_tensor_parallel(layout: Layout) -> bool:
    """Whether DeepSpeed splits this layout's pipeline messages over its TP ranks."""
    return layout.tp > 1 and messages_split_over_tensor_parallel(layout.pipeline_schedule, layout.sequence_parallel)


def pipeline_bytes_per_micro_batch(model: ModelSpec, layout: Layout, rank: Optional[int] = None) -> float:
    """Bytes a device of pipeline rank `rank` (default: the rank that sends most) sends over the pipeline per
    micro-batch: each activation and gradient it sends, 1/t of the payload where the messages are split over TP."""
    if layout.pp == 1:
        return 0.0
    if rank is None:
        return max(pipeline_bytes_per_micro_batch(model, layout, r) for r in range(layout.pp))
    messages = _messages(layout, rank)
    payload = pipeline_payload_per_micro_batch(model, layout) / (layout.tp if split_over_tensor_parallel(layout)
                                                                 else 1)
    return (messages["send_activation"] + messages["send_gradient"]) * payload + \
        messages["send_activation"] * mtp_rider_bytes_per_micro_batch(model, layout)


def mtp_rider_bytes_per_micro_batch(model: ModelSpec, layout: Layout) -> float:
    """With multi-token prediction the input ids ride beside each activation to the last stage: int64, whole on
    every TP rank, this Ulysses rank's slice of the sequence; no gradient comes back for them."""
    if not model.config.mtp_num_layers:
        return 0.0
    return 8.0 * layout.tokens_per_rank(model.seq_length, split_over_tp=False) * layout.micro_batch_size


def pipeline_gather_bytes_per_micro_batch(model: ModelSpec, layout: Layout, rank: Optional[int] = None) -> float:
    """TP all-gather bytes a device of pipeline rank `rank` (default: the most) sends per micro-batch to rebuild
    messages split over TP: the received activation, its own output before the backward, the received gradient."""
    if layout.pp == 1 or not split_over_tensor_parallel(layout):
        return 0.0
    if rank is None:
        return max(pipeline_gather_bytes_per_micro_batch(model, layout, r) for r in range(layout.pp))
    messages = _messages(layout, rank)
    gathers = messages["receive_activation"] + messages["send_activation"] + messages["receive_gradient"]
    return gathers * all_gather_bytes(layout.tp, pipeline_payload_per_micro_batch(model, layout))


def gradient_reduction_element_bytes(model: ModelSpec, layout: Layout) -> int:
    if model.precision == "bf16" and layout.zero_stage == 1:
        return 4
    return 2 if model.sixteen_bit else 4


def data_parallel_traffic(model: ModelSpec, layout: Layout, parameters: int, expert_parameters: int = 0) -> dict:
    """Bytes one device sends per iteration for the gradient reduction and ZeRO's weight all-gathers over U x CP x DP
    ranks, as DeepSpeed runs them: ZeRO-0 and 1 all-reduce the gradients once, at the end of the accumulation;
    ZeRO-2 and 3 reduce-scatter them after every micro-batch's backward into this rank's partition (DeepSpeed's
    reduce_ready_partitions_and_remove_grads). ZeRO-1 and 2 all-gather the updated 16-bit weights once; ZeRO-3
    keeps only its partition and all-gathers each layer's weights for every micro-batch's forward, backward and
    (full recompute) recomputed forward. parameters: the device's; expert_parameters: the MoE experts among them,
    reduced over TP x DP / EP ranks. Keys as before for ZeRO-0/1: 'gradient_all_reduce' is the reduction, whichever
    collective runs it."""
    groups = ((layout.sequence_data_parallel, parameters - expert_parameters),
              (expert_data_parallel_size(model, layout), expert_parameters))
    gradient_bytes, weight_bytes = gradient_reduction_element_bytes(model, layout), 2 if model.sixteen_bit else 4
    m = layout.num_micro_batches
    if layout.zero_stage >= 2:
        gradients = m * sum(all_gather_bytes(ranks, count * gradient_bytes) for ranks, count in groups)
    else:
        gradients = sum(all_reduce_bytes(ranks, count * gradient_bytes) for ranks, count in groups)
    gathers = {0: 0, 1: 1, 2: 1}.get(layout.zero_stage, m * (3 if layout.recompute == "full" else 2))
    weights = gathers * sum(all_gather_bytes(ranks, count * weight_bytes) for ranks, count in groups)
    return {"gradient_all_reduce": gradients, "weight_all_gather": weights}


def largest_stage_data_parallel_traffic(model: ModelSpec, layout: Layout, stages) -> dict:
    """data_parallel_traffic of the stage with the most parameters per device (the reduction that takes
    longest); {} when no rank shares its weights (U x CP x DP = 1, and no TP ranks hold the same experts)."""
    if layout.sequence_data_parallel == 1 and expert_data_parallel_size(model, layout) == 1:
        return {}
    largest = max(stages, key=lambda stage: stage.total)
    return data_parallel_traffic(model, layout, largest.total, largest.experts)


def tied_embedding_traffic(model: ModelSpec, layout: Layout) -> float:
    """First and last stage all-reduce the shared embedding's gradient once per iteration (2 ranks; none where
    one rank holds both: PP 1, DualPipeV's rank 0): the tied head's, or with multi-token prediction the last
    stage's copy for the tokens ahead."""
    shared = model.tied_embeddings or model.config.mtp_num_layers
    if not shared or layout.pp == 1 or layout.pipeline_schedule == "dualpipev":
        return 0.0
    vocab_shard = model.padded_vocab_size(layout.tp) // layout.tp * model.config.hidden_size
    return all_reduce_bytes(2, vocab_shard * gradient_reduction_element_bytes(model, layout))


def embedding_and_head_bytes_per_micro_batch(model: ModelSpec, layout: Layout, stage: int) -> float:
    """TP bytes one device of pipeline rank `stage` sends per micro-batch outside the transformer layers: on the
    rank holding the embedding (rank 0), the vocabulary-parallel embedding's forward all-reduce of [s, b, h]
    (whole s, even with SP: it is split after the all-reduce); on the rank holding the output head, the head
    input's backward all-reduce (with SP: its forward all-gather, backward reduce-scatter and the all-gather
    again of the saved shard for the weight gradient), and the vocabulary-parallel cross entropy's all-reduces
    of 3 fp32 statistics per token (the maximum; the sum of exponentials and the target's logit)."""
    if layout.tp == 1:
        return 0.0
    t, b = layout.tp, layout.micro_batch_size
    tokens = layout.tokens_per_rank(model.seq_length, split_over_tp=False)
    payload = tokens * b * model.config.hidden_size * activation_element_bytes(model)
    sp = layout.sequence_parallel
    sent = 0.0
    if stage == 0:
        sent += all_reduce_bytes(t, payload) + (all_gather_bytes(t, payload) if sp else 0.0)
    if stage == head_rank(layout):
        sent += 3 * all_gather_bytes(t, payload) if sp else all_reduce_bytes(t, payload)
        sent += all_reduce_bytes(t, 3 * tokens * b * 4)
        if sp:
            sent += _sequence_parallel_gradient_bytes(model, t, final_norm=True)
    return sent


def moe_layers_tensor_parallel_change(model: ModelSpec, layout: Layout, stage) -> float:
    """What the MoE layers of `stage` change in its TP bytes per micro-batch against dense layers: without
    expert TP an MoE layer's MLP has no TP all-reduces (forward and backward), and DeepSpeed instead all-gathers
    the tokens each TP rank kept (its drop, C / t tokens each) after the combine in forward, and the
    gradients of the drop in backward (no SP; a recomputed forward's all-gather is not counted)."""
    if layout.tp == 1 or not model.config.is_moe or model.config.moe_expert_tensor_parallel \
            or layout.sequence_parallel:
        return 0.0
    payload = tensor_parallel_traffic_per_layer(model, layout).payload
    layers = len(moe_layer_numbers(model, stage.first_layer, stage.num_layers))
    return layers * 2 * (all_gather_bytes(layout.tp, payload) - all_reduce_bytes(layout.tp, payload))


def dropless_layers_tensor_parallel_change(model: ModelSpec, layout: Layout, stage) -> float:
    """What the dropless MoE layers of `stage` change in its TP bytes per micro-batch against dense layers (P the TP
    payload, s b h x bytes). Their routed part runs on this rank's T tokens without TP collectives: without SP the
    layer splits the tokens (backward: an all-gather of P) and gathers its outputs (forward: an all-gather of P) in
    place of the dense MLP's two all-reduces; with SP the dense MLP's 2 forward and 3 backward all-gathers and
    reduce-scatters go. The shared expert is a dense MLP of its own width: its collectives stay. Every backward
    all-reduces the router's gradient (h E: the TP ranks routed other tokens), with SP the shared gate's (h), and no
    longer fc2's bias where no shared expert has one; a balance loss all-reduces its expert counts in every forward
    (_balance_counts_bytes). With expert TP (= TP t) the experts' F slices add _expert_slices_bytes. A recomputed
    layer repeats its forward's change."""
    if layout.tp == 1 or not model.config.is_dropless_moe:
        return 0.0
    forward, backward = _dropless_tensor_parallel_change(model, layout)
    numbers = dropless_moe_layer_numbers(model, stage.first_layer, stage.num_layers)
    recomputed_before = stage.first_layer + layout.recomputed_layers(stage.num_layers)
    return len(numbers) * (forward + backward) + sum(forward for n in numbers if n < recomputed_before)


def _dropless_tensor_parallel_change(model, layout):
    """(forward, backward) change of one dropless MoE layer's TP bytes per micro-batch against a dense layer's."""
    forward, backward = _dropless_routing_tensor_parallel_change(model, layout)
    slices_forward, slices_backward = _expert_slices_bytes(model, layout)
    return forward + slices_forward, backward + slices_backward


def _expert_slices_bytes(model, layout):
    """(forward, backward) TP bytes of the experts split over TP (expert TP = TP t), one layer and micro-batch, R the
    rows each rank receives from the all-to-all (k T with uniform routing): forward, an all-gather of the E / EP
    local experts' counts (int64), one of the rows, t R h elements, and a reduce-scatter of the experts' partial
    outputs, t R h (uneven all-to-alls, each rank sending its rows or their partial outputs, (t - 1) R h); backward
    their conjugates. (0, 0) without expert TP."""
    config, t = model.config, layout.tp
    if not config.moe_expert_tensor_parallel or t == 1:
        return 0.0, 0.0
    gathered = t * dropless_traffic_per_layer(model, layout).payload
    counts = all_gather_bytes(t, 8 * t * config.num_moe_experts // config.moe_expert_parallel_size)
    rows = 2 * all_gather_bytes(t, gathered)
    return counts + rows, rows


def _dropless_routing_tensor_parallel_change(model, layout):
    """_dropless_tensor_parallel_change without the experts' F slices."""
    config, t = model.config, layout.tp
    payload, width = tensor_parallel_traffic_per_layer(model, layout).payload, activation_element_bytes(model)
    shared = bool(config.moe_shared_expert_intermediate_size)
    router = all_reduce_bytes(t, config.hidden_size * config.num_moe_experts * width)
    counts = _balance_counts_bytes(config, layout)
    if not layout.sequence_parallel:
        split_and_gather = all_gather_bytes(t, payload) - (0.0 if shared else all_reduce_bytes(t, payload))
        return split_and_gather + counts, split_and_gather + router
    if shared:
        gate = all_reduce_bytes(t, config.hidden_size * width) if config.moe_shared_expert_gate else 0.0
        return counts, router + gate
    fc2_bias = all_reduce_bytes(t, config.hidden_size * width) if config.bias else 0.0
    return counts - 2 * all_gather_bytes(t, payload), router - 3 * all_gather_bytes(t, payload) - fc2_bias


def _balance_counts_bytes(config, layout):
    """A balance loss's all-reduce over TP of its expert counts in each forward, fp32: E (b E for seq_aux_loss);
    global_aux_loss's with or without a coefficient (its counts are summed before the loss looks at it)."""
    kind = config.moe_router_load_balancing_type
    if kind != "global_aux_loss" and (kind == "none" or not config.moe_aux_loss_coeff):
        return 0.0
    counts = config.num_moe_experts * (layout.micro_batch_size if kind == "seq_aux_loss" else 1)
    return all_reduce_bytes(layout.tp, 4 * counts)


@dataclass(frozen=True)
class AmaxReductions:
    """One FP8 layer, one micro-batch: the amax all-reduces over TP and the bytes one device sends for them."""
    forward: int
    backward: int
    forward_bytes: float
    backward_bytes: float


def _fp8_tp_linears(model: ModelSpec, layout: Layout, layer_number: int):
    """(split, inputs, outputs, tokens) of layer `layer_number`'s FP8 linears whose amaxes TP reduces, as a rank holds
    them: the attention's (_fp8_attention_tp_linears), then fc1 column-parallel ("outputs") and fc2 row-parallel
    ("inputs") of the dense MLP or a dropless layer's shared expert over the whole tokens, or with expert TP of each
    of this rank's DeepSpeed-MoE experts over its slots (without expert TP an expert runs whole on the rank and
    reduces nothing)."""
    config, t = model.config, layout.tp
    h, gated = config.hidden_size, 2 if config.gated_linear_unit else 1
    tokens = layout.micro_batch_size * layout.tokens_per_rank(model.seq_length, split_over_tp=False)
    linears = _fp8_attention_tp_linears(model, layout, tokens)
    experts = config.experts_in_layer(layer_number)
    if config.dropless_moe_in_layer(layer_number):
        ffn, rows, count = config.moe_shared_expert_intermediate_size or 0, tokens, 1
    elif experts == 1:
        ffn, rows, count = config.ffn_hidden_size, tokens, 1
    elif config.moe_expert_tensor_parallel:
        count = experts // config.moe_expert_parallel_size
        ffn, rows = config.ffn_hidden_size, deepspeed_expert_slots(model, layout, experts)[0] / count
    else:
        ffn, rows, count = 0, tokens, 0
    if ffn:
        linears += count * [("outputs", h, ffn * gated / t, rows), ("inputs", ffn / t, h, rows)]
    return linears


def _fp8_attention_tp_linears(model, layout, tokens):
    """The attention's FP8 linears of _fp8_tp_linears: QKV and the projection; or multi-latent attention's query (or
    query up), key-value up and output projections, and with SP its down projections ("tokens": whole on each rank,
    over its own tokens, which SP splits; without SP they see the same tokens on every rank and reduce nothing)."""
    config, t, h = model.config, layout.tp, model.config.hidden_size
    if not config.multi_latent_attention:
        heads_width = config.num_attention_heads * config.kv_channels
        qkv_width = (config.num_attention_heads + 2 * config.num_query_groups) * config.kv_channels
        return [("outputs", h, qkv_width / t, tokens), ("inputs", heads_width / t, h, tokens)]
    a, q_rank, kv_rank = config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank
    query_width = a * (config.qk_head_dim + config.qk_pos_emb_head_dim)
    linears = [("outputs", q_rank or h, query_width / t, tokens),
               ("outputs", kv_rank, a * (config.qk_head_dim + config.v_head_dim) / t, tokens),
               ("inputs", a * config.v_head_dim / t, h, tokens)]
    if layout.sequence_parallel:
        downs = [kv_rank + config.qk_pos_emb_head_dim] + ([q_rank] if q_rank else [])
        linears += [("tokens", h, outputs, tokens / t) for outputs in downs]
    return linears


def _amax_payloads(recipe, split, inputs, outputs, tokens):
    """(forward, backward) fp32 amax payloads, in bytes, one linear reduces over TP (the module docstring)."""
    if recipe == "tensorwise":
        return ([4, 4], []) if split == "inputs" else ([4], [4])
    if recipe != "rowwise":
        return [], []
    if split == "outputs":
        return [4 * inputs], [4 * tokens]
    if split == "inputs":
        return [4 * tokens, 4 * outputs], []
    return [4 * inputs], [4 * outputs]  # tokens: x^T's rows forward, dY^T's backward


def fp8_amax_reductions_per_layer(model: ModelSpec, layout: Layout, layer_number: int = 1) -> AmaxReductions:
    """The amax all-reduces of layer `layer_number` (0 where it keeps bf16, or at TP 1)."""
    config = model.config
    if layout.tp == 1 or not config.fp8_in_layer(layer_number):
        return AmaxReductions(0, 0, 0.0, 0.0)
    forward, backward = [], []
    for split, inputs, outputs, tokens in _fp8_tp_linears(model, layout, layer_number):
        ahead, behind = _amax_payloads(config.fp8_recipe, split, inputs, outputs, tokens)
        forward, backward = forward + ahead, backward + behind
    return AmaxReductions(len(forward), len(backward), sum(all_reduce_bytes(layout.tp, p) for p in forward),
                          sum(all_reduce_bytes(layout.tp, p) for p in backward))


def _fp8_layer_numbers(model: ModelSpec, stage):
    return [n for n in range(stage.first_layer, stage.first_layer + stage.num_layers)
            if model.config.fp8_in_layer(n)]


def fp8_amax_reductions_per_micro_batch(model: ModelSpec, layout: Layout, stage) -> tuple:
    """(count, bytes sent) of a stage's amax all-reduces per micro-batch, full recompute's forward ones again."""
    numbers = _fp8_layer_numbers(model, stage)
    recomputed = set(range(stage.first_layer, stage.first_layer + layout.recomputed_layers(stage.num_layers)))
    count, sent = 0, 0.0
    for n in numbers:
        reductions = fp8_amax_reductions_per_layer(model, layout, n)
        again = n in recomputed
        count += reductions.forward * (1 + again) + reductions.backward
        sent += reductions.forward_bytes * (1 + again) + reductions.backward_bytes
    return count, sent


def fp8_tensor_parallel_change(model: ModelSpec, layout: Layout, stage) -> float:
    """TP bytes FP8 changes per micro-batch on a stage: its amax all-reduces, and with SP, less the all-gathers of
    the saved input shards that FP8 column-parallel linears (QKV or MLA's query and up projections, fc1) no longer
    make."""
    if layout.tp == 1 or model.config.fp8_format is None:
        return 0.0
    amax = fp8_amax_reductions_per_micro_batch(model, layout, stage)[1]
    if not layout.sequence_parallel:
        return amax
    tokens = layout.tokens_per_rank(model.seq_length, split_over_tp=False)
    payload = tokens * layout.micro_batch_size * model.config.hidden_size * activation_element_bytes(model)
    # each saved shard is the column-parallel linear's input, inputs / h of the hidden state's payload
    regathers = sum(inputs / model.config.hidden_size for n in _fp8_layer_numbers(model, stage)
                    for split, inputs, _, _ in _fp8_tp_linears(model, layout, n) if split == "outputs")
    return amax - regathers * all_gather_bytes(layout.tp, payload)


def stage_traffic_per_micro_batch(model: ModelSpec, layout: Layout, stage) -> dict:
    """Bytes one device of `stage` (a StageParameters) sends per micro-batch on each axis: 'tensor' (its layers'
    collectives, the gathers of messages split over TP, the embedding's and the head's), 'pipeline', 'ulysses',
    'context', 'expert'."""
    return {"tensor": tensor_parallel_bytes_per_micro_batch(model, layout, stage.num_layers)
            + pipeline_gather_bytes_per_micro_batch(model, layout, stage.stage)
            + embedding_and_head_bytes_per_micro_batch(model, layout, stage.stage)
            + moe_layers_tensor_parallel_change(model, layout, stage)
            + dropless_layers_tensor_parallel_change(model, layout, stage)
            + fp8_tensor_parallel_change(model, layout, stage),
            "pipeline": pipeline_bytes_per_micro_batch(model, layout, stage.stage),
            "ulysses": ulysses_bytes_per_micro_batch(model, layout, stage.num_layers),
            "context": context_bytes_per_micro_batch(model, layout, stage.num_layers),
            "expert": expert_parallel_bytes_per_micro_batch(model, layout, stage.num_layers, stage.first_layer)
            + (mtp_expert_bytes_per_micro_batch(model, layout) if stage.mtp else 0.0)}


def stage_traffic_per_iteration(model: ModelSpec, layout: Layout, stage) -> dict:
    """stage_traffic_per_micro_batch over the iteration's micro-batches, with 'data' (the gradient reduction and
    ZeRO's all-gathers) and 'tied' (the embedding's all-reduce, on the first and last pipeline ranks)."""
    traffic = {axis: layout.num_micro_batches * sent
               for axis, sent in stage_traffic_per_micro_batch(model, layout, stage).items()}
    traffic["data"] = sum(data_parallel_traffic(model, layout, stage.total, stage.experts).values())
    traffic["tied"] = tied_embedding_traffic(model, layout) if stage.stage in (0, layout.pp - 1) else 0.0
    return traffic


def all_to_all_bytes(ranks: int, payload: float) -> float:
    """Each rank keeps 1/n of its P bytes and sends the rest: (n-1)/n P."""
    return (ranks - 1) / ranks * payload


def expert_capacity(model: ModelSpec, tokens: int, num_experts: int) -> int:
    """Slots per expert for `tokens` tokens of one rank (DeepSpeed's gate): max(ceil(tokens / E x k x
    capacity factor), min capacity). Without token dropping it is the busiest expert's load, which depends on
    the data: the balanced ceil(k tokens / E) is taken (a lower bound)."""
    config, k = model.config, model.config.moe_router_topk
    if not config.moe_token_dropping:
        return math.ceil(k * tokens / num_experts)
    return max(math.ceil(tokens / num_experts * (config.moe_train_capacity_factor * k)), config.moe_min_capacity)


def deepspeed_expert_slots(model: ModelSpec, layout: Layout, num_experts: int) -> tuple:
    """(slots, F) of one DeepSpeed-MoE layer's experts on a rank, per micro-batch: the slots they compute, E ceil(C/t)
    (each TP rank's share after DeepSpeed drops the duplicated tokens; with EP the all-to-all moves slots, not their
    number), or with expert TP all E C (gathered over TP) F/t wide; and each expert's FFN width on the rank."""
    config, t = model.config, layout.tp
    capacity = expert_capacity(model, layout.micro_batch_size * layout.tokens_per_rank(model.seq_length), num_experts)
    if config.moe_expert_tensor_parallel:
        return num_experts * capacity, config.ffn_hidden_size / t
    return num_experts * math.ceil(capacity / t), config.ffn_hidden_size


@dataclass(frozen=True)
class ExpertParallelTraffic:
    """One MoE layer, one micro-batch: bytes one device sends over its expert-parallel group."""
    num_experts: int
    capacity: int          # C, slots per expert
    payload: float         # one all-to-all's buffer on this rank: E x C x h elements (/ t), bytes
    per_all_to_all: float  # (EP - 1)/EP of it
    forward: float         # dispatch + combine
    backward: float        # their conjugates
    recompute: float       # per recomputed MoE layer: the forward's again


def expert_parallel_traffic_per_layer(model: ModelSpec, layout: Layout, num_experts: int) -> ExpertParallelTraffic:
    ep, h = model.config.moe_expert_parallel_size, model.config.hidden_size
    capacity = expert_capacity(model, model.seq_length * layout.micro_batch_size, num_experts)
    payload = num_experts * capacity * h * activation_element_bytes(model) / layout.tp
    one = all_to_all_bytes(ep, payload)
    return ExpertParallelTraffic(num_experts, capacity, payload, one, 2 * one, 2 * one,
                                 2 * one if layout.recompute == "full" else 0.0)


def dropless_routed_tokens(model: ModelSpec, layout: Layout) -> float:
    """T: the tokens one rank routes through a dropless MoE layer per micro-batch, b s / (U t) (under TP each rank
    routes its share: Megatron SP's split, or the layer's own)."""
    return layout.micro_batch_size * layout.tokens_per_rank(model.seq_length, split_over_tp=True)


@dataclass(frozen=True)
class DroplessTraffic:
    """One dropless MoE layer (alltoall dispatcher), one micro-batch: bytes one device sends over its
    expert-parallel group, routing taken as uniform (a rank receives as many rows as it sends)."""
    tokens: float          # T = b s / (U t), the tokens this rank routes
    rows: float            # k T (token, expert) rows it sends
    payload: float         # one all-to-all of the rows: k T x h elements, bytes
    per_all_to_all: float  # (EP - 1)/EP of it
    counts: float          # the count exchange before the rows: E int64, (EP - 1)/EP of them
    forward: float         # the counts, the rows out and the outputs back
    backward: float        # the conjugates of the two rows' all-to-alls
    recompute: float       # per recomputed MoE layer: the forward's again


def dropless_traffic_per_layer(model: ModelSpec, layout: Layout) -> DroplessTraffic:
    config, ep = model.config, model.config.moe_expert_parallel_size
    tokens = dropless_routed_tokens(model, layout)
    rows = config.moe_router_topk * tokens
    payload = rows * config.hidden_size * activation_element_bytes(model)
    one, counts = all_to_all_bytes(ep, payload), all_to_all_bytes(ep, 8 * config.num_moe_experts)
    forward = 2 * one + counts
    return DroplessTraffic(tokens, rows, payload, one, counts, forward, 2 * one,
                           forward if layout.recompute == "full" else 0.0)


def moe_layer_numbers(model: ModelSpec, first_layer: int = 1, num_layers: Optional[int] = None) -> List[int]:
    """The MoE layers (global numbers) among `num_layers` layers from `first_layer` (default: to the last)."""
    config = model.config
    stop = config.num_layers + 1 if num_layers is None else first_layer + num_layers
    return [n for n in range(first_layer, stop) if config.experts_in_layer(n) > 1]


def dropless_moe_layer_numbers(model: ModelSpec, first_layer: int = 1, num_layers: Optional[int] = None) -> List[int]:
    """The dropless MoE layers (global numbers) among `num_layers` layers from `first_layer` (default: to the
    last)."""
    config = model.config
    stop = config.num_layers + 1 if num_layers is None else first_layer + num_layers
    return [n for n in range(first_layer, stop) if config.dropless_moe_in_layer(n)]


def _expert_traffic_of_layer(model, layout, layer_number):
    """The expert-parallel traffic of layer `layer_number` (None for a dense layer)."""
    config = model.config
    if config.dropless_moe_in_layer(layer_number):
        return dropless_traffic_per_layer(model, layout)
    experts = config.experts_in_layer(layer_number)
    return expert_parallel_traffic_per_layer(model, layout, experts) if experts > 1 else None


def expert_parallel_bytes_per_micro_batch(model: ModelSpec, layout: Layout, num_layers: int,
                                          first_layer: int = 1) -> float:
    """EP all-to-all bytes one device of a stage (`num_layers` layers from `first_layer`) sends per micro-batch."""
    if model.config.moe_expert_parallel_size == 1:
        return 0.0
    recomputed = range(first_layer, first_layer + layout.recomputed_layers(num_layers))
    total = 0.0
    for n in range(first_layer, first_layer + num_layers):
        traffic = _expert_traffic_of_layer(model, layout, n)
        if traffic is not None:
            total += traffic.forward + traffic.backward + (traffic.recompute if n in recomputed else 0.0)
    return total


def mtp_expert_bytes_per_micro_batch(model: ModelSpec, layout: Layout) -> float:
    """The multi-token prediction modules' MoE layers (the head's stage): their all-to-alls, recomputed under full
    recompute (each module's layer is its own chunk)."""
    config = model.config
    if config.moe_expert_parallel_size == 1:
        return 0.0
    total = 0.0
    for number in range(config.num_layers + 1, config.num_layers + config.mtp_num_layers + 1):
        traffic = _expert_traffic_of_layer(model, layout, number)
        if traffic is not None:
            total += traffic.forward + traffic.backward + (traffic.recompute if layout.recompute == "full" else 0.0)
    return total


@dataclass(frozen=True)
class Links:
    """Bandwidth (bytes/s, before efficiency) each axis runs at, and whether its groups cross nodes."""
    tensor: float
    pipeline: float
    data: float
    tensor_spans_nodes: bool
    pipeline_spans_nodes: bool
    data_spans_nodes: bool
    expert: float = 0.0                # MoE all-to-alls over the expert-parallel group
    expert_spans_nodes: bool = False
    ulysses: float = 0.0               # Ulysses all-to-alls over the sequence-parallel group
    ulysses_spans_nodes: bool = False
    context: float = 0.0               # CP's ring (or all-gathers) over the context-parallel group
    context_spans_nodes: bool = False


def _fits_in_node(consecutive_ranks: int, gpus_per_node: int) -> bool:
    """Blocks of `consecutive_ranks` starting at multiples of it never straddle a node boundary."""
    return consecutive_ranks <= gpus_per_node and gpus_per_node % consecutive_ranks == 0


def links(layout: Layout, cluster: Cluster, ep: int = 1) -> Links:
    """Ranks are TP fastest, then Ulysses, then CP, then DP, then PP: a TP group is tp consecutive ranks, a Ulysses
    group every tp-th of tp x U consecutive ranks, a CP ring every (tp x U)-th of tp x U x CP (its slowest hop sets
    its pace), a stage's gradient-reduction (U x CP x DP) groups span tp x U x CP x dp consecutive ranks, a
    pipeline spans the whole replica; an expert-parallel group is ep
    consecutive ranks of a stage (parallel_state.expert_parallel_rank_lists; an expert-data-parallel group
    spans the stage: the data link). A group that crosses a node runs at the inter-node bandwidth (its slowest
    hop)."""
    g, device = cluster.gpus_per_node, cluster.device
    tensor_spans = not _fits_in_node(layout.tp, g)
    data_spans = layout.sequence_data_parallel > 1 and not _fits_in_node(layout.tp * layout.sequence_data_parallel, g)
    pipeline_spans = layout.pp > 1 and not _fits_in_node(layout.world_size, g)
    expert_spans = ep > 1 and not _fits_in_node(ep, g)
    ulysses_spans = layout.ulysses > 1 and not _fits_in_node(layout.tp * layout.ulysses, g)
    context_spans = layout.context > 1 and not _fits_in_node(layout.tp * layout.sequence_split, g)

    def bandwidth(spans):
        return (device.inter_node_gbs if spans else device.intra_node_gbs) * 1e9

    return Links(bandwidth(tensor_spans), bandwidth(pipeline_spans), bandwidth(data_spans),
                 tensor_spans, pipeline_spans, data_spans, bandwidth(expert_spans), expert_spans,
                 bandwidth(ulysses_spans), ulysses_spans, bandwidth(context_spans), context_spans)
