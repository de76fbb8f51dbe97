"""Memory per device: model states (weights, gradients, optimizer) and activations.

Model states, bytes per parameter (Adam):
- bf16: weights 2 + gradients 2 + optimizer 12 (fp32 master, m, v), the optimizer sharded over DP with
  ZeRO-1 (docs/formulas.md: 2 + 2 + 12/dp). Plus 4 for the fp32 gradient-accumulation buffer, unsharded:
  megatron_ds writes `"data_types": {"grad_accum_dtype": "fp32"}` for bf16 + ZeRO-1, which selects
  DeepSpeed's BF16_Optimizer, and that keeps a full fp32 gradient buffer beside the bf16 gradients.
- fp16: 2 + 2 + 12/dp (DeepSpeed's ZeRO-1 optimizer: fp32 master, m, v sharded).
- fp32: 4 + 4 + 12/dp with ZeRO-1 (DeepSpeed's ZeRO optimizer keeps an fp32 copy of its partition even when
  the weights are fp32, plus m and v); ZeRO-0: 4 + 4 + 8 (torch AdamW: m and v only).
ZeRO-2 also shards the gradients, ZeRO-3 the weights (PP = 1 only). With DeepSpeed-Ulysses (U ranks per sample)
every "dp" here is U x DP: the weights are replicated on a sample's U ranks, which DeepSpeed counts as
data-parallel, so the gradient reduction and the ZeRO partitions span them (Layout.sequence_data_parallel).
Mixture of Experts: a device holds E / EP experts of each MoE layer (parameters.py); their states are sharded
over the expert-data-parallel group (TP x DP / EP ranks hold the same experts; DeepSpeed's MoE groups),
everything else over DP: per device, non-expert x sharded(dp) + experts x sharded(tp x dp / ep). ZeRO-3 does not
take MoE (DeepSpeed). Activations are counted as for a dense layer (see the plan's warning for MoE).

Activations, bytes per transformer layer and micro-batch, 16-bit (Korthikanti et al. 2022, docs/formulas.md), s
sequence, b micro batch, h hidden, a heads, t TP, U Ulysses SP, with the attention term A:
  no recompute, TP:       s b h / U (10 + 24/t + A/t)   (t = U = 1: s b h (34 + A))
  no recompute, TP + SP:  s b h / (t U) (34 + A)
  selective recompute:    the same without A
  full recompute:         2 s b h / U (the layer input), / t with SP or --distribute-saved-activations
A is the paper's score term 5 a s / h for the explicit attention (--attention-backend local: softmax output 2,
dropout mask 1, dropout output 2 bytes per score) and 2 + 4 a / h for flash attention (sdpa, flash: the GPUs'
kernels keep no scores, only their output, 2 s b h, and an fp32 log-sum-exp per query row, 4 a s b).
The paper's rows are U = 1. Ulysses (--ds-sequence-parallel-size U) divides each by U: outside attention a rank
holds s/U tokens, so every s-proportional term (10 + 24/t, 34/t, the layer input) takes s/U. Inside attention
the all-to-all trades the sequence split for a head split: a rank holds q, k, v (k and v expanded to every query
head) of a/(tU) heads over the whole s, as many elements as s/U tokens of a/t heads, so their share of the 24/t
stays 6 s b h / (t U), and so do the flash kernel's output and statistics; the score term, 5 s^2 b bytes per
head, over a/(tU) heads is 5 a s^2 b / (t U) = s b h / U x 5 a s / (h t). The all-to-alls keep nothing for
backward (DeepSpeed's _SeqAllToAll saves no tensor): attention saves their outputs as q, k, v instead of views
of the QKV output, which nothing keeps then; tools/activation_memory.py measures this on real Ulysses ranks.
fp32 activations count twice. These are the paper's GPT-2-shape counts; SwiGLU and GQA layers differ
somewhat.
A 1F1B stage i of p holds min(p - i, m) micro-batches in flight. Added terms: the first stage keeps the
embedding-dropout mask (s b h bytes, / t with SP) per micro-batch in flight; the last stage keeps the final
norm and head inputs (4 s b h, / t with SP) for its one micro-batch, and its cross entropy (core/fusions/
fused_cross_entropy: no fp32 softmax) needs 6 s b V / t: the logits it keeps (2 s b V / t), those of the
micro-batch before, which DeepSpeed's pipeline keeps as that one's output, and their gradient; plus two fp32
temporaries of one chunk of tokens (min(s b, chunk rows) x V / t, 64 MiB each at most; the triton kernel needs
none, so an upper bound there); all of them / U with Ulysses. Full recompute (Megatron's methods):
"uniform" with N layers per chunk keeps one input per chunk and needs one chunk's whole activations while it
runs backward; "block" recomputes only the first N layers of each stage and keeps the others' whole activations.
"""
import dataclasses
from dataclasses import dataclass
from typing import List

