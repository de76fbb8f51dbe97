"""Communication volume per iteration on each parallel axis, in bytes sent per device (ring algorithms:
an all-reduce of P bytes over n ranks sends 2 (n-1)/n P per rank, an all-gather or reduce-scatter
(n-1)/n P), and which links each axis uses.

TP, per transformer layer and micro-batch (payload P = s b h activation bytes): without SP, 2 all-reduces in
forward (attention projection, fc2) and 2 in backward (the inputs of QKV and fc1); with SP, 2 all-gathers
+ 2 reduce-scatters in forward, and in backward their conjugates plus 2 all-gathers of the saved input
shards for the weight gradients (megatron_ds keeps only the [s/t, b, h] shard). Full recompute repeats
the forward's collectives for each recomputed layer; selective recompute repeats none.
PP, per micro-batch and stage boundary: the activation forward and its gradient backward, s b h each
(s/t b h with SP), sent by every TP rank (DeepSpeed's pipeline sends whole tensors).
DP, per iteration: the gradient all-reduce over the data-parallel group, 2 (dp-1)/dp x gradient bytes
(fp32 with bf16: DeepSpeed's BF16_Optimizer reduces its fp32 accumulation buffer), then with ZeRO-1 the
updated 16-bit weights are all-gathered ((dp-1)/dp x weight bytes). With tied embeddings and PP > 1 the
first and last stages also all-reduce the embedding gradient.
"""
from dataclasses import dataclass

from megatron_ds.planning.model import Cluster, Layout, ModelSpec


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


def tensor_parallel_traffic_per_layer(model: ModelSpec, layout: Layout) -> TensorParallelTraffic:
    t = layout.tp
    payload = model.seq_length * layout.micro_batch_size * model.config.hidden_size * activation_element_bytes(model)
    if layout.sequence_parallel:
        forward, backward = 4 * all_gather_bytes(t, payload), 6 * all_gather_bytes(t, payload)
        collectives = ("2 all-gather + 2 reduce-scatter in forward; backward 2 reduce-scatter + 2 all-gather "
                       "+ 2 all-gathers again of the saved input shards")
    else:
        forward = backward = 2 * all_reduce_bytes(t, payload)
        collectives = "2 all-reduce in forward, 2 in backward"
    recompute = forward if layout.recompute == "full" else 0.0
    if recompute:
        collectives += "; full recompute repeats the forward's"
    return TensorParallelTraffic(payload, forward, backward, recompute, collectives)


def tensor_parallel_bytes_per_micro_batch(model: ModelSpec, layout: Layout, num_layers: int) -> float:
    """TP bytes one device of a stage with `num_layers` layers sends per micro-batch."""
    if layout.tp == 1:
        return 0.0
    per_layer = tensor_parallel_traffic_per_layer(model, layout)
    recomputed = layout.recomputed_layers(num_layers)
    return num_layers * (per_layer.forward + per_layer.backward) + recomputed * per_layer.recompute


def pipeline_payload_per_micro_batch(model: ModelSpec, layout: Layout) -> float:
    """Bytes of one activation (= one activation gradient) crossing a stage boundary, per TP rank."""
    s = model.seq_length / (layout.tp if layout.sequence_parallel else 1)
    return s * layout.micro_batch_size * model.config.hidden_size * activation_element_bytes(model)


def gradient_reduction_element_bytes(model: ModelSpec, layout: Layout) -> int:
    if model.precision == "bf16" and layout.zero_stage == 1:
        return 4
    return 2 if model.sixteen_bit else 4


def data_parallel_traffic(model: ModelSpec, layout: Layout, parameters: int) -> dict:
    """Bytes one device sends per iteration for gradient reduction (and ZeRO-1's weight all-gather)."""
    dp = layout.dp
    gradients = all_reduce_bytes(dp, parameters * gradient_reduction_element_bytes(model, layout))
    weights = (all_gather_bytes(dp, parameters * (2 if model.sixteen_bit else 4))
               if layout.zero_stage >= 1 else 0.0)
    return {"gradient_all_reduce": gradients, "weight_all_gather": weights}


def tied_embedding_traffic(model: ModelSpec, layout: Layout) -> float:
    """First and last stage all-reduce the shared embedding's gradient once per iteration (2 ranks)."""
    if not model.tied_embeddings or layout.pp == 1:
        return 0.0
    vocab_shard = model.padded_vocab_size(layout.tp) // layout.tp * model.config.hidden_size
    return all_reduce_bytes(2, vocab_shard * gradient_reduction_element_bytes(model, layout))


@dataclass(frozen=True)
class Links:
    """Bandwidth (bytes/s, before efficiency) each axis runs at, and whether its groups cross nodes."""
    tensor: float
    pipeline: float
    data: float
    tensor_spans_nodes: bool
    pipeline_spans_nodes: bool
    data_spans_nodes: bool


def _fits_in_node(consecutive_ranks: int, gpus_per_node: int) -> bool:
    """Blocks of `consecutive_ranks` starting at multiples of it never straddle a node boundary."""
    return consecutive_ranks <= gpus_per_node and gpus_per_node % consecutive_ranks == 0


def links(layout: Layout, cluster: Cluster) -> Links:
    """Ranks are TP fastest, then DP, then PP: a TP group is tp consecutive ranks, a stage's DP groups
    span tp x dp consecutive ranks, a pipeline spans the whole replica. A group that crosses a node runs
    at the inter-node bandwidth (its slowest hop)."""
    g, device = cluster.gpus_per_node, cluster.device
    tensor_spans = not _fits_in_node(layout.tp, g)
    data_spans = layout.dp > 1 and not _fits_in_node(layout.tp * layout.dp, g)
    pipeline_spans = layout.pp > 1 and not _fits_in_node(layout.world_size, g)

    def bandwidth(spans):
        return (device.inter_node_gbs if spans else device.intra_node_gbs) * 1e9

    return Links(bandwidth(tensor_spans), bandwidth(pipeline_spans), bandwidth(data_spans),
                 tensor_spans, pipeline_spans, data_spans)
