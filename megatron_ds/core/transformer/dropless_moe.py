"""Dropless Mixture of Experts, as Megatron-Core builds it for DeepSeek-V3, Qwen3 and Mixtral, on DeepSpeed's
expert-parallel components.

- DeepSpeed's TokenChoiceTopKRouter chooses each token's top-k experts: softmax or sigmoid scores in fp32, the
  choice optionally limited to the best expert groups, the expert bias (auxiliary-loss-free balancing) added for
  the choice only, the chosen scores normalised and scaled.
- Every chosen (token, expert) pair reaches its expert, none dropped (unless --moe-expert-capacity-factor gives
  each expert a capacity: Megatron-Core's token dropping, over this rank's pairs before the dispatch). The
  alltoall dispatcher sorts the pairs by expert and exchanges the per-expert counts over the expert-parallel group
  first, then the tokens (an all-to-all with those splits); DeepSpeed's GroupedExperts runs this rank's experts
  (torch._grouped_mm with --moe-grouped-gemm, else one GEMM per expert); the outputs return the same way, are
  weighted by the routing scores and summed per token. The allgather dispatcher gathers the group's tokens and
  their routing on every rank of the group, runs this rank's experts on the pairs routed to them, and
  reduce-scatters the weighted sums back to the tokens' ranks.
- Under TP the layer's tokens are split over the TP ranks (Megatron's sequence parallelism already splits them;
  without it this layer splits and gathers them). Expert TP 1: the experts are whole on their rank and the
  expert-parallel group may span TP and data-parallel ranks. Expert TP = TP (Megatron-Core's parallel folding,
  ETP x EP x EDP over the TP x DP ranks): each TP rank holds a slice of F of the same experts (w1 and w3 split
  along their rows, w2 along its columns), the expert-parallel group is made of ranks of one TP rank; after the
  all-to-all the received rows are gathered over the TP group, the experts' slices compute partial outputs, and
  these are reduce-scattered back to the rows' TP ranks before the all-to-all back.
- Shared experts: a dense MLP beside the routed experts, its output optionally scaled by a sigmoid gate
  (Qwen2-MoE's), added.
- The balance losses as Megatron-Core defines them (aux_loss: Switch Transformer's over the micro-batch;
  seq_aux_loss: per sequence, DeepSeek-V3's; global_aux_loss: over the global batch) and the z-loss reach the
  router's gradient through AuxiliaryLossGradient, the same way as DeepSpeed-MoE's auxiliary loss.
"""
import math
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.ep_experts import (
    EXPERT_ACTIVATIONS,
    GroupedExperts,
    apply_expert_activation,
    register_expert_activation,
)
from deepspeed.moe.ep_router import TokenChoiceTopKRouter
from deepspeed.ops.triton_ops.swiglu_triton import swiglu as swiglu_triton

from megatron_ds.core import parallel_state
from megatron_ds.core.fusions.fused_swiglu import swiglu_of_halves_reference
from megatron_ds.core.tensor_parallel.fp8 import fp8_grouped_linear
from megatron_ds.core.tensor_parallel.fp8_delayed import DelayedScaling
from megatron_ds.core.tensor_parallel.layers import fp8_recipe_of, mark_sequence_parallel_parameter
from megatron_ds.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_ds.core.tensor_parallel.random import init_method_normal, set_init_method
from megatron_ds.core.transformer.mlp import MLP
from megatron_ds.core.transformer.moe import AuxiliaryLossGradient
from megatron_ds.core.transformer.transformer_config import moe_group_score_function


class Router(TokenChoiceTopKRouter):
    """DeepSpeed's router with Megatron-Core's options; forward(x [T, h], expert_bias) -> (weights [T, k] fp32,
    experts [T, k], tokens per expert [E], logits [T, E] fp32)."""

    def __init__(self, config):
        softmax = config.moe_router_score_function == "softmax"
        groups = config.moe_router_num_groups
        super().__init__(config.hidden_size, config.num_moe_experts, groups,
                         config.moe_router_group_topk if groups else None, config.moe_router_topk,
                         config.moe_router_score_function,
                         # Megatron-Core: softmax over the chosen logits (unless --moe-router-pre-softmax), which
                         # is the softmax over all of them normalised; sigmoid scores normalised when k > 1
                         route_norm=not config.moe_router_pre_softmax if softmax else config.moe_router_topk > 1,
                         route_scale=config.moe_router_topk_scaling_factor or 1.0, gate_bias=False,
                         group_score_func=moe_group_score_function(config.moe_router_topk,
                                                                   config.moe_router_group_topk or 1) or "max")
        self.gate.weight.data = self.gate.weight.data.to(config.params_dtype)
        set_init_method(self.gate.weight, init_method_normal(config.init_method_std))
        self._logits = None
        self.gate.register_forward_hook(self._keep_logits)

    def _keep_logits(self, module, inputs, output):
        self._logits = output

    def forward(self, x, expert_bias=None):
        weights, experts, counts = super().forward(x, expert_bias)
        logits, self._logits = self._logits.float(), None
        return weights, experts, counts, logits


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _exchange(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def _exchange(rows, output_splits, input_splits, group):
    received = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), output_splits, input_splits, group=group)
    return received


