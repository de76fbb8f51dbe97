"""Memory per device: model states (weights, gradients, optimizer) and activations.

Model states, bytes per parameter (Adam):
- bf16: weights 2 + gradients 2 + optimizer 12 (fp32 master, m, v), the optimizer sharded over DP with
  ZeRO-1 (docs/formulas.md: 2 + 2 + 12/dp). Plus 4 for the fp32 gradient-accumulation buffer, unsharded:
  megatron_ds writes `"data_types": {"grad_accum_dtype": "fp32"}` for bf16 + ZeRO-1, which selects
  DeepSpeed's BF16_Optimizer, and that keeps a full fp32 gradient buffer beside the bf16 gradients.
- fp16: 2 + 2 + 12/dp (DeepSpeed's ZeRO-1 optimizer: fp32 master, m, v sharded).
- fp32: 4 + 4 + 12/dp with ZeRO-1 (DeepSpeed's ZeRO optimizer keeps an fp32 copy of its partition even when
  the weights are fp32, plus m and v); ZeRO-0: 4 + 4 + 8 (torch AdamW: m and v only).
ZeRO-2 also shards the gradients, ZeRO-3 the weights (PP = 1 only). With DeepSpeed-Ulysses and context parallelism
(U x CP ranks per sample) every "dp" here is U x CP x DP: the weights are replicated on a sample's U x CP ranks,
which DeepSpeed counts as data-parallel, so the gradient reduction and the ZeRO partitions span them
(Layout.sequence_data_parallel).
Mixture of Experts: a device holds E / EP experts of each MoE layer (parameters.py); their states are sharded
over the expert-data-parallel group (TP x DP / EP ranks hold the same experts; DeepSpeed's MoE groups),
everything else over DP: per device, non-expert x sharded(dp) + experts x sharded(tp x dp / ep). ZeRO-3 does not
take MoE (DeepSpeed). An MoE layer's activations: see _moe_mlp_bytes. The dropless MoE layer's routed experts
are sharded the same way (E / EP whole experts per device, states over TP x U x DP / EP); its fp32 buffers (the
expert bias and two token counts, 3 E values per layer) are held beside the parameters (StageMemory.buffers); its
activations: dropless_moe_mlp_bytes, planned for the expected rows (uniform routing), the worst case reported.

Activations, bytes per transformer layer and micro-batch, counted from the layer's config the way the paper
counts its GPT-2 layer (Korthikanti et al. 2022, docs/formulas.md): s sequence, b micro batch, h hidden, a heads,
g query groups (key/value heads), d head dim, F FFN hidden, t TP, U Ulysses SP, w bytes per activation (2, or 4
for fp32). Per token, outside the TP regions (s/U tokens, s/(tU) with SP): both norms' inputs, the QKV and fc1
inputs, 4wh, and with hidden dropout the two 1-byte masks, 2h (what bias-dropout-add's reference keeps; its
Triton and compiled kernels keep only the mask's seed, so there this is 2h too many). Inside them (s/U tokens,
every term / t): the MLP (GeLU: its input and output, 2wF; SwiGLU: fc1's 2F output and the product, 3wF),
attention's output (the projection's input, w a d), q, k and v, and the attention kernel's own:
- q, k, v: where q is a view of the QKV output (multi-head, or one query group per TP rank, where k and v are
  stride-0 expansions of it) and attention keeps what it is given (sdpa's kernels; selective recompute's
  checkpoint; the local path's matmuls for multi-head, whose reshapes stay views), that output stays whole,
  w(a + 2g)d, beside RoPE's rotated q and k (k expanded, 2wad); otherwise q, k and v are copies of a heads each,
  3wad (GQA's expansions, the local matmuls' copies of grouped views, the flash_attention op's contiguous copies,
  Ulysses' all-to-alls). On a CPU (device "cpu", what tools/activation_memory.py measures) sdpa's causal flash
  kernel takes GQA's k and v heads as views, and so does an sm80+ GPU's flash attention for fp16 and bf16 (head
  dim up to 256; fp32 goes to a kernel that takes no groups, so they are expanded): the QKV output whole,
  w(a + 2g)d, beside RoPE's rotated q and k, w(a + g)d, or without RoPE q's copy, wad, where q is no view.
- the kernel: the local path's softmax output over s keys per head, w a s, and with attention dropout its
  1-byte mask and output, (2w + 1) a s (the paper's 5as/h term); a flash kernel (sdpa's, the op's) its fp32
  log-sum-exp per head, 4a; selective recompute keeps neither.
- RoPE's fp32 cos and sin, 8 (s/U) r per layer (r the rotary dimension), made anew by every layer.
For the paper's GPT-2 layer (w 2, g = a, F = 4h, dropout) this is s b h (10 + 24/t) without SP and
s b h 34/t with it, plus the kernel's term; full recompute keeps the layer input, w s b h / U, / t with SP or
--distribute-saved-activations. Ulysses: outside attention a rank holds s/U tokens; inside, the all-to-all trades
the sequence split for a head split (a/(tU) heads over the whole s, as many elements as s/U tokens of a/t heads),
so every per-token term above takes s/U tokens, the local scores included (a/(tU) heads x s x s). The
all-to-alls keep nothing for backward (DeepSpeed's _SeqAllToAll saves no tensor). tools/activation_memory.py
measures these counts on real TP and Ulysses ranks. Context parallelism (CP): a rank holds s/(U CP) tokens, so
every per-token term takes s/(U CP); its attention (core/transformer/ring_attention.py, whatever the backend) takes
GQA's k and v as views (without Ulysses: the QKV output whole beside RoPE's rotated q and k, as sdpa_grouped) and
keeps, beyond them, the fp32 log-sum-exp and the fp32 merged output, 4a (1 + d) per token; its backward working
set: context_backward_working_set_bytes.
A 1F1B stage i of p holds min(p - i, m) micro-batches in flight. Added terms: the first stage keeps the
embedding-dropout mask (s b h bytes, / t with SP; with hidden dropout only) per micro-batch in flight; the last
stage keeps the final norm and head inputs (2w s b h, / t with SP) for its one micro-batch, and its cross entropy
(core/fusions/fused_cross_entropy: no fp32 softmax) needs 3w s b V / t: the logits it keeps (w s b V / t), those
of the micro-batch before, which DeepSpeed's pipeline keeps as that one's output, and their gradient; plus two
fp32 temporaries of one chunk of tokens (min(s b, chunk rows) x V / t, 64 MiB each at most; the triton kernel
needs none, so an upper bound there); all of them / U with Ulysses. Full recompute (Megatron's methods):
"uniform" with N layers per chunk keeps one input per chunk and needs one chunk's whole activations while it
runs backward; "block" recomputes only the first N layers of each stage and keeps the others' whole activations.
Every stage also needs one layer's backward working set (_backward_working_set_bytes) and the buffers its
pipeline engine keeps for sending and receiving (_pipeline_buffer_bytes: DeepSpeed's PipelineEngine for 1F1B and
ZB-H1, DualPipeVEngine for DualPipeV and the interleaved schedule).
Knowledge distillation (--kd, teacher_bytes): the frozen teacher's share of the stage in the run's dtype (no
gradients or optimizer states), its forward kept for nothing (run without autograd); its hidden states travel
beside the student's, w s b h_t per message kept as the student's are; the last stage holds its logits
(w s b V / t, kept by the distillation term for backward) and the term's fp32 temporaries, four of one chunk of
tokens (min(s b, chunk rows) x V / t: both log-probabilities, the teacher's probabilities and their product).
"""
import dataclasses
import math
from dataclasses import dataclass
from typing import List

