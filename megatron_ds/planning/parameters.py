"""Exact parameter counts: whole model, per pipeline stage and per device (one TP rank of one stage).

Placement follows the pipeline form (`gpt_layer_specs` partitioned by DeepSpeed with
"type:TransformerLayer"): the embedding on the first stage, layers split evenly, the final norm and the
output head on the last. With tied embeddings and PP > 1 the last stage builds its own copy of the whole
embedding module (DeepSpeed's TiedLayerSpec), so it also holds the vocabulary shard and, with learned
positions, an (unused) copy of the position embeddings. With PP = 1 the head reuses the embedding.

Per TP rank: column-parallel weights and biases and the vocabulary are split by TP; row-parallel biases,
norms and position embeddings are replicated.

Mixture of Experts (DeepSpeed-MoE, config.experts_in_layer: every expert_interval-th layer): an MoE layer's
MLP is a router Linear(h, E, no bias), E experts of the dense MLP's shape and, with PR-MoE's residual
(config.moe_residual), the dense MLP beside them and a Linear(h, 2) coefficient (with bias). Each
expert-parallel (EP) rank holds E / EP experts of every MoE layer, whole (Megatron-DeepSpeed without expert
tensor parallelism, the EP groups being runs of a stage's TP x DP ranks) or split over TP like the dense MLP
(--enable-expert-tensor-parallelism, the EP groups being runs of DP ranks); router, residual MLP and coefficient
are on every rank. The whole model counts all E
experts (total_parameters); a token uses the router, its top-k experts and the residual (active_parameters).

The dropless MoE layer (Megatron-Core's flags, core/transformer/dropless_moe.py; config.dropless_moe_in_layer):
its MLP is a router Linear(h, E, no bias), E routed experts of DeepSpeed's GroupedExperts (gate w1 and up w3
[F, h], down w2 [h, F] each, F = moe_ffn_hidden_size, no biases), and optionally a shared expert (an MLP of its
own width, split over TP like the dense one) with a sigmoid gate Linear(h, 1, no bias). Each EP rank holds E / EP
routed experts, whole (expert TP 1) or each a slice F / t of them on each TP rank (expert TP = TP t); router,
shared expert and gate are on every EP rank, router and gate whole on each TP rank. Its fp32 buffers (the expert
bias and two token counts, E values each) are no parameters:
StageParameters.buffers counts them for memory.py.
"""
from dataclasses import dataclass
from typing import List, Optional

from megatron_ds.core.parallel_layout import teacher_layers_on
from megatron_ds.core.pipeline_split import PipelineSplit
from megatron_ds.planning.model import ModelSpec


def norm_parameters(config, width: Optional[int] = None) -> int:
    """One norm over width channels (default the hidden size): its weight, and with LayerNorm its bias."""
    return (width or config.hidden_size) * (2 if config.normalization == "LayerNorm" else 1)


def attention_parameters(config, tp: int = 1) -> int:
    """Self-attention on one TP rank: QKV (column-parallel) and projection weights and QKV's bias split by TP,
    the projection's (row-parallel) bias and the query and key norms (head dim wide) replicated."""
    if config.multi_latent_attention:
        return mla_parameters(config, tp)
    h, d = config.hidden_size, config.kv_channels
    qkv_out = (config.num_attention_heads + 2 * config.num_query_groups) * d
    qkv_bias = config.bias or config.add_qkv_bias
    sharded = qkv_out * h + config.num_attention_heads * d * h + (qkv_out if qkv_bias else 0)
    query_key_norms = 2 * norm_parameters(config, d) if config.qk_layernorm else 0
    return sharded // tp + (h if config.bias else 0) + query_key_norms


def mla_parameters(config, tp: int = 1) -> int:
    """Multi-latent attention on one TP rank: the query projection (or its latent's up projection), the key-value
    up projection and the output projection split by TP (heads); the down projections, their norms and the output
    projection's bias whole."""
    h, heads, rotary = config.hidden_size, config.num_attention_heads, config.qk_pos_emb_head_dim
    q_rank, kv_rank = config.q_lora_rank, config.kv_lora_rank
    query_heads = heads * (config.qk_head_dim + rotary)
    sharded = (q_rank or h) * query_heads + kv_rank * heads * (config.qk_head_dim + config.v_head_dim) + \
        heads * config.v_head_dim * h
    query_latent = 0 if q_rank is None else h * q_rank + norm_parameters(config, q_rank)
    key_value_latent = h * (kv_rank + rotary) + norm_parameters(config, kv_rank)
    return sharded // tp + query_latent + key_value_latent + (h if config.bias else 0)