def _expert_major_order(counts_by_source):
    """Row order that turns rows grouped by (source rank, expert) into rows grouped by (expert, source rank)."""
    sources, experts = counts_by_source.shape
    sizes = counts_by_source.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    chunks = torch.arange(sources * experts).view(sources, experts).t().reshape(-1)
    chunk_sizes = sizes[chunks]
    first_of_chunk = torch.cumsum(chunk_sizes, 0) - chunk_sizes
    within = torch.arange(int(sizes.sum())) - first_of_chunk.repeat_interleave(chunk_sizes)
    return starts[chunks].repeat_interleave(chunk_sizes) + within


def _rows(tensor, index):
    """tensor's rows at index. index_select, not tensor[index]: on CPUs indexing's forward kernel is the slower one
    (bench/RESULTS.md, 2026-12-07), and its backward an index_put_ where index_select's is an index_add_."""
    return tensor.index_select(0, index)


class AllToAllDispatcher:
    """Sends each (token, expert) row to the rank holding the expert and brings the expert's output back.
    group None: expert parallelism 1, every expert here. drops: whether pairs may be dropped (a capacity)."""

    def __init__(self, num_experts, group, drops=False, tensor_group=None):
        self.group = group
        self.num_experts = num_experts
        self.ranks = _group_size(group)
        self.local_experts = num_experts // self.ranks
        self.drops = drops
        self.tensor_group = tensor_group  # expert TP: the ranks holding the other F slices of this rank's experts

    def combine(self, tokens, weights, destinations, experts):
        """tokens [T, h], weights and destinations [T, k] (a destination outside the experts: a dropped pair) ->
        [T, h]: each token's expert outputs, weighted and summed."""
        return weighted_expert_sums(tokens, weights, destinations, self.num_experts,
                                    lambda tokens, token_of_row, counts: self.run(tokens, token_of_row, counts,
                                                                                  experts),
                                    every_pair=not self.drops)

    # tools/dry_run.py sets this: its fake tensors hold no counts, so each rank's rows are taken as routed
    # uniformly (uniform_counts) and every rank as receiving the counts it sends (its fake process group moves none)
    uniform_routing = False

    def run(self, tokens, token_of_row, counts, experts):
        """The rows tokens[token_of_row] [N, h], sorted by global expert, counts [E]: experts(rows of this rank's
        experts, their counts) for every row, in the same order. Each N x h or R x h tensor is let go as soon as
        the next is made (the forward, recomputed in backward under full recompute, would hold six at once)."""
        if self.uniform_routing:
            counts = uniform_counts(token_of_row.shape[0], self.num_experts, token_of_row.device)
        if self.tensor_group is not None:
            experts = self._on_expert_slices(experts)
        if self.ranks == 1:
            return experts(_rows(tokens, token_of_row), counts)
        counts_by_rank = counts.view(self.ranks, self.local_experts)
        received_counts = torch.empty_like(counts_by_rank)
        dist.all_to_all_single(received_counts, counts_by_rank, group=self.group)  # [source, local expert]
        if self.uniform_routing:
            received_counts.copy_(counts_by_rank[dist.get_rank(self.group)].expand_as(received_counts))
        send_splits = counts_by_rank.sum(1).tolist()
        receive_splits = received_counts.sum(1).tolist()
        received = _AllToAll.apply(_rows(tokens, token_of_row), receive_splits, send_splits, self.group)
        order = _expert_major_order(received_counts.cpu()).to(received.device)
        computed = experts(_rows(received, order), received_counts.sum(0))
        del received
        return _AllToAll.apply(_rows(computed, torch.argsort(order)), send_splits, receive_splits, self.group)

    def _on_expert_slices(self, experts):
        """experts(rows sorted by local expert, counts) on this rank's F slices: the rows of every rank of the
        expert-TP group gathered (each rank's sorted by local expert), the partial outputs summed back to the
        ranks whose rows they are."""
        def compute(rows, counts):
            counts_by_rank = _all_gathered(counts.unsqueeze(0), self.tensor_group)  # [expert-TP rank, local expert]
            if self.uniform_routing:
                counts_by_rank.copy_(counts.expand_as(counts_by_rank))
            sizes = counts_by_rank.sum(1).tolist()
            gathered = _RowsOverGroup.apply(rows, sizes, self.tensor_group, _rows_gathered, _rows_summed_to_their_rank)
            order = _expert_major_order(counts_by_rank.cpu()).to(rows.device)
            computed = experts(_rows(gathered, order), counts_by_rank.sum(0))
            del gathered
            return _RowsOverGroup.apply(_rows(computed, torch.argsort(order)), sizes, self.tensor_group,
                                        _rows_summed_to_their_rank, _rows_gathered)
        return compute