from megatron_ds.core.fusions.fused_cross_entropy import default_chunk_rows
from megatron_ds.planning import pipeline
from megatron_ds.planning.model import Layout, ModelSpec, expert_data_parallel_size
from megatron_ds.planning.parameters import StageParameters, total_parameters

GIB = 1024 ** 3
# Assumed: CUDA context, NCCL buffers, allocator fragmentation and DeepSpeed's communication buffers.
RUNTIME_OVERHEAD_BYTES = 2 * GIB


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state before ZeRO sharding."""
    weights: float
    gradients: float
    grad_accumulation: float
    optimizer: float


def state_bytes_per_parameter(precision: str, zero_stage: int) -> StateBytes:
    if precision == "bf16":
        return StateBytes(2, 2, 4 if zero_stage == 1 else 0, 12)
    if precision == "fp16":
        return StateBytes(2, 2, 0, 12)
    return StateBytes(4, 4, 0, 12 if zero_stage >= 1 else 8)


def checkpoint_bytes(model: ModelSpec, zero_stage: int) -> float:
    """What a training checkpoint of the whole model takes on disk, at least: per parameter its weights and
    the optimizer's states (fp32 master weights where kept, Adam's two moments); gradients are not saved."""
    state = state_bytes_per_parameter(model.precision, zero_stage)
    return total_parameters(model) * (state.weights + state.optimizer)


def sharded_state_bytes(state: StateBytes, zero_stage: int, dp: int) -> StateBytes:
    """Bytes per parameter held by one rank after ZeRO sharding over `dp` ranks."""
    return StateBytes(weights=state.weights / (dp if zero_stage >= 3 else 1),
                      gradients=state.gradients / (dp if zero_stage >= 2 else 1),
                      grad_accumulation=state.grad_accumulation / (dp if zero_stage >= 2 else 1),
                      optimizer=state.optimizer / (dp if zero_stage >= 1 else 1))


def activation_bytes_per_layer(model: ModelSpec, layout: Layout) -> float:
    """One transformer layer, one micro-batch, one device, for the layout's SP and recompute choice."""
    return layer_activation_bytes(model, layout, layout.recompute)


def layer_activation_bytes(model: ModelSpec, layout: Layout, recompute) -> float:
    """As activation_bytes_per_layer, for recompute None, "selective" or "full": the module docstring's rows,
    s/U tokens per rank and the attention term over the whole s (a/(tU) heads of it)."""
    config, t, sp = model.config, layout.tp, layout.sequence_parallel
    s, b, h, a = model.seq_length, layout.micro_batch_size, config.hidden_size, config.num_attention_heads
    if recompute == "full":
        return _saved_layer_input_bytes(model, layout)
    scores = 0.0 if recompute == "selective" else attention_term(config.attention_backend, s, h, a)
    tokens = layout.tokens_per_rank(s, split_over_tp=False)
    per_layer = tokens * b * h / t * (34 + scores) if sp else tokens * b * h * (10 + 24 / t + scores / t)
    return per_layer * (1 if model.sixteen_bit else 2)


def attention_term(attention_backend, s, h, a):
    """The module docstring's A: what core attention keeps beyond q, k and v, in units of s b h bytes."""
    return 5 * a * s / h if attention_backend == "local" else 2 + 4 * a / h