def mlp_parameters(config, tp: int = 1, ffn_hidden_size: Optional[int] = None) -> int:
    """One MLP (the dense one, or one expert; of width ffn_hidden_size, default the config's) on one TP rank: fc1
    (gate and up with SwiGLU) and fc2 weights and fc1's bias split by TP, fc2's (row-parallel) bias replicated."""
    h, f = config.hidden_size, ffn_hidden_size or config.ffn_hidden_size
    fc1_out = f * (2 if config.gated_linear_unit else 1)
    sharded = fc1_out * h + f * h + (fc1_out if config.bias else 0)
    return sharded // tp + (h if config.bias else 0)


def one_expert_parameters(config, tp: int = 1) -> int:
    """One expert on one TP rank: whole, or split like the dense MLP with expert tensor parallelism."""
    return mlp_parameters(config, tp if config.moe_expert_tensor_parallel else 1)


def moe_mlp_parameters(config, num_experts: int, ep: int = 1, tp: int = 1) -> int:
    """An MoE layer's MLP on one rank of EP `ep` and TP `tp` (1, 1: all experts): router h E, E / ep experts, and
    with PR-MoE's residual the dense MLP and its Linear(h, 2) coefficient (2h + 2); all but sharded experts
    replicated over TP."""
    h = config.hidden_size
    residual = mlp_parameters(config) + 2 * h + 2 if config.moe_residual else 0
    return h * num_experts + num_experts // ep * one_expert_parameters(config, tp) + residual


def dropless_expert_parameters(config, tp: int = 1) -> int:
    """One routed expert of the dropless layer on one rank of TP `tp`: w1 and w3 [F, h], w2 [h, F], with expert TP
    the rank's slice F / tp of them."""
    return 3 * config.hidden_size * config.moe_ffn_hidden_size // (tp if config.moe_expert_tensor_parallel else 1)


def shared_expert_parameters(config, tp: int = 1) -> int:
    """The dropless layer's shared expert on one TP rank (split like the dense MLP) and its gate h (whole; the layer
    builds it with --moe-shared-expert-gate, shared expert or not)."""
    gate = config.hidden_size if config.moe_shared_expert_gate else 0
    if not config.moe_shared_expert_intermediate_size:
        return gate
    return mlp_parameters(config, tp, config.moe_shared_expert_intermediate_size) + gate


def dropless_moe_parameters(config, ep: int = 1, tp: int = 1) -> int:
    """A dropless MoE layer's MLP on one rank of EP `ep` and TP `tp` (1, 1: all of it): router h E, E / ep routed
    experts, the shared expert and its gate."""
    experts = config.num_moe_experts
    return (config.hidden_size * experts + experts // ep * dropless_expert_parameters(config, tp)
            + shared_expert_parameters(config, tp))


def _layer_mlp_parameters(config, tp, layer_number, ep):
    if layer_number is not None and config.dropless_moe_in_layer(layer_number):
        return dropless_moe_parameters(config, ep, tp)
    experts = 1 if layer_number is None else config.experts_in_layer(layer_number)
    return mlp_parameters(config, tp) if experts == 1 else moe_mlp_parameters(config, experts, ep, tp)


def layer_parameters(config, tp: int = 1, layer_number: Optional[int] = None, ep: int = 1) -> int:
    """Layer `layer_number` (1-based, global; None: a dense layer) on one rank of TP `tp` and EP `ep`
    (tp=1, ep=1: the whole layer)."""
    return attention_parameters(config, tp) + _layer_mlp_parameters(config, tp, layer_number, ep) \
        + 2 * norm_parameters(config)


