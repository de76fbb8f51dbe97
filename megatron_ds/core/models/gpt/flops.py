"""The model's FLOPs: the one formula that MFU in training and tools/plan.py both use.

Forward FLOPs per token: each layer 2 x (QKV + projection + MLP weights) for its GEMMs and 4 s a d for
QK^T and attention x V (no causal halving, Megatron's convention); the head 2 h V. Training = 3 x forward
(no recompute). For a GPT-2 shape this is Megatron's 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (Narayanan et
al. 2021, arXiv 2104.04473; see docs/formulas.md).

Mixture of Experts (DeepSpeed-MoE; config.experts_in_layer says which layers): a token of an MoE layer runs
the router and its top-k experts, each an MLP of the dense MLP's shape, so the MLP's 2 x MLP weights become
    2 h E (router) + k x 2 x MLP weights (+ 2 x MLP weights + 2 x 2h for PR-MoE's residual MLP and its
    Linear(h, 2) coefficient)
i.e. the FLOPs of the active parameters. An MoE layer with top-k (without residual) costs what a dense layer
with a k times wider FFN does, plus 2 h E. Not counted (as in Megatron-DeepSpeed): the gate's softmax and
top-k, dispatch and combine, and the padding of the experts' capacity buffers (capacity factor > 1).
The dropless MoE layer (Megatron-Core's flags; config.dropless_moe_in_layer): the router 2 h E, k experts of
moe_ffn_hidden_size (gated), the shared expert of its own width and its gate 2 h.
A dense model (num_experts 1) gets exactly the formula above.

Multi-latent attention (config.multi_latent_attention; Megatron-LM's num_floating_point_operations less its norm
terms, which no other layer here counts either): the weight GEMMs 2 x (query: h a dq, or with a query latent
h q_r + q_r a dq; key-value down h (kv_r + r); key-value up kv_r a (qk + v); projection a v h), dq = qk + r, and
QK^T and attention x V 2 s a (dq + v) in place of 4 s a d.

Multi-token prediction (config.mtp_num_layers D; as Megatron-LM counts it): each depth's projection 2 x 2h h, its
layer (of the last layer's kind) and the output head again: D x (4 h^2 + layer + 2 h V) per token.
"""
from dataclasses import dataclass
from typing import Tuple


def mlp_flops_per_token(config) -> float:
    """One MLP's forward GEMMs (the dense MLP, or one expert): 2 x (fc1 + fc2 weights), fc1 doubled by SwiGLU."""
    return 2 * config.hidden_size * config.ffn_hidden_size * (3 if config.gated_linear_unit else 2)


def moe_mlp_flops_per_token(config, num_experts) -> float:
    """An MoE layer's MLP part per token: router 2hE, top-k experts, PR-MoE's residual MLP and coefficient."""
    h = config.hidden_size
    residual = mlp_flops_per_token(config) + 2 * h * 2 if config.moe_residual else 0
    return 2 * h * num_experts + config.moe_router_topk * mlp_flops_per_token(config) + residual


def dropless_moe_flops_per_token(config) -> float:
    """A dropless MoE layer's MLP part per token: router, top-k routed experts, the shared expert and its gate."""
    h = config.hidden_size
    routed = config.moe_router_topk * 2 * h * config.moe_ffn_hidden_size * 3
    shared = 2 * h * (config.moe_shared_expert_intermediate_size or 0) * 3
    return 2 * h * config.num_moe_experts + routed + shared + (2 * h if config.moe_shared_expert_gate else 0)


def attention_gemm_flops_per_token(config) -> float:
    """The attention's weight GEMMs per token: QKV and projection, or multi-latent attention's projections."""
    h, d, heads = config.hidden_size, config.kv_channels, config.num_attention_heads
    if not config.multi_latent_attention:
        return 2 * (h * (heads + 2 * config.num_query_groups) * d + heads * d * h)
    query_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
    q_rank = config.q_lora_rank
    query = h * heads * query_dim if q_rank is None else h * q_rank + q_rank * heads * query_dim
    key_value = h * (config.kv_lora_rank + config.qk_pos_emb_head_dim) + \
        config.kv_lora_rank * heads * (config.qk_head_dim + config.v_head_dim)
    return 2 * (query + key_value + heads * config.v_head_dim * h)


def attention_score_flops_per_token(config, seq_length) -> float:
    """QK^T and attention x V per token: 2 s a (d + d) (MLA: the query's head dim and the value's)."""
    if config.multi_latent_attention:
        head_dims = config.qk_head_dim + config.qk_pos_emb_head_dim + config.v_head_dim
    else:
        head_dims = 2 * config.kv_channels
    return 2 * seq_length * config.num_attention_heads * head_dims


def layer_gemm_flops_per_token(config, layer_number) -> float:
    """Weight GEMMs of layer `layer_number` (1-based, global) per token: attention plus the dense MLP, or an
    MoE layer's router, top-k experts and residual."""
    attention = attention_gemm_flops_per_token(config)
    if config.dropless_moe_in_layer(layer_number):
        return attention + dropless_moe_flops_per_token(config)
    experts = config.experts_in_layer(layer_number)
    return attention + (mlp_flops_per_token(config) if experts == 1 else moe_mlp_flops_per_token(config, experts))


@dataclass(frozen=True)
class ForwardFlopsPerToken:
    layers_gemms: Tuple[float, ...]   # each layer's weight GEMMs, layer 1 first (MoE layers differ)
    attention_scores: float           # one layer's QK^T and attention x V (the same in every layer)
    head: float                       # the output head
    mtp: float = 0.0                  # the multi-token prediction modules, their heads included
    mtp_layers_gemms: Tuple[float, ...] = ()  # each multi-token prediction module's transformer layer's

    def layer(self, layer_number) -> float:
        """Forward FLOPs per token of layer `layer_number` (1-based, global)."""
        return self.layers_gemms[layer_number - 1] + self.attention_scores

    def layers(self, first=1, count=None) -> float:
        """Of `count` consecutive layers from `first` (default: all of them)."""
        count = len(self.layers_gemms) - first + 1 if count is None else count
        return sum(self.layers_gemms[first - 1:first - 1 + count]) + count * self.attention_scores

    @property
    def total(self) -> float:
        """The whole model: every layer, the head and the MTP modules."""
        return self.layers() + self.head + self.mtp


def forward_flops_per_token(config, seq_length, vocab_size) -> ForwardFlopsPerToken:
    """config: a TransformerConfig; vocab_size: the rows of the output head (padded)."""
    head = 2 * config.hidden_size * vocab_size
    scores = attention_score_flops_per_token(config, seq_length)
    mtp_layers = tuple(layer_gemm_flops_per_token(config, config.num_layers + depth)
                       for depth in range(1, config.mtp_num_layers + 1))
    mtp = sum(2 * 2 * config.hidden_size ** 2 + layer + scores + head for layer in mtp_layers)
    return ForwardFlopsPerToken(
        layers_gemms=tuple(layer_gemm_flops_per_token(config, n) for n in range(1, config.num_layers + 1)),
        attention_scores=scores, head=head, mtp=mtp, mtp_layers_gemms=mtp_layers)


def model_flops_per_iteration(config, vocab_size, global_batch_size, seq_length):
    """Model FLOPs of one training iteration (forward + backward = 3 x forward; recompute not counted)."""
    return 3 * forward_flops_per_token(config, seq_length, vocab_size).total * global_batch_size * seq_length