def in_flight_micro_batches(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a stage holds at its peak (1F1B: min(p - stage, m); the other schedules
    as planning/pipeline.py simulates them)."""
    return pipeline.in_flight_micro_batches(layout, stage)


def _first_stage_extra_bytes(model, layout):
    return layout.tokens_per_rank(model.seq_length) * layout.micro_batch_size * model.config.hidden_size


def _last_stage_extra_bytes(model, layout):
    s, b, h, t = model.seq_length, layout.micro_batch_size, model.config.hidden_size, layout.tp
    width = 1 if model.sixteen_bit else 2
    norm_and_head_inputs = 4 * layout.tokens_per_rank(s) * b * h * width
    tokens, vocab = layout.tokens_per_rank(s, split_over_tp=False) * b, model.padded_vocab_size(t) // t
    logits = 3 * 2 * tokens * vocab * width
    chunk_temporaries = 2 * 4 * min(tokens, default_chunk_rows(vocab)) * vocab
    return norm_and_head_inputs + logits + chunk_temporaries


def _saved_layer_input_bytes(model, layout):
    """Full recompute keeps only a layer's (or chunk's) input: 2 s b h, split over TP with SP or
    --distribute-saved-activations (and over U with Ulysses)."""
    split = layout.sequence_parallel or layout.distribute_saved_activations
    tokens = layout.tokens_per_rank(model.seq_length, split_over_tp=split)
    return 2 * tokens * layout.micro_batch_size * model.config.hidden_size * (1 if model.sixteen_bit else 2)


def _layer_activations_per_micro_batch(model, layout, num_layers):
    """(bytes kept per micro-batch in flight, bytes of the one chunk being recomputed in backward)."""
    if layout.recompute != "full":
        return num_layers * activation_bytes_per_layer(model, layout), 0.0
    whole_layer = layer_activation_bytes(model, layout, recompute=None)
    if layout.recompute_method == "uniform":
        chunks = -(-num_layers // layout.recompute_num_layers)
        return (chunks * _saved_layer_input_bytes(model, layout),
                min(layout.recompute_num_layers, num_layers) * whole_layer)
    recomputed = layout.recomputed_layers(num_layers)
    kept = recomputed * _saved_layer_input_bytes(model, layout) + (num_layers - recomputed) * whole_layer
    return kept, whole_layer if recomputed else 0.0


def stage_activation_bytes(model: ModelSpec, layout: Layout, stage: int, num_layers: int) -> float:
    in_flight = in_flight_micro_batches(layout, stage)
    kept, recompute_working_set = _layer_activations_per_micro_batch(model, layout, num_layers)
    total = in_flight * kept + recompute_working_set
    if stage == 0:
        total += in_flight * _first_stage_extra_bytes(model, layout)
    if stage == pipeline.head_rank(layout):
        total += _last_stage_extra_bytes(model, layout)
    return total


@dataclass(frozen=True)
class StageMemory:
    stage: int
    parameters: int
    in_flight_micro_batches: int
    weights: float
    gradients: float
    grad_accumulation: float
    optimizer: float
    activations: float
    overhead: float

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.grad_accumulation + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.overhead


def stage_state_bytes(model: ModelSpec, layout: Layout, stage_params: StageParameters) -> StateBytes:
    """Bytes of each model state one device of the stage holds: the non-expert parameters sharded over U x DP,
    the experts over the expert-data-parallel group (TP x DP / EP)."""
    state = state_bytes_per_parameter(model.precision, layout.zero_stage)
    dense = sharded_state_bytes(state, layout.zero_stage, layout.sequence_data_parallel)
    experts = sharded_state_bytes(state, layout.zero_stage, expert_data_parallel_size(model, layout))
    n, e = stage_params.non_expert, stage_params.experts
    return StateBytes(*(n * a + e * b for a, b in zip(dataclasses.astuple(dense), dataclasses.astuple(experts))))


def stage_memory(model: ModelSpec, layout: Layout, stage_params: StageParameters) -> StageMemory:
    states = stage_state_bytes(model, layout, stage_params)
    return StageMemory(stage=stage_params.stage, parameters=stage_params.total,
                       in_flight_micro_batches=in_flight_micro_batches(layout, stage_params.stage),
                       weights=states.weights, gradients=states.gradients,
                       grad_accumulation=states.grad_accumulation, optimizer=states.optimizer,
                       activations=stage_activation_bytes(model, layout, stage_params.stage,
                                                          stage_params.num_layers),
                       overhead=RUNTIME_OVERHEAD_BYTES)


def memory_per_stage(model: ModelSpec, layout: Layout, stages: List[StageParameters]) -> List[StageMemory]:
    return [stage_memory(model, layout, stage) for stage in stages]