def expert_parameters(config, layer_number: int, ep: int = 1, tp: int = 1) -> int:
    """The experts of layer `layer_number` one rank of EP `ep` and TP `tp` holds (0 for a dense layer): the
    parameters reduced and ZeRO-partitioned over the expert-data-parallel group instead of DP."""
    if config.dropless_moe_in_layer(layer_number):
        return config.num_moe_experts // ep * dropless_expert_parameters(config, tp)
    experts = config.experts_in_layer(layer_number)
    return 0 if experts == 1 else experts // ep * one_expert_parameters(config, tp)


def dropless_buffer_values(config, layer_number: int) -> int:
    """The fp32 buffer values of layer `layer_number` (0 unless a dropless MoE layer: the expert bias, the token
    counts since the last bias update and the global batch's counts, E each), on every rank."""
    return 3 * config.num_moe_experts if config.dropless_moe_in_layer(layer_number) else 0


def embedding_parameters(model: ModelSpec, tp: int = 1) -> int:
    """Word embeddings (vocabulary shard) plus learned position embeddings (replicated)."""
    h = model.config.hidden_size
    positions = model.max_position_embeddings * h if model.learned_positions else 0
    return model.padded_vocab_size(tp) // tp * h + positions


def output_head_parameters(model: ModelSpec, tp: int, pp: int) -> int:
    """The last stage's head: an untied vocabulary-parallel linear and/or the embedding's copy there (PP > 1)."""
    untied = 0 if model.tied_embeddings else model.padded_vocab_size(tp) // tp * model.config.hidden_size
    return untied + last_stage_embedding_copy(model, tp, pp)


def last_stage_embedding_copy(model: ModelSpec, tp: int, pp: int) -> int:
    """The copy of the embedding the last stage holds at PP > 1: as the tied head, or for the multi-token
    prediction's tokens ahead (also with an untied head)."""
    needed = model.tied_embeddings or model.config.mtp_num_layers
    return embedding_parameters(model, tp) if pp > 1 and needed else 0


def mtp_parameters(config, tp: int = 1, ep: int = 1) -> int:
    """The multi-token prediction modules on one rank of TP `tp` and EP `ep`: per depth three norms, the
    projection (2h -> h, split by TP) and a layer of the last layer's kind; the embedding and head are the
    model's."""
    h = config.hidden_size
    return sum(3 * norm_parameters(config) + 2 * h * h // tp + layer_parameters(config, tp, number, ep)
               for number in _mtp_layer_numbers(config))


def _mtp_layer_numbers(config):
    return range(config.num_layers + 1, config.num_layers + config.mtp_num_layers + 1)


def total_parameters(model: ModelSpec, tp: int = 1) -> int:
    """Distinct parameters of the full model (tied weights once, every expert), vocabulary padded as for TP
    `tp`."""
    config, h = model.config, model.config.hidden_size
    head = 0 if model.tied_embeddings else model.padded_vocab_size(tp) * h
    layers = sum(layer_parameters(config, 1, n) for n in range(1, config.num_layers + 1))
    return (model.padded_vocab_size(tp) * h + (model.max_position_embeddings * h if model.learned_positions else 0)
            + layers + norm_parameters(config) + head)


def active_parameters(model: ModelSpec, tp: int = 1) -> int:
    """Parameters one token uses: the total less, in each MoE layer, the E - k experts it does not go to (the
    router, its top-k experts, the residual MLP and the dropless layer's shared expert count; the dense parts as
    in the total)."""
    return total_parameters(model, tp) - sum(_unused_experts_parameters(model.config, n)
                                             for n in range(1, model.config.num_layers + 1))


def _unused_experts_parameters(config, layer_number):
    """The parameters of the experts of layer `layer_number` a token does not go to."""
    if config.dropless_moe_in_layer(layer_number):
        return (config.num_moe_experts - config.moe_router_topk) * dropless_expert_parameters(config)
    experts = config.experts_in_layer(layer_number)
    return max(experts - config.moe_router_topk, 0) * mlp_parameters(config) if experts > 1 else 0


@dataclass(frozen=True)
class StageParameters:
    """Parameters held by one device (one TP rank, one EP rank) of a pipeline stage."""
    stage: int
    num_layers: int
    embedding: int
    layers: int
    final_norm: int
    output_head: int
    first_layer: int = 1     # the global number (1-based) of the stage's first layer
    mtp: int = 0             # the multi-token prediction modules (last stage)
    experts: int = 0         # of `layers`, the MoE experts this device holds (reduced over TP x DP / EP ranks)
    buffers: int = 0         # fp32 buffer values beside the parameters (the dropless MoE layers' bias and counts)

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_norm + self.output_head + self.mtp

    @property
    def non_expert(self) -> int:
        """Everything but the experts: reduced and ZeRO-partitioned over the whole data-parallel group."""
        return self.total - self.experts