from megatron_ds.core.fusions.fused_cross_entropy import default_chunk_rows
from megatron_ds.core.pipeline_schedules import chunks_per_rank, messages_split_over_tensor_parallel, model_stage
from megatron_ds.core.transformer.attention import gpu_sdpa_takes_grouped_heads
from megatron_ds.core.transformer.fused_ops import cuda_op_backend, runs_flash_attention
from megatron_ds.planning import pipeline
from megatron_ds.planning.communication import (
    context_head_dims,
    context_traffic_per_layer,
    deepspeed_expert_slots,
    dropless_routed_tokens,
    expert_capacity,
)
from megatron_ds.planning.model import Layout, ModelSpec, expert_data_parallel_size
from megatron_ds.planning.parameters import StageParameters, teacher_parameters, total_parameters

GIB = 1024 ** 3
FP8_BLOCK = 128  # core/tensor_parallel/fp8.py's tile and block edge
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
    return layer_activation_bytes(model, layout, layout.recompute, fp8=model.config.fp8_format is not None)


def layer_activation_bytes(model: ModelSpec, layout: Layout, recompute, experts: int = 1, device="cuda",
                           dropless: bool = False, fp8: bool = False) -> float:
    """As activation_bytes_per_layer, for recompute None, "selective" or "full", of a dense layer, one with
    `experts` DeepSpeed-MoE experts or (dropless) a dropless MoE layer: the module docstring's count from the layer's
    config, s/U tokens per rank (s/(tU) outside TP regions with SP) and attention over the whole s for a/(tU)
    heads; on a GPU, or with device "cpu" as a CPU runs it (tools/activation_memory.py); fp8: its GEMMs in FP8
    (fp8_layer_change)."""
    if recompute == "full":
        return _saved_layer_input_bytes(model, layout)
    config, s, width = model.config, model.seq_length, _activation_width(model)
    replicated_tokens, split_tokens = micro_batch_tokens(model, layout)
    attention = (replicated_tokens * (_replicated_attention_bytes_per_token(config, width)
                                      + _mla_latent_bytes_per_token(config, width))
                 + split_tokens * _split_attention_bytes_per_token(config, layout, s, recompute, width, device)
                 / layout.tp + split_tokens * _mla_rotary_key_bytes_per_token(config, width))
    if dropless:
        mlp = dropless_moe_mlp_bytes(model, layout)
    elif experts > 1:
        mlp = _moe_mlp_bytes(model, layout, replicated_tokens, experts, width)
    else:
        mlp = (replicated_tokens * width * config.hidden_size
               + split_tokens * _mlp_bytes_per_token(config, width) / layout.tp)
    change = fp8_layer_change(model, layout, recompute, experts, dropless, device) if fp8 else 0.0
    return attention + mlp + _rotary_angle_bytes(model, layout) + change


def fp8_copies_bytes(inputs: int, outputs: float, tokens: float, recipe: str) -> float:
    """What one FP8 linear keeps for backward (core/tensor_parallel/fp8.py's Fp8Linear): x^T [inputs, tokens] and
    W^T [inputs, outputs] in FP8, one byte an element, and their fp32 dequantisation scales: tensorwise one each,
    rowwise one per row of each; blockwise x^T per 1x128 tile of tokens (padded to whole tiles) and W^T per
    128x128 block (padded to whole blocks)."""
    if recipe == "blockwise":
        token_tiles, input_blocks, output_blocks = (math.ceil(n / FP8_BLOCK) for n in (tokens, inputs, outputs))
        data = inputs * token_tiles * FP8_BLOCK + input_blocks * output_blocks * FP8_BLOCK ** 2
        return data + 4 * (inputs * token_tiles + input_blocks * output_blocks)
    scales = 2 * inputs if recipe == "rowwise" else 2
    return inputs * (tokens + outputs) + 4 * scales