class _RowsOverGroup(torch.autograd.Function):
    """apply(rows, sizes, group, op, conjugate): op(rows, sizes, group) forward, conjugate(grad, sizes, group)
    backward; the pair _rows_gathered and _rows_summed_to_their_rank, each the other's conjugate."""

    @staticmethod
    def forward(ctx, rows, sizes, group, op, conjugate):
        ctx.sizes, ctx.group, ctx.conjugate = sizes, group, conjugate
        return op(rows, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.conjugate(grad, ctx.sizes, ctx.group), None, None, None, None


def _rows_gathered(rows, sizes, group):
    """Every rank's rows (rank r's sizes[r] of them) concatenated in rank order."""
    # an all-to-all with uneven splits, each rank sending its rows to every rank (no padding to the longest)
    copies = rows.repeat(len(sizes), *[1] * (rows.dim() - 1))
    return _exchange(copies, sizes, [rows.shape[0]] * len(sizes), group)


def _rows_summed_to_their_rank(rows, sizes, group):
    """rows: every rank's sizes[r] rows in rank order -> this rank's rows, summed over the group."""
    mine = sizes[dist.get_rank(group)]
    received = _exchange(rows, [mine] * len(sizes), sizes, group)
    return received.view(len(sizes), mine, *rows.shape[1:]).sum(0)


def uniform_counts(rows, experts, device):
    """[experts] int64: `rows` spread evenly, rows // experts each and one more for the first rows % experts."""
    extra = torch.arange(experts, dtype=torch.int64, device=device) < rows % experts
    return torch.full((experts,), rows // experts, dtype=torch.int64, device=device) + extra


class AllGatherDispatcher:
    """Megatron-Core's allgather dispatcher: every rank of the expert-parallel group gathers the group's tokens with
    their routing, runs its experts on the pairs routed to them, and the weighted sums are reduce-scattered back,
    each rank receiving its own tokens'. The ranks of a group route equally many tokens (one micro-batch shape).
    group None: expert parallelism 1, every expert here. drops: whether pairs may be dropped (a capacity)."""

    def __init__(self, num_experts, group, drops=False):
        self.group = group
        self.ranks = _group_size(group)
        self.local_experts = num_experts // self.ranks
        self.first_expert = (dist.get_rank(group) if group is not None else 0) * self.local_experts
        self.drops = drops

    def combine(self, tokens, weights, destinations, experts):
        """As AllToAllDispatcher.combine."""
        if self.ranks == 1:
            return weighted_expert_sums(tokens, weights, destinations, self.local_experts, _on_rows(experts),
                                        every_pair=not self.drops)
        group_tokens = _GatherFromGroup.apply(tokens, self.group)
        group_weights = _GatherFromGroup.apply(weights, self.group)
        local_destinations = _all_gathered(destinations, self.group) - self.first_expert
        sums = weighted_expert_sums(group_tokens, group_weights, local_destinations, self.local_experts,
                                    _on_rows(experts))
        return _ReduceScatterToGroup.apply(sums, self.group)


def _on_rows(experts):
    return lambda tokens, token_of_row, counts: experts(_rows(tokens, token_of_row), counts)


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


def weighted_expert_sums(tokens, weights, destinations, experts, compute, every_pair=False):
    """tokens [T, h]; weights, destinations [T, k]: each token's sum of weight x output over its pairs whose
    destination is one of `experts` (0 .. experts - 1; any other adds nothing). compute(tokens, token_of_row [N],
    counts [experts]) gives the outputs of the rows tokens[token_of_row], sorted by destination, in that order.
    every_pair: every destination is one of `experts`, so none is left out (and no host sync counts them)."""
    keys = destinations.reshape(-1)
    if not every_pair:
        keys = torch.where((keys >= 0) & (keys < experts), keys, experts)
    counts = expert_counts(keys, experts + 1)[:experts]
    order = torch.argsort(keys, stable=True)
    if not every_pair:
        order = order[:int(counts.sum())]  # the pairs of no expert here sort last
    token_of_row = order // destinations.shape[1]
    outputs = compute(tokens, token_of_row, counts)
    return _WeightedSumOfRows.apply(outputs, _rows(weights.reshape(-1), order), token_of_row, tokens.shape[0])


class _WeightedSumOfRows(torch.autograd.Function):
    """rows [N, h], weights [N], token_of_row [N] -> [tokens, h]: each token's sum of its rows times their weights.
    Autograd's mul and index_add would make three N x h gradients at once in backward (the rows' gradient, the
    weighted one, and the product summed into the weights' gradient); this makes one, the rows' gradient, and
    takes the weights' gradient as a row-by-row dot product."""

    @staticmethod
    def forward(ctx, rows, weights, token_of_row, tokens):
        ctx.save_for_backward(rows, weights, token_of_row)
        weighted = rows * weights.unsqueeze(-1).to(rows.dtype)
        return rows.new_zeros((tokens, rows.shape[-1])).index_add_(0, token_of_row, weighted)

    @staticmethod
    def backward(ctx, grad):
        rows, weights, token_of_row = ctx.saved_tensors
        rows_grad = grad.index_select(0, token_of_row)
        weights_grad = None
        if ctx.needs_input_grad[1]:
            dots = torch.bmm(rows_grad.unsqueeze(1), rows.unsqueeze(-1)).view(-1)
            weights_grad = dots.to(weights.dtype)
        return rows_grad.mul_(weights.unsqueeze(-1).to(rows_grad.dtype)), weights_grad, None, None


def expert_counts(destinations, experts):
    """[experts] int64: how many of destinations (each in 0 .. experts - 1) go to each (no host sync)."""
    flat = destinations.reshape(-1)
    return torch.zeros(experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


class _GatherFromGroup(torch.autograd.Function):
    """The group's tensors (equal shapes) concatenated along dim 0 in rank order; backward: the gradient of this
    rank's slice, summed over the group."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _all_gathered(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scattered(grad, ctx.group), None


class _ReduceScatterToGroup(torch.autograd.Function):
    """The sum over the group of each rank's slice for this rank (dim 0 split evenly in rank order); backward: the
    gradients gathered."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _reduce_scattered(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gathered(grad, ctx.group), None


def _all_gathered(tensor, group):
    pieces = [torch.empty_like(tensor) for _ in range(_group_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces)


def _reduce_scattered(tensor, group):
    # an all-to-all then a sum, the same on every backend (gloo has no reduce_scatter)
    received = torch.empty_like(tensor)
    dist.all_to_all_single(received, tensor.contiguous(), group=group)
    return received.view(_group_size(group), -1, *tensor.shape[1:]).sum(0)


def within_capacity(weights, chosen, num_experts, capacity_factor, drop_policy):
    """Megatron-Core's token dropping over this rank's pairs: [T, k] bool, the (token, expert) pairs kept, each
    expert keeping at most ceil(T x k / E x capacity_factor) of its pairs: those of the highest routing weight
    ("probs"; ties to the earlier token) or of the earliest tokens ("position")."""
    tokens, topk = chosen.shape
    capacity = math.ceil(tokens * topk / num_experts * capacity_factor)
    experts = chosen.reshape(-1)
    order = torch.arange(experts.numel(), device=experts.device)
    if drop_policy == "probs":
        order = torch.argsort(-weights.detach().reshape(-1), stable=True)
    order = order[torch.argsort(experts[order], stable=True)]  # by expert, then by the policy's preference
    sorted_experts = experts[order]
    counts = expert_counts(sorted_experts, num_experts)
    place_in_expert = torch.arange(experts.numel(), device=experts.device) - (torch.cumsum(counts, 0) - counts)[
        sorted_experts]
    kept = torch.empty_like(experts, dtype=torch.bool)
    kept[order] = place_in_expert < capacity
    return kept.view_as(chosen)


class DroplessMoE(torch.nn.Module):
    """The MLP of a dropless MoE layer. forward(x [s, b, h]) -> (output, None), as MLP's (output, bias).
    layer_number: the layer's, 1-based over the whole model (a multi-token prediction module's layer after them);
    expert_group: the expert-parallel process group (None: all experts on this rank); name: the layer's MLP's
    canonical name (its experts are named and drawn from it)."""

    def __init__(self, config, layer_number, expert_group=None, name=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.num_experts = config.num_moe_experts
        self.router = Router(config)
        drops = config.moe_expert_capacity_factor is not None
        if config.moe_expert_tensor_parallel:  # only the alltoall dispatcher splits experts (arguments/checks.py)
            self.dispatcher = AllToAllDispatcher(self.num_experts, expert_group, drops,
                                                 parallel_state.get_tensor_model_parallel_group())
        else:
            self.dispatcher = DISPATCHERS[config.moe_token_dispatcher_type](self.num_experts, expert_group, drops)
        self.experts = _grouped_experts(config, self.dispatcher.local_experts)
        expert_rank = dist.get_rank(expert_group) if expert_group is not None else 0
        first_expert = expert_rank * self.dispatcher.local_experts
        _name_experts(self.experts, f"{name or f'decoder.layers.{layer_number - 1}.mlp'}.experts", first_expert,
                      config)
        self.fp8_recipe = _delayed_expert_scaling(config, self.experts, first_expert)
        self.shared_experts = _shared_experts(config)
        self.shared_gate = None
        if config.moe_shared_expert_gate:
            self.shared_gate = torch.nn.Linear(config.hidden_size, 1, bias=False, dtype=config.params_dtype)
            set_init_method(self.shared_gate.weight, init_method_normal(config.init_method_std))
            if config.sequence_parallel:
                mark_sequence_parallel_parameter(self.shared_gate.weight)
        self.tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
        self.counts_groups = token_split_groups()
        self.sequence_split = parallel_state.get_sequence_split_world_size()
        if self.tensor_parallel > 1:  # the router sees this rank's share of the tokens
            mark_sequence_parallel_parameter(self.router.gate.weight)
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32),
                             persistent=config.moe_router_enable_expert_bias)
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32),
                             persistent=False)  # since the last bias update / load report
        self.register_buffer("global_batch_counts", torch.zeros(self.num_experts), persistent=False)
        self.global_batch_forwards = 0  # micro-batches since begin_global_batch, for global_aux_loss
        self.auxiliary_losses = []  # the balance and z-losses of each forward, detached, for the log line
        self.auxiliary_gradient_scale = 1.0  # AuxiliaryLossGradient's, for the global batch under way

    def forward(self, hidden_states):
        tokens = self._tokens_of_this_rank(hidden_states)
        shape = tokens.shape
        flat = tokens.reshape(-1, shape[-1])
        bias = self.expert_bias if self.config.moe_router_enable_expert_bias else None
        weights, chosen, counts, logits = self.router(flat, bias)
        destinations, counts = self._within_capacity(weights, chosen, counts)
        if self.training:
            self.tokens_per_expert += counts.to(self.tokens_per_expert)
        routed = self.dispatcher.combine(flat, weights, destinations, self.experts).view(shape)
        routed = self._with_auxiliary_losses(routed, logits, chosen, shape)
        output = self._all_tokens(routed)
        if self.shared_experts is not None:
            output = output + self._shared(hidden_states)
        return output, None

    def _tokens_of_this_rank(self, hidden_states):
        if self.tensor_parallel == 1 or self.config.sequence_parallel:
            return hidden_states
        return scatter_to_sequence_parallel_region(hidden_states)

    def _all_tokens(self, routed):
        if self.tensor_parallel == 1 or self.config.sequence_parallel:
            return routed
        return gather_from_sequence_parallel_region(routed, tensor_parallel_output_grad=False)

    def _within_capacity(self, weights, chosen, counts):
        """(each pair's destination [T, k]: its expert, or num_experts where the expert's capacity dropped it;
        the pairs each expert computes [E]). Without a capacity factor: the choice and its counts."""
        if self.config.moe_expert_capacity_factor is None:
            return chosen, counts
        kept = within_capacity(weights, chosen, self.num_experts, self.config.moe_expert_capacity_factor,
                               self.config.moe_token_drop_policy)
        destinations = chosen.masked_fill(~kept, self.num_experts)
        return destinations, expert_counts(destinations, self.num_experts + 1)[:self.num_experts]

    def _shared(self, hidden_states):
        output, bias = self.shared_experts(hidden_states)
        output = output if bias is None else output + bias
        if self.shared_gate is not None:
            output = output * torch.sigmoid(self.shared_gate(hidden_states))
        return output

    def _with_auxiliary_losses(self, routed, logits, chosen, shape):
        groups = stage_token_groups() if self.config.moe_router_load_balancing_type == "global_aux_loss" else []
        loss = balance_loss(self.config, logits, chosen, shape[0], self.counts_groups,
                            self._global_counts(logits, chosen, groups), _ranks(groups))
        loss = loss + z_loss(self.config, logits) / _ranks(self.counts_groups)  # this rank's share of the mean
        self.auxiliary_losses.append(loss.detach())
        if self.training and torch.is_grad_enabled() and loss.requires_grad:
            # DeepSpeed averages gradients over the Ulysses and CP ranks too, whose losses here are shares of the
            # sample's (the lm loss is scaled by SP x CP for the same reason: core/models/gpt/gpt_model.py)
            return AuxiliaryLossGradient.apply(routed, loss, self.auxiliary_gradient_scale * self.sequence_split)
        return routed

    def _global_counts(self, logits, chosen, groups):
        """global_aux_loss's counts: the mean per micro-batch over the global batch so far, this one included,
        summed over `groups` (the stage's ranks)."""
        if self.config.moe_router_load_balancing_type != "global_aux_loss" or not self.training:
            return None
        counts = routing_map(logits, chosen).sum(0).detach()
        for group in groups:
            dist.all_reduce(counts, group=group)
        self.global_batch_counts += counts.to(self.global_batch_counts)
        self.global_batch_forwards += 1
        return self.global_batch_counts.to(counts) / self.global_batch_forwards

    def begin_global_batch(self, gradient_scale):
        """Before a global batch: forget the recorded losses and global counts; start the losses' gradients at
        gradient_scale (what DeepSpeed scales the main loss's by)."""
        self.auxiliary_losses = []
        self.auxiliary_gradient_scale = gradient_scale
        self.global_batch_counts.zero_()
        self.global_batch_forwards = 0


def token_split_groups():
    """The groups whose ranks split a micro-batch's tokens with this one (TP, where the layer routes its share;
    Ulysses SP x CP): the balance losses' counts are summed over them, as Megatron-Core sums them over TP x CP."""
    groups = []
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        groups.append(parallel_state.get_tensor_model_parallel_group())
    if parallel_state.get_sequence_split_world_size() > 1:
        groups.append(parallel_state.get_sequence_split_group())
    return groups


def stage_token_groups():
    """The groups whose ranks hold a pipeline stage's other tokens: TP where it splits them (the layer routes its
    share) and the sequence- and data-parallel ranks; none before the process groups exist."""
    if not parallel_state.model_parallel_is_initialized():
        return []
    sizes = ((parallel_state.get_tensor_model_parallel_group, parallel_state.get_tensor_model_parallel_world_size),
             (parallel_state.get_sequence_data_parallel_group, parallel_state.get_sequence_data_parallel_world_size))
    return [group() for group, size in sizes if size() > 1]


def routing_map(logits, chosen):
    """[T, E] 0/1: which experts each token chose."""
    return torch.zeros_like(logits).scatter(1, chosen, 1.0)


def _scores_for_balance(config, logits):
    """The per-expert scores the balance losses weigh: softmax, or sigmoid normalised over the experts."""
    if config.moe_router_score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def switch_balance_loss(scores, tokens_per_expert, total_tokens, topk, num_experts, coeff):
    """Switch Transformer's loss as Megatron-Core writes it: E x sum_i f_i P_i x coeff, with f_i the share of the
    k choices that went to expert i and P_i the mean score of expert i (sum_i over every column of scores)."""
    return (scores.sum(0) * tokens_per_expert).sum() * (num_experts * coeff / (topk * total_tokens * total_tokens))


def balance_loss(config, logits, chosen, seq_length, counts_groups=(), global_counts=None, global_ranks=1):
    """Megatron-Core's load-balancing loss of --moe-router-load-balancing-type over this rank's tokens (logits
    [T, E] fp32, T = seq_length x batch in [s, b] order); 0 for none. counts_groups: the groups whose ranks' tokens
    join this rank's in the counts (TP and Ulysses SP, which split a micro-batch's tokens, as Megatron-Core sums
    them over TP x CP); global_counts: global_aux_loss's
    mean counts per micro-batch over the global batch so far, summed over global_ranks ranks."""
    kind, coeff = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    if kind == "none" or not coeff:
        return logits.new_zeros(())
    scores, chosen_map = _scores_for_balance(config, logits), routing_map(logits, chosen)
    experts, topk, share = logits.shape[-1], config.moe_router_topk, _ranks(counts_groups)
    if kind == "seq_aux_loss":  # each sequence on its own: the batch folded into the experts' dimension
        batch = logits.shape[0] // seq_length
        counts = _summed(chosen_map.view(seq_length, batch * experts).sum(0), counts_groups)
        return switch_balance_loss(scores.view(seq_length, -1), counts, seq_length * share, topk, experts,
                                   coeff) / batch
    if kind == "global_aux_loss" and global_counts is not None:
        return switch_balance_loss(scores, global_counts, logits.shape[0] * global_ranks, topk, experts, coeff)
    counts = _summed(chosen_map.sum(0), counts_groups)
    return switch_balance_loss(scores, counts, logits.shape[0] * share, topk, experts, coeff)


def _group_size(group):
    return dist.get_world_size(group) if group is not None else 1


def _ranks(groups):
    return math.prod(map(_group_size, groups))


def _summed(counts, groups):
    for group in groups:
        dist.all_reduce(counts, group=group)
    return counts


def z_loss(config, logits):
    """ST-MoE's router z-loss: coeff x mean over tokens of logsumexp(logits)^2 (0 without --moe-z-loss-coeff)."""
    if not config.moe_z_loss_coeff:
        return logits.new_zeros(())
    return torch.logsumexp(logits, dim=-1).square().mean() * config.moe_z_loss_coeff


def _swiglu_saving_its_inputs(gate, up, alpha, limit):
    """silu(gate) * up keeping gate and up alone for backward, as DeepSpeed's Triton SwiGLU does on a GPU (left to
    autograd, PyTorch's ops would keep silu(gate) too): the experts keep the same bytes on every device."""
    return swiglu_of_halves_reference(gate, up)


def _swiglu_fused_where_it_runs(gate, up, alpha, limit):
    if gate.is_cuda:
        return swiglu_triton(gate, up)
    return _swiglu_saving_its_inputs(gate, up, alpha, limit)


EXPERT_ACTIVATION = "megatron_ds_swiglu"
if EXPERT_ACTIVATION not in EXPERT_ACTIVATIONS:
    register_expert_activation(EXPERT_ACTIVATION, _swiglu_saving_its_inputs, fused_fn=_swiglu_fused_where_it_runs,
                               gate_fn=F.silu)


def expert_tensor_parallel_size(config):
    """The ranks splitting each expert's F: TP with expert tensor parallelism, else 1."""
    return parallel_state.get_tensor_model_parallel_world_size() if config.moe_expert_tensor_parallel else 1


class Experts(GroupedExperts):
    """DeepSpeed's GroupedExperts, each expert's three GEMMs in FP8 (fp8_grouped_linear) when fp8_recipe is set.
    Under expert TP each rank scales its slice of F on its own: rowwise and blockwise scales match ETP 1's
    (blockwise where the slice is a multiple of 128), tensorwise ones may not; delayed scaling's (the layer's
    state, a row per expert and GEMM, reduced over the stage) do."""
    fp8_recipe = None

    def forward(self, x, num_tokens_per_expert):
        if self.fp8_recipe is None:
            return super().forward(x, num_tokens_per_expert)
        gate, up = (self._fp8_gemm(x, weights, num_tokens_per_expert, gemm)
                    for gemm, weights in enumerate((self.w1, self.w3)))
        hidden = apply_expert_activation(gate, up, self.activation, self.activation_alpha, self.activation_limit)
        return self._fp8_gemm(hidden, self.w2, num_tokens_per_expert, 2)

    def _fp8_gemm(self, rows, weights, counts, gemm):
        """gemm: 0 w1, 1 w3, 2 w2 (delayed scaling's slot of each expert)."""
        recipe = self.fp8_recipe
        if recipe.recipe == DelayedScaling.recipe:
            slots = [(self.first_expert + expert, gemm) for expert in range(len(weights))]
            return recipe.grouped_linear(rows, weights, counts.tolist(), slots)
        return fp8_grouped_linear(rows, weights, counts.tolist(), recipe.recipe, recipe.fmt, recipe.margin)


def _grouped_experts(config, local_experts):
    ffn = config.moe_ffn_hidden_size // expert_tensor_parallel_size(config)
    experts = Experts(config.hidden_size, ffn, local_experts, use_grouped_mm=config.moe_grouped_gemm,
                      disable_triton_grouped_mm=True, activation=EXPERT_ACTIVATION)
    if config.fp8_recipe != DelayedScaling.recipe:  # delayed scaling's state is the layer's: _delayed_expert_scaling
        experts.fp8_recipe = fp8_recipe_of(config)
    return experts.to(config.params_dtype)


def _delayed_expert_scaling(config, experts, first_expert):
    """Under FP8 delayed scaling, the layer's one DelayedScaling of its experts: a row per global expert and GEMM (w1,
    w3, w2), so every rank holds the whole state. It is the layer's submodule `fp8_recipe` (checkpointed as
    `...mlp.fp8_recipe.*`, beside the experts' files) and only referred to by the experts. None otherwise."""
    if config.fp8_format is None or config.fp8_recipe != DelayedScaling.recipe:
        return None
    scaling = DelayedScaling(config.fp8_format, config.fp8_margin, config.fp8_amax_history_len,
                             config.fp8_amax_compute_algo, slots=(config.num_moe_experts, 3))
    object.__setattr__(experts, "fp8_recipe", scaling)  # not the experts' submodule: not under `.experts.`
    experts.first_expert = first_expert
    return scaling


# where F is in one expert's tensor: w1 (gate) and w3 (up) [F, h], w2 (down) [h, F]
EXPERT_FFN_DIM = {"w1": 0, "w3": 0, "w2": 1}


def _name_experts(experts, prefix, first_expert, config):
    """Each expert's slice of w1 (gate), w3 (up) and w2 (down) drawn by its global index, so every expert-parallel
    size starts from the same model (with expert TP each TP rank keeps its part of F of the whole expert, as a
    dense TP layer keeps its part of the whole weight); the parameters tagged for DeepSpeed's expert-data-parallel
    reduction."""
    group_name = parallel_state.expert_group_name(config.moe_expert_parallel_size)
    local = experts.num_experts
    for name, std in (("w1", config.init_method_std), ("w3", config.init_method_std),
                      ("w2", config.output_layer_init_std)):
        param = getattr(experts, name)
        set_init_method(param, init_method_normal(std))
        param.init_keys = expert_slice_names(f"{prefix}.{name}", first_expert, local)
        param.allreduce, param.group_name = False, group_name
        # other experts, other F slices or other tokens' gradients on each TP rank: DeepSpeed's gradient norm
        # counts them on every TP rank
        param.model_parallel = True
        if config.moe_expert_tensor_parallel:
            param.tensor_model_parallel, param.partition_stride = True, 1
            param.partition_dim = EXPERT_FFN_DIM[name] + 1  # after the experts' dim


def expert_slice_names(grouped_name, first_expert, count):
    """The layout-free names of a grouped experts' tensor's slices along dim 0, one expert each by its global
    index: `decoder.layers.3.mlp.experts.w1` -> `decoder.layers.3.mlp.experts.{first_expert + i}.w1`."""
    prefix, weight = grouped_name.rsplit(".", 1)
    return [f"{prefix}.{first_expert + index}.{weight}" for index in range(count)]


def _shared_experts(config):
    if not config.moe_shared_expert_intermediate_size:
        return None
    return MLP(replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size))


def dropless_layers(model):
    return [module for module in model.modules() if isinstance(module, DroplessMoE)]


def update_expert_bias(layers, groups=()):
    """Auxiliary-loss-free balancing, once per optimizer step: each layer's bias moves by rate x sign(mean load -
    load), the loads those of the global batch (summed over micro-batches and over `groups`: together the ranks
    whose tokens differ, TP and sequence- and data-parallel), so the bias stays identical on every rank. Resets
    the counts; returns each layer's max / mean load. One all-reduce per group for all layers."""
    counts = torch.stack([layer.tokens_per_expert for layer in layers])
    for group in groups:
        dist.all_reduce(counts, group=group)
    for layer, load in zip(layers, counts):
        if layer.config.moe_router_enable_expert_bias:
            offset = load.mean() - load
            layer.expert_bias += torch.sign(offset) * layer.config.moe_router_bias_update_rate
        layer.tokens_per_expert.zero_()
    return counts.max(1).values / counts.mean(1).clamp(min=1e-20)