def layers_per_stage(num_layers: int, pp: int, split: PipelineSplit = PipelineSplit()) -> List[int]:
    """The transformer layers of each of pp consecutive stages, as training splits them (core/pipeline_split.py:
    even, or Megatron-LM's uneven split)."""
    return list(split.stage_layers(num_layers, pp))


def stage_parameters(model: ModelSpec, tp: int, pp: int, ep: Optional[int] = None,
                     split: PipelineSplit = PipelineSplit()) -> List[StageParameters]:
    """Per stage, one device's parameters: TP rank of `tp`, EP rank of `ep` (default the model's
    moe_expert_parallel_size; ep=1 counts every expert of the stage), the layers split as `split` says."""
    config = model.config
    ep = config.moe_expert_parallel_size if ep is None else ep
    stages, first = [], 1
    for stage, count in enumerate(layers_per_stage(config.num_layers, pp, split)):
        last = stage == pp - 1
        numbers = range(first, first + count)
        held = (*numbers, *(_mtp_layer_numbers(config) if last else ()))  # the layers whose experts it holds
        stages.append(StageParameters(
            stage=stage, num_layers=count,
            embedding=embedding_parameters(model, tp) if stage == 0 else 0,
            layers=sum(layer_parameters(config, tp, n, ep) for n in numbers),
            final_norm=norm_parameters(config) if last else 0,
            output_head=output_head_parameters(model, tp, pp) if last else 0,
            mtp=mtp_parameters(config, tp, ep) if last else 0, first_layer=first,
            experts=sum(expert_parameters(config, n, ep, tp) for n in held),
            buffers=sum(dropless_buffer_values(config, n) for n in held)))
        first += count
    return stages


def teacher_parameters(model: ModelSpec, stage: StageParameters, tp: int, pp: int) -> int:
    """--kd: the frozen teacher's parameters on one device of the stage: the teacher layers riding on the stage's
    student layers (core/parallel_layout.teacher_layers_on), its embedding where the student's is, its final norm
    and head where the student's are."""
    teacher = model.teacher
    if teacher is None:
        return 0
    numbers = teacher_layers_on(range(stage.first_layer, stage.first_layer + stage.num_layers),
                                model.config.num_layers, teacher.config.num_layers)
    count = sum(layer_parameters(teacher.config, tp, n) for n in numbers)
    if stage.embedding:
        count += embedding_parameters(teacher, tp)
    if stage.final_norm:
        count += norm_parameters(teacher.config) + output_head_parameters(teacher, tp, pp)
    return count


def rank_parameters(model: ModelSpec, layout, tp: Optional[int] = None, ep: Optional[int] = None
                    ) -> List[StageParameters]:
    """Per pipeline rank, one device's parameters (stage_parameters' tp and ep, default the layout's and the
    model's). DualPipeV's rank r holds model stages r and 2p - 1 - r of 2p (rank 0 the embedding and the head,
    tied in one module there: no copy)."""
    tp = layout.tp if tp is None else tp
    if layout.pipeline_schedule != "dualpipev":
        return stage_parameters(model, tp, layout.pp, ep, layout.split)
    stages = stage_parameters(model, tp, 2 * layout.pp, ep, layout.split)  # model stages in order: the split's
    ranks = []
    for rank in range(layout.pp):
        down, up = stages[rank], stages[2 * layout.pp - 1 - rank]
        head = up.output_head - (last_stage_embedding_copy(model, tp, 2 * layout.pp) if rank == 0 else 0)
        ranks.append(StageParameters(stage=rank, num_layers=down.num_layers + up.num_layers,
                                     embedding=down.embedding, layers=down.layers + up.layers,
                                     final_norm=up.final_norm, output_head=head, first_layer=down.first_layer,
                                     mtp=up.mtp, experts=down.experts + up.experts, buffers=down.buffers + up.buffers))
    return ranks