def fp8_layer_change(model: ModelSpec, layout: Layout, recompute, experts: int = 1, dropless: bool = False,
                     device="cuda") -> float:
    """What running a layer's GEMMs in FP8 changes in what it keeps (recompute None or "selective"): each FP8
    linear's copies (fp8_copies_bytes; the column-parallel ones of the whole tokens, which they take gathered
    under SP), less the 16-bit inputs no other op keeps: QKV's and fc1's (the norms' outputs), fc2's (the
    activation's output), the projection's where attention's kernel does not keep that tensor as its own output
    (_projection_input_freed); multi-latent attention: _fp8_mla_change; DeepSpeed-MoE's experts:
    fp8_deepspeed_experts_change; a dropless MoE layer's experts: fp8_dropless_change."""
    attention = (_fp8_mla_change if model.config.multi_latent_attention else _fp8_attention_change)(
        model, layout, recompute, device)
    if dropless:
        return attention + fp8_dropless_change(model, layout)
    if experts > 1:
        return attention + fp8_deepspeed_experts_change(model, layout, experts)
    return attention + _fp8_mlp_change(model, layout, model.config.ffn_hidden_size, whole_input_freed=True)


def _fp8_attention_change(model, layout, recompute, device):
    """QKV attention in FP8: QKV's and the projection's copies, less QKV's 16-bit input and, where freed, the
    projection's."""
    config, width, recipe = model.config, _activation_width(model), model.config.fp8_recipe
    t, h = layout.tp, config.hidden_size
    replicated, tokens = micro_batch_tokens(model, layout)
    heads_width = config.num_attention_heads * config.kv_channels
    qkv_width = (config.num_attention_heads + 2 * config.num_query_groups) * config.kv_channels
    projection_input = width * heads_width / t * tokens
    return (fp8_copies_bytes(h, qkv_width / t, tokens, recipe) - width * h * replicated
            + fp8_copies_bytes(heads_width // t, h, tokens, recipe)
            - (projection_input if _projection_input_freed(config, layout, recompute, device) else 0.0))


def _fp8_mla_change(model, layout, recompute, device):
    """Multi-latent attention in FP8 (all its linears are FP8 linears): the copies of the down projections, whole on
    each rank over its own tokens (s/t with SP), and of the query (or query up), key-value up and output
    projections over the whole tokens; less the 16-bit inputs only they kept: the layer norm's output (the query or
    query down and the key-value down projections' input), each latent norm's output (its up projection's input)
    and, where freed, the output projection's."""
    config, width, recipe = model.config, _activation_width(model), model.config.fp8_recipe
    t, h = layout.tp, config.hidden_size
    replicated, tokens = micro_batch_tokens(model, layout)
    a, q_rank, kv_rank = config.num_attention_heads, config.q_lora_rank or 0, config.kv_lora_rank
    query_width = a * (config.qk_head_dim + config.qk_pos_emb_head_dim)
    down = fp8_copies_bytes(h, kv_rank + config.qk_pos_emb_head_dim, replicated, recipe) \
        + (fp8_copies_bytes(h, q_rank, replicated, recipe) if q_rank else 0.0)
    up = fp8_copies_bytes(q_rank or h, query_width / t, tokens, recipe) \
        + fp8_copies_bytes(kv_rank, a * (config.qk_head_dim + config.v_head_dim) / t, tokens, recipe)
    output = fp8_copies_bytes(a * config.v_head_dim // t, h, tokens, recipe)
    projection_input = width * a * config.v_head_dim / t * tokens
    return (down + up + output - width * replicated * (h + q_rank + kv_rank)
            - (projection_input if _projection_input_freed(config, layout, recompute, device) else 0.0))


def _projection_input_freed(config, layout, recompute, device):
    """Whether the output projection's 16-bit input is its own, so FP8 frees it: attention's kernel does not keep it
    as its output under selective recompute, on the local path, the ring, Ulysses' all-to-all, or where sdpa pads
    multi-latent attention's value (or its query and key) to one head dim: the projection takes a copy of the
    output's v channels."""
    kernel = "ring" if layout.context > 1 else attention_kernel(config, device)
    head_dims_differ = config.multi_latent_attention and \
        config.v_head_dim != config.qk_head_dim + config.qk_pos_emb_head_dim
    return (recompute == "selective" or kernel in ("local", "ring") or layout.ulysses > 1
            or (kernel in ("sdpa", "sdpa_grouped") and head_dims_differ))


def _fp8_mlp_change(model, layout, ffn_hidden_size, whole_input_freed):
    """A dense MLP of width F in FP8: fc1's and fc2's copies, less fc2's 16-bit input (the activation's output)
    and, where fc1 alone keeps it (whole_input_freed), fc1's (the norm's output; 16-bit on this rank's tokens)."""
    config, width, recipe = model.config, _activation_width(model), model.config.fp8_recipe
    t, h = layout.tp, config.hidden_size
    replicated, tokens = micro_batch_tokens(model, layout)
    fc1_width = ffn_hidden_size * (2 if config.gated_linear_unit else 1)
    return (fp8_copies_bytes(h, fc1_width / t, tokens, recipe) - (width * h * replicated if whole_input_freed else 0)
            + fp8_copies_bytes(ffn_hidden_size // t, h, tokens, recipe) - width * ffn_hidden_size / t * tokens)


def fp8_dropless_change(model: ModelSpec, layout: Layout, received_rows=None) -> float:
    """A dropless MoE layer's MLP in FP8 (dropless_moe_mlp_bytes): each of this rank's E / EP experts computes an
    even share of the rows, its gate and up GEMMs each keeping FP8 copies of the rows (fp8_copies_bytes) where the
    16-bit rows went, its down GEMM the product's; the shared expert as a dense MLP (its input freed only where it
    keeps its own whole copy: TP without SP)."""
    config, width, recipe = model.config, _activation_width(model), model.config.fp8_recipe
    h, slices = config.hidden_size, layout.tp if config.moe_expert_tensor_parallel else 1
    local_experts = config.num_moe_experts // config.moe_expert_parallel_size
    received = dropless_received_rows(model, layout) if received_rows is None else received_rows
    rows, ffn = slices * received / local_experts, config.moe_ffn_hidden_size // slices
    per_expert = (2 * fp8_copies_bytes(h, ffn, rows, recipe) + fp8_copies_bytes(ffn, h, rows, recipe)
                  - width * rows * (h + ffn))
    shared = config.moe_shared_expert_intermediate_size
    shared_change = _fp8_mlp_change(model, layout, shared, whole_input_freed=layout.tp > 1
                                    and not layout.sequence_parallel) if shared else 0.0
    return local_experts * per_expert + shared_change


def fp8_deepspeed_experts_change(model: ModelSpec, layout: Layout, experts: int) -> float:
    """DeepSpeed-MoE's experts in FP8 (_moe_mlp_bytes; each is our MLP, its fc1 and fc2 FP8 linears): each of this
    rank's E / EP experts computes an even share of the slots, its fc1 and fc2 keeping FP8 copies of its slots
    (fp8_copies_bytes) in place of the slots' 16-bit inputs and fc2's (the activation's output)."""
    config, width, recipe = model.config, _activation_width(model), model.config.fp8_recipe
    h = config.hidden_size
    slots, ffn = deepspeed_expert_slots(model, layout, experts)
    local_experts = experts // config.moe_expert_parallel_size
    rows, fc1_width = slots / local_experts, ffn * (2 if config.gated_linear_unit else 1)
    per_expert = fp8_copies_bytes(h, fc1_width, rows, recipe) + fp8_copies_bytes(ffn, h, rows, recipe)
    return local_experts * per_expert - width * slots * (h + ffn)


def micro_batch_tokens(model: ModelSpec, layout: Layout) -> tuple:
    """(replicated, whole): a micro-batch's tokens on this rank in tensors Megatron SP splits over TP, and in those
    it keeps whole over TP (both split by Ulysses and CP)."""
    s, b = model.seq_length, layout.micro_batch_size
    return b * layout.tokens_per_rank(s), b * layout.tokens_per_rank(s, split_over_tp=False)


def _activation_width(model):
    return 2 if model.sixteen_bit else 4


def _replicated_attention_bytes_per_token(config, width):
    """Outside the TP regions, but the fc1 input: both norms' inputs, the QKV input, the two dropout masks (1
    byte)."""
    masks = 2 * config.hidden_size if config.hidden_dropout > 0 else 0
    return 3 * width * config.hidden_size + masks


def _mlp_bytes_per_token(config, width, ffn_hidden_size=None):
    """A dense MLP inside its TP region, before the split over t (GeLU: its input and output; SwiGLU: fc1's 2F
    output and the product)."""
    return (3 if config.gated_linear_unit else 2) * width * (ffn_hidden_size or config.ffn_hidden_size)


def _split_attention_bytes_per_token(config, layout, s, recompute, width, device):
    """Inside the TP region, before the split over t: q, k, v, the projection's input (attention's output) and
    the attention kernel's own."""
    heads_width = config.num_attention_heads * config.kv_channels
    kernel = "ring" if layout.context > 1 else attention_kernel(config, device)
    attention = 0.0 if recompute == "selective" else attention_term(config, s, kernel, width)
    if config.multi_latent_attention:
        return _mla_query_key_value_bytes_per_token(config, kernel, recompute, width) + attention
    return _qkv_saved_bytes_per_token(config, layout, kernel, recompute, width) + width * heads_width + attention


def _mla_query_key_value_bytes_per_token(config, kernel, recompute, width):
    """Multi-latent attention inside the TP region, before the split over t: query and key (the concatenations
    of their parts, dq = qk + r each), the value and attention's output (v each); sdpa pads the value to dq
    (attention._one_head_dim), and its kernel keeps the padded value and output beside the unpadded output the
    projection takes (selective recompute keeps the unpadded inputs alone)."""
    a, query_dim, value_dim = config.num_attention_heads, config.qk_head_dim + config.qk_pos_emb_head_dim, \
        config.v_head_dim
    padded = kernel in ("sdpa", "sdpa_grouped") and recompute != "selective" and value_dim < query_dim
    kernel_value = query_dim if padded else value_dim
    return width * a * (2 * query_dim + kernel_value + value_dim + (kernel_value if padded else 0))


def _mla_latent_bytes_per_token(config, width):
    """Multi-latent attention outside the TP regions: each latent's norm input and output (the up projection's
    input), 2w (q_r + kv_r)."""
    if not config.multi_latent_attention:
        return 0.0
    return 2 * width * ((config.q_lora_rank or 0) + config.kv_lora_rank)


def _mla_rotary_key_bytes_per_token(config, width):
    """Multi-latent attention's rotary key, whole on every TP rank over the rank's s/U tokens: its channels taken
    apart and rotated, 2 w r."""
    return 2 * width * config.qk_pos_emb_head_dim if config.multi_latent_attention else 0.0


def _moe_mlp_bytes(model, layout, tokens, experts, width):
    """One MoE layer's MLP (DeepSpeed's MOELayer, sparse routes), `tokens` tokens: what it saves in place of a
    dense MLP's. The gate keeps its fp32 input (4h per token; the norm's output itself is not kept) and its
    routing: softmax and one-hot (top-1: 12 bytes per token and expert; top-2, and here any k > 1: 13, plus 16
    per token), 4E. The dispatch keeps its slot map (8 bytes per slot, E C + 1 slots); the combine the k routes'
    int64 slots, their gathered outputs (w h each) and fp32 weights. Each TP rank's experts run its share of the
    slots, E ceil(C/t) (DeepSpeed's drop of the duplicated tokens, padded as megatron_ds pads it; with EP the
    all-to-all moves slots, not their number): per slot the expert's input and MLP, w h + 2wF (3wF SwiGLU),
    F/t wide with --enable-expert-tensor-parallelism, which gathers all C slots instead. Plus the auxiliary
    loss, 4. PR-MoE's residual MLP is not counted (the plan warns)."""
    config = model.config
    h, k = config.hidden_size, config.moe_router_topk
    capacity = expert_capacity(model, tokens, experts)
    routing = tokens * experts * (12 if k == 1 else 13) + (0 if k == 1 else 16 * tokens) + 4 * experts
    gate = 4 * tokens * h + routing
    combine = 8 * (experts * capacity + 1) + k * tokens * (8 + width * h + 4)
    slots, ffn = deepspeed_expert_slots(model, layout, experts)
    return gate + combine + slots * (width * h + _mlp_bytes_per_token(config, width, ffn)) + 4


def dropless_received_rows(model: ModelSpec, layout: Layout, worst: bool = False) -> float:
    """Rows this rank's experts compute per dropless MoE layer and micro-batch: expected (uniform routing), k T, each
    expert k T / E rows from each of the EP ranks; at worst every row of the expert-parallel group lands on this
    rank's experts, EP k T."""
    rows = model.config.moe_router_topk * dropless_routed_tokens(model, layout)
    return rows * (model.config.moe_expert_parallel_size if worst else 1)


def dropless_moe_mlp_bytes(model: ModelSpec, layout: Layout, received_rows=None) -> float:
    """One dropless MoE layer's MLP (core/transformer/dropless_moe.py, alltoall dispatcher), one micro-batch: what it
    keeps for backward in place of a dense MLP's, its experts computing `received_rows` rows (default: the expected,
    dropless_received_rows). T tokens routed (dropless_routed_tokens), N = k T rows, R received, w bytes:
      - the MLP's input, w h T (the router's input; under TP without SP the layer's own split copy);
      - the router (_router_bytes) and, with their coefficients, the balance and z-losses (_router_loss_bytes);
      - each row's place and token (int64), 16 N; with EP > 1 the received rows' expert order and its inverse, 16 R;
      - with expert TP (t = TP) the R rows of every TP rank gathered, G = t R, and their expert order and its
        inverse, 16 G (else G = R);
      - the experts: each computed row's input, and its gate and up projections and their SwiGLU product,
        w (h + 3F / t) x G (the layer's SwiGLU keeps its two inputs alone on every device, DeepSpeed's Triton
        kernel on a GPU);
      - the combine: each row's output and its fp32 weight, (w h + 4) N;
      - the shared expert and its gate (_shared_expert_bytes)."""
    config, width = model.config, _activation_width(model)
    h, tokens = config.hidden_size, dropless_routed_tokens(model, layout)
    rows = config.moe_router_topk * tokens
    received = dropless_received_rows(model, layout) if received_rows is None else received_rows
    slices = layout.tp if config.moe_expert_tensor_parallel else 1
    computed = slices * received
    places = 16 * rows + (16 * received if config.moe_expert_parallel_size > 1 else 0) \
        + (16 * computed if slices > 1 else 0)
    experts = computed * width * (h + 3 * config.moe_ffn_hidden_size / slices)
    losses = _router_loss_bytes(config, tokens, layout.micro_batch_size)
    return (width * h * tokens + _router_bytes(config, tokens) + losses + places
            + experts + rows * (width * h + 4) + _shared_expert_bytes(model, layout, width))


def _router_bytes(config, tokens):
    """The router's fp32 scores (softmax or sigmoid output), 4 T E, its choice (int64), 8 T k, and where it
    normalises the chosen scores (softmax unless pre-softmax; sigmoid at k > 1) those and their sum, 4 T (k + 1)."""
    k, softmax = config.moe_router_topk, config.moe_router_score_function == "softmax"
    normalised = not config.moe_router_pre_softmax if softmax else k > 1
    return tokens * (4 * config.num_moe_experts + 8 * k + (4 * (k + 1) if normalised else 0))


def _router_loss_bytes(config, tokens, micro_batch_size):
    """With --moe-aux-loss-coeff the balance loss's fp32 scores, 4 T E (sigmoid's normalised: + 4 T), and its
    counts, 4 E (seq_aux_loss: 4 b E); with --moe-z-loss-coeff the fp32 logits and their log-sum-exp, 4 T (E + 1);
    with either, the loss (4)."""
    experts, balance, z = config.num_moe_experts, 0.0, 0.0
    if config.moe_router_load_balancing_type != "none" and config.moe_aux_loss_coeff:
        sequences = micro_batch_size if config.moe_router_load_balancing_type == "seq_aux_loss" else 1
        sigmoid = config.moe_router_score_function == "sigmoid"
        balance = tokens * (4 * experts + (4 if sigmoid else 0)) + 4 * experts * sequences
    if config.moe_z_loss_coeff:
        z = tokens * 4 * (experts + 1)
    return balance + z + (4 if balance or z else 0)


def _shared_expert_bytes(model, layout, width):
    """The shared expert as a dense MLP of its width (SwiGLU 3 w F_s per token / t; its input is the router's, or
    under TP without SP the whole input, w h s b / U) and its gate: the MLP's output and the sigmoid, w (h + 1) per
    token."""
    config = model.config
    if not config.moe_shared_expert_intermediate_size:
        return 0.0
    replicated, split = micro_batch_tokens(model, layout)
    whole_input = width * config.hidden_size * split if layout.tp > 1 and not layout.sequence_parallel else 0.0
    mlp = split * _mlp_bytes_per_token(config, width, config.moe_shared_expert_intermediate_size) / layout.tp
    gate = replicated * width * (config.hidden_size + 1) if config.moe_shared_expert_gate else 0.0
    return whole_input + mlp + gate


def attention_kernel(config, device="cuda") -> str:
    """The attention a GPU (or a CPU) runs for this config: "local" (explicit scores), "flash_op" (megatron_ds's
    flash_attention op), "sdpa" (torch's kernels, GQA's key and value heads expanded to every query head) or
    "sdpa_grouped" (torch's kernels taking those heads as they are: the CPU's flash kernel, and an sm80+ GPU's
    flash attention for fp16 and bf16, core/transformer/attention.gpu_sdpa_takes_grouped_heads)."""
    if config.attention_backend == "local":
        return "local"
    if device == "cpu":
        return "flash_op" if runs_flash_attention(config) else "sdpa_grouped"
    if runs_flash_attention(config, cuda_op_backend):
        return "flash_op"
    return "sdpa_grouped" if gpu_sdpa_takes_grouped_heads(config.params_dtype, config.kv_channels) else "sdpa"


def _qkv_saved_bytes_per_token(config, layout, kernel, recompute, width):
    """The storage that keeps q, k, v for backward: the module docstring's views of the QKV output (q a view of
    it, kept as given) or copies, 3ad."""
    a, g, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    q_is_view = layout.ulysses == 1 and (g == a or g == layout.tp)
    if kernel in ("sdpa_grouped", "ring") and layout.ulysses == 1:  # k and v views: the QKV output whole
        if config.position_embedding_type == "rope":
            return width * (a + 2 * g) * d + width * (a + g) * d  # beside RoPE's rotated q and k
        return width * (a + 2 * g) * d + (0 if q_is_view else width * a * d)
    kept_as_given = recompute == "selective" or kernel == "sdpa" or (kernel == "local" and g == a)
    if not (q_is_view and kept_as_given):
        return 3 * width * a * d
    rotated = 2 * width * a * d if config.position_embedding_type == "rope" else 0
    return width * (a + 2 * g) * d + rotated


def attention_term(config, s, kernel, width=2):
    """What core attention keeps beyond q, k, v and its output, per token before the split over t: the local
    path's softmax output (and with attention dropout its 1-byte mask and output) over s keys per head; a
    flash kernel's fp32 log-sum-exp per head; CP's ring (or all-gather) that and its merged output, fp32, beside
    the 16-bit copy it returns."""
    a = config.num_attention_heads
    if kernel == "local":
        return a * s * (2 * width + 1 if config.attention_dropout > 0 else width)
    if kernel == "ring":
        return 4 * a * (1 + context_head_dims(config)[1])
    return 4 * a


def _rotary_angle_bytes(model, layout):
    """RoPE's fp32 cos and sin, [s/U, rotary_dim] each, made anew by every layer for each micro-batch."""
    if model.config.position_embedding_type != "rope":
        return 0.0
    return 2 * 4 * layout.tokens_per_rank(model.seq_length, split_over_tp=False) * model.config.rotary_dim


def in_flight_micro_batches(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a stage holds at its peak (1F1B: min(p - stage, m); the other schedules
    as planning/pipeline.py simulates them)."""
    return pipeline.in_flight_micro_batches(layout, stage)


def _first_stage_extra_bytes(model, layout):
    """The embedding dropout's 1-byte mask."""
    if model.config.hidden_dropout == 0:
        return 0.0
    return layout.tokens_per_rank(model.seq_length) * layout.micro_batch_size * model.config.hidden_size


def _last_stage_extra_bytes(model, layout):
    """The final norm and the head (for the main model and each multi-token prediction depth: the head takes
    them side by side), and the MTP modules."""
    s, b, h, t = model.seq_length, layout.micro_batch_size, model.config.hidden_size, layout.tp
    width, heads = _activation_width(model), 1 + model.config.mtp_num_layers
    norm_and_head_inputs = 2 * width * layout.tokens_per_rank(s) * b * h * heads
    tokens, vocab = layout.tokens_per_rank(s, split_over_tp=False) * b, model.padded_vocab_size(t) // t
    logits = 3 * width * tokens * vocab * heads
    chunk_temporaries = 2 * 4 * min(tokens * heads, default_chunk_rows(vocab)) * vocab
    return norm_and_head_inputs + logits + chunk_temporaries + _mtp_module_bytes(model, layout)


def _mtp_module_bytes(model, layout):
    """Per micro-batch, each multi-token prediction depth keeps its layer's activations (of the last layer's
    kind; under full recompute its input alone, the layer being its own chunk) and about 9 s b h more: the
    embeddings of the tokens ahead, the two norms' inputs and outputs, their concatenation (2h), the
    projection's output gathered over TP and the final norm's input."""
    config = model.config
    if not config.mtp_num_layers:
        return 0.0
    if layout.recompute == "full":
        layer = _saved_layer_input_bytes(model, layout)
    else:
        layer = _kind_activation_bytes(model, layout, layout.recompute, _layer_kind(config, config.num_layers + 1))
    tokens = layout.tokens_per_rank(model.seq_length, split_over_tp=False) * layout.micro_batch_size
    return config.mtp_num_layers * (layer + 9 * _activation_width(model) * tokens * config.hidden_size)


def _saved_layer_input_bytes(model, layout):
    """Full recompute keeps only a layer's (or chunk's) input: 2 s b h, split over TP with SP or
    --distribute-saved-activations (and over U with Ulysses)."""
    split = layout.sequence_parallel or layout.distribute_saved_activations
    tokens = layout.tokens_per_rank(model.seq_length, split_over_tp=split)
    return _activation_width(model) * tokens * layout.micro_batch_size * model.config.hidden_size


def _stage_layer_kinds(config, num_layers, first_layer):
    """_layer_kind of each of the stage's `num_layers` layers from `first_layer` (global, 1-based), in order."""
    return [_layer_kind(config, n) for n in range(first_layer, first_layer + num_layers)]


def _layer_activations_per_micro_batch(model, layout, kinds):
    """(bytes kept per micro-batch in flight, bytes of the one chunk being recomputed in backward) of the stage's
    layers, of the kinds `kinds` in order (_stage_layer_kinds; MoE layers among them)."""
    num_layers = len(kinds)
    if layout.recompute != "full":
        per_layer = {e: _kind_activation_bytes(model, layout, layout.recompute, e) for e in set(kinds)}
        return sum(per_layer[e] for e in kinds), 0.0
    whole = {e: _kind_activation_bytes(model, layout, None, e) for e in set(kinds)}
    if layout.recompute_method == "uniform":
        chunk = layout.recompute_num_layers
        chunks = [kinds[i:i + chunk] for i in range(0, num_layers, chunk)]
        return (len(chunks) * _saved_layer_input_bytes(model, layout),
                max((sum(whole[e] for e in layers) for layers in chunks), default=0.0))
    recomputed = layout.recomputed_layers(num_layers)
    kept = recomputed * _saved_layer_input_bytes(model, layout) + sum(whole[e] for e in kinds[recomputed:])
    return kept, max(whole[e] for e in kinds[:recomputed]) if recomputed else 0.0


def _layer_kind(config, layer_number):
    """(DeepSpeed-MoE experts, whether a dropless MoE layer, whether in FP8) of layer `layer_number`: what its
    activations depend on."""
    return (config.experts_in_layer(layer_number), config.dropless_moe_in_layer(layer_number),
            config.fp8_in_layer(layer_number))


def _kind_activation_bytes(model, layout, recompute, kind):
    experts, dropless, fp8 = kind
    return layer_activation_bytes(model, layout, recompute, experts, dropless=dropless, fp8=fp8)


def _pipeline_buffer_bytes(model, layout, stage, in_flight):
    """DeepSpeed's PipelineEngine (1F1B, ZB-H1) keeps, on a stage that sends activations, each in-flight
    micro-batch's output as sent (1/t of it where it splits messages over TP, the rest of the tensor freed) and
    one received gradient; without the split a receiving stage also keeps each received input beside the clone
    its forward runs on. DualPipeVEngine (dualpipev, interleaved) as _chunked_pipeline_buffer_bytes."""
    if layout.pp == 1:
        return 0.0
    whole = (_activation_width(model) * layout.tokens_per_rank(model.seq_length) * layout.micro_batch_size
             * model.config.hidden_size)
    if layout.pipeline_schedule not in ("1f1b", "zbh1"):
        return _chunked_pipeline_buffer_bytes(layout, stage, in_flight, whole)
    split = messages_split_over_tensor_parallel(layout.pipeline_schedule, layout.sequence_parallel)
    message = whole / layout.tp if split else whole
    kept = (in_flight + 1) * message if stage != pipeline.head_rank(layout) else 0.0
    return kept + (in_flight * whole if stage != 0 and not split else 0.0)


def _chunked_pipeline_buffer_bytes(layout, stage, in_flight, message):
    """DualPipeVEngine keeps, for each chunk's micro-batch in flight, the input it received (beside the clone its
    forward runs on) and the output it sent, both whole, until that micro-batch's backward; the model's first
    stage receives nothing, its last (the loss) sends nothing, and on DualPipeV's last rank the V turns around in
    place (its second chunk's input is its first chunk's output). The chunks in flight as spread evenly over the
    rank's chunks."""
    schedule, chunks = layout.pipeline_schedule, chunks_per_rank(layout.pipeline_schedule, layout.virtual_stages)
    last_stage = chunks * layout.pp - 1
    kept = 0
    for chunk in range(chunks):
        model_stage_of_chunk = model_stage(schedule, layout.pp, stage, chunk)
        turns_around = schedule == "dualpipev" and model_stage_of_chunk == layout.pp
        kept += (model_stage_of_chunk > 0 and not turns_around) + (model_stage_of_chunk < last_stage)
    return in_flight * kept * message


def _backward_working_set_bytes(model, layout, kinds):
    """The gradients alive while a layer of the stage runs its MLP's backward, beside everything kept: two of the
    hidden state's (the one arriving and the one being made) and the largest of its layers' kinds (`kinds`, as
    _layer_kind gives them): a dense MLP's fc1 output gradient (2F wide with SwiGLU, / t), a dropless MoE layer's
    rows' gradient (k h per routed token: its combine's backward makes that alone); or, where larger, CP's attention
    backward (context_backward_working_set_bytes)."""
    config, s, b, width = model.config, model.seq_length, layout.micro_batch_size, _activation_width(model)
    hidden = 2 * layout.tokens_per_rank(s) * config.hidden_size * b
    fc1_width = config.ffn_hidden_size * (2 if config.gated_linear_unit else 1)
    fc1 = layout.tokens_per_rank(s, split_over_tp=False) * b * fc1_width / layout.tp
    rows = dropless_routed_tokens(model, layout) * config.moe_router_topk * config.hidden_size
    widest = max((rows if dropless else fc1 for _, dropless, _ in kinds), default=fc1)
    quantisation = fp8_quantisation_bytes(model, layout) if any(fp8 for _, _, fp8 in kinds) else 0.0
    return max(width * widest, context_backward_working_set_bytes(model, layout)) + width * hidden + quantisation


# fp8.quantize's fp32 temporaries of one operand alive at once: its fp32 copy, the scaled product and its clamp
FP8_QUANTISATION_BYTES_PER_ELEMENT = 12


def fp8_quantisation_bytes(model: ModelSpec, layout: Layout) -> float:
    """The transient of quantising the largest operand of a layer's FP8 GEMMs (estimated, held to the dry run): 12
    bytes per element of fc1's weight shard (forward) or of its output gradient (backward), whole tokens."""
    config = model.config
    fc1_width = config.ffn_hidden_size * (2 if config.gated_linear_unit else 1) / layout.tp
    tokens = layout.tokens_per_rank(model.seq_length, split_over_tp=False) * layout.micro_batch_size
    return FP8_QUANTISATION_BYTES_PER_ELEMENT * fc1_width * max(config.hidden_size, tokens)


def context_backward_working_set_bytes(model: ModelSpec, layout: Layout) -> float:
    """CP's attention backward, beside everything kept: dQ of the rank's queries in fp32 and the key/value blocks
    with their fp32 dK and dV (K the bytes of one block, G of its gradients): the ring holds the block in hand and
    the one in flight, and the gradients being added to and those in flight, 2 (K + G); allgather the whole
    sequence's, CP (K + G). 0 without CP."""
    if layout.context == 1:
        return 0.0
    config = model.config
    queries = 4 * layout.tokens_per_rank(model.seq_length, split_over_tp=False) * layout.micro_batch_size \
        * config.num_attention_heads * context_head_dims(config)[0] / layout.tp
    traffic = context_traffic_per_layer(model, layout)
    blocks = 2 if layout.cp_comm_type == "p2p" else layout.context
    return queries + blocks * (traffic.block + traffic.gradient_block)


def stage_activation_bytes(model: ModelSpec, layout: Layout, stage: int, num_layers: int,
                           first_layer: int = 1) -> float:
    in_flight = in_flight_micro_batches(layout, stage)
    kinds = _stage_layer_kinds(model.config, num_layers, first_layer)
    kept, recompute_working_set = _layer_activations_per_micro_batch(model, layout, kinds)
    total = (in_flight * kept + recompute_working_set + _backward_working_set_bytes(model, layout, set(kinds))
             + _pipeline_buffer_bytes(model, layout, stage, in_flight))
    if stage == 0:
        total += in_flight * _first_stage_extra_bytes(model, layout)
    if stage == pipeline.head_rank(layout):
        total += _last_stage_extra_bytes(model, layout)
    return total


def teacher_bytes(model: ModelSpec, layout: Layout, stage_params: StageParameters) -> float:
    """--kd: what the frozen teacher adds to a device of the stage (the module docstring)."""
    if model.teacher is None:
        return 0.0
    width = _activation_width(model)
    weights = width * teacher_parameters(model, stage_params, layout.tp, layout.pp)
    in_flight = in_flight_micro_batches(layout, stage_params.stage)
    message = (width * layout.tokens_per_rank(model.seq_length) * layout.micro_batch_size
               * model.teacher.config.hidden_size)
    last = stage_params.stage == pipeline.head_rank(layout)
    sends, receives = layout.pp > 1 and not last, stage_params.stage > 0
    carried = in_flight * message * (int(sends) + int(receives))  # each micro-batch's output kept, input received
    logits = 0.0
    if last:
        tokens = layout.tokens_per_rank(model.seq_length, split_over_tp=False) * layout.micro_batch_size
        vocab = model.padded_vocab_size(layout.tp) // layout.tp
        logits = width * tokens * vocab + 4 * 4 * min(tokens, default_chunk_rows(vocab)) * vocab
    return weights + carried + logits


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
    expert_gradient_reduction: float = 0.0  # alive at the step, when the activations are gone
    # False where every micro-batch's forward runs before the first backward (one micro-batch; 1F1B with m at most
    # p - stage): no gradient exists at the activation peak
    gradients_before_activation_peak: bool = True
    teacher: float = 0.0  # --kd: the frozen teacher's weights, carried hidden states and logits (teacher_bytes)
    buffers: float = 0.0  # fp32 buffers beside the parameters: the dropless MoE layers' expert bias and counts

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.grad_accumulation + self.optimizer

    @property
    def total(self) -> float:
        """The model states and the larger of the activation peak and the step's reduction copy. Where every
        forward runs before the first backward, the gradients are made by that backward as its micro-batch's
        activations (1/n of those of the n in flight) are freed: they count beside the other n - 1 micro-batches'
        activations, or the copy."""
        if self.gradients_before_activation_peak:
            peak = self.gradients + max(self.activations, self.expert_gradient_reduction)
        else:
            others = self.activations * (self.in_flight_micro_batches - 1) / self.in_flight_micro_batches
            peak = max(self.activations, self.gradients + max(others, self.expert_gradient_reduction))
        return (self.weights + self.grad_accumulation + self.optimizer + self.buffers + peak + self.teacher
                + self.overhead)


def stage_state_bytes(model: ModelSpec, layout: Layout, stage_params: StageParameters) -> StateBytes:
    """Bytes of each model state one device of the stage holds: the non-expert parameters sharded over U x DP,
    the experts over the expert-data-parallel group (TP x DP / EP)."""
    state = state_bytes_per_parameter(model.precision, layout.zero_stage)
    dense = sharded_state_bytes(state, layout.zero_stage, layout.sequence_data_parallel)
    experts = sharded_state_bytes(state, layout.zero_stage, expert_data_parallel_size(model, layout))
    n, e = stage_params.non_expert, stage_params.experts
    return StateBytes(*(n * a + e * b for a, b in zip(dataclasses.astuple(dense), dataclasses.astuple(experts))))


# DeepSpeed's engine (allreduce_no_retain) reduces gradients in flat copies of up to this many elements
ENGINE_REDUCTION_BUCKET_ELEMENTS = 500_000_000


def expert_gradient_reduction_bytes(model: ModelSpec, layout: Layout, stage_params: StageParameters) -> float:
    """With bf16 and ZeRO-1 (DeepSpeed's BF16_Optimizer) the engine all-reduces the experts' fp32 gradients over
    their expert-data-parallel group as flat copies of up to 500M elements (the rest in place, in the
    optimizer's flat buffer). Other optimizers reduce experts in their own buckets, not counted here."""
    if not stage_params.experts or model.precision != "bf16" or layout.zero_stage != 1:
        return 0.0
    return 4.0 * min(stage_params.experts, ENGINE_REDUCTION_BUCKET_ELEMENTS)


def stage_memory(model: ModelSpec, layout: Layout, stage_params: StageParameters) -> StageMemory:
    states = stage_state_bytes(model, layout, stage_params)
    return StageMemory(stage=stage_params.stage, parameters=stage_params.total,
                       in_flight_micro_batches=in_flight_micro_batches(layout, stage_params.stage),
                       weights=states.weights, gradients=states.gradients,
                       grad_accumulation=states.grad_accumulation, optimizer=states.optimizer,
                       activations=stage_activation_bytes(model, layout, stage_params.stage,
                                                          stage_params.num_layers, stage_params.first_layer),
                       overhead=RUNTIME_OVERHEAD_BYTES,
                       expert_gradient_reduction=expert_gradient_reduction_bytes(model, layout, stage_params),
                       gradients_before_activation_peak=layout.num_micro_batches > in_flight_micro_batches(
                           layout, stage_params.stage),
                       teacher=teacher_bytes(model, layout, stage_params), buffers=4.0 * stage_params.buffers)


def memory_per_stage(model: ModelSpec, layout: Layout, stages: List[StageParameters]) -> List[StageMemory]:
    return [stage_memory(model, layout, stage) for stage in stages]
