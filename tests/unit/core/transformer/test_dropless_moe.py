"""The dropless MoE layer (core/transformer/dropless_moe.py) against an independent computation written here in
fp64 (the routing spelled out, each expert a plain gated MLP, an expert's capacity a loop over its pairs), alone
and over real gloo processes: expert parallelism with either dispatcher, TP with and without Megatron's sequence
parallelism; the capacity's drops by hand; its balance losses against their formulas; the expert bias's update."""
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel.random import initialize_deterministically
from megatron_ds.core.transformer.dropless_moe import (
    DroplessMoE,
    balance_loss,
    update_expert_bias,
    within_capacity,
    z_loss,
)
from megatron_ds.core.transformer.transformer_config import MOE_TOKEN_DISPATCHERS, TransformerConfig
from tests.support.distributed import run_distributed

HIDDEN, EXPERTS, SEQ, BATCH = 16, 8, 6, 2
ROUTINGS = {
    "softmax top-2": dict(),
    "softmax top-2 before the choice": dict(moe_router_pre_softmax=True),
    "sigmoid top-4 of 2 groups of 4, scaled, biased": dict(
        moe_router_score_function="sigmoid", moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True),
    "softmax top-2, a gated shared expert": dict(moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=True),
    "softmax top-2, capacity 0.5, the lowest weights dropped, the allgather dispatcher": dict(
        moe_expert_capacity_factor=0.5, moe_token_dispatcher_type="allgather"),
    "sigmoid top-4 of 2 groups of 4, biased, capacity 0.75, the last tokens dropped": dict(
        moe_router_score_function="sigmoid", moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_enable_expert_bias=True, moe_expert_capacity_factor=0.75, moe_token_drop_policy="position"),
}


def _config(dtype=torch.float64, **changes):
    values = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=32, gated_linear_unit=True,
                  bias=False, num_moe_experts=EXPERTS, moe_ffn_hidden_size=24, moe_router_topk=2, params_dtype=dtype,
                  init_method_std=0.5, hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**values, **changes})


def _layer(config, expert_group=None, seed=7):
    layer = DroplessMoE(config, 1, expert_group)
    initialize_deterministically(layer, "moe", seed)
    if config.moe_router_enable_expert_bias:
        layer.expert_bias.copy_(torch.linspace(-0.3, 0.3, EXPERTS))
    return layer


def _tokens(dtype, seed=0, seq=SEQ):
    return torch.randn(seq, BATCH, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _reference(x, weights, config, expert_bias):
    """The layer's output written out: scores, (grouped) choice with the bias, weights normalised and scaled,
    each chosen expert silu(x W1) * (x W3) W2 (unless its capacity dropped the pair), summed; the shared expert
    added, gated."""
    tokens = x.reshape(-1, HIDDEN)
    chosen, chosen_scores = _reference_routing(tokens, weights, config, expert_bias)
    kept = _kept_by_capacity(chosen, chosen_scores, config)
    rows = []
    for token, experts, token_weights, token_kept in zip(tokens, chosen, chosen_scores, kept):
        rows.append(sum((weight * _gated_mlp(token, weights["w1"][e], weights["w3"][e], weights["w2"][e])
                         for e, weight, keep in zip(experts.tolist(), token_weights, token_kept) if keep),
                        start=torch.zeros_like(token)))
    output = torch.stack(rows)
    if "shared_fc1" in weights:
        gate, up = (tokens @ weights["shared_fc1"].t()).chunk(2, -1)
        shared = (F.silu(gate) * up) @ weights["shared_fc2"].t()
        output = output + shared * torch.sigmoid(tokens @ weights["shared_gate"].t())
    return output.view_as(x)


def _reference_routing(tokens, weights, config, expert_bias):
    """(chosen experts [T, k], their routing weights [T, k])."""
    logits = tokens @ weights["router"].t()
    sigmoid = config.moe_router_score_function == "sigmoid"
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, -1)
    choice = scores + expert_bias if config.moe_router_enable_expert_bias else scores
    k = config.moe_router_topk
    if config.moe_router_num_groups:
        groups = choice.view(len(tokens), config.moe_router_num_groups, -1)
        group_scores = groups.topk(k // config.moe_router_group_topk, -1).values.sum(-1)
        kept = group_scores.topk(config.moe_router_group_topk, -1).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter(1, kept, False)
        choice = groups.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(len(tokens), -1)
    chosen = choice.topk(k, -1).indices
    chosen_scores = scores.gather(1, chosen)
    if (k > 1) if sigmoid else not config.moe_router_pre_softmax:
        chosen_scores = chosen_scores / chosen_scores.sum(-1, keepdim=True)
    return chosen, chosen_scores * (config.moe_router_topk_scaling_factor or 1.0)


def _kept_by_capacity(chosen, scores, config):
    """[T, k] bool: each expert keeps ceil(T k / E x factor) of its pairs, those of the highest score, the earlier
    token first among equals (probs), or of the earliest tokens (position); every pair without a factor."""
    kept = torch.ones_like(chosen, dtype=torch.bool)
    if config.moe_expert_capacity_factor is None:
        return kept
    tokens, k = chosen.shape
    capacity = math.ceil(tokens * k / config.num_moe_experts * config.moe_expert_capacity_factor)
    for expert in range(config.num_moe_experts):
        pairs = [(token, slot) for token in range(tokens) for slot in range(k) if chosen[token, slot] == expert]
        if config.moe_token_drop_policy == "probs":
            pairs.sort(key=lambda pair: (-scores[pair].item(), pair[0]))
        for pair in pairs[capacity:]:
            kept[pair] = False
    return kept


def _gated_mlp(token, w1, w3, w2):
    return (F.silu(token @ w1.t()) * (token @ w3.t())) @ w2.t()


def _weights(layer):
    """The layer's parameters as fp64 leaves for the reference."""
    named = {"router": layer.router.gate.weight, "w1": layer.experts.w1, "w3": layer.experts.w3,
             "w2": layer.experts.w2}
    if layer.shared_experts is not None:
        named.update(shared_fc1=layer.shared_experts.linear_fc1.weight,
                     shared_fc2=layer.shared_experts.linear_fc2.weight, shared_gate=layer.shared_gate.weight)
    return {name: param.detach().double().requires_grad_() for name, param in named.items()}


def _gradients(layer):
    return {"router": layer.router.gate.weight.grad, "w1": layer.experts.w1.grad, "w3": layer.experts.w3.grad,
            "w2": layer.experts.w2.grad}


@pytest.mark.parametrize("routing", ROUTINGS)
def test_the_layer_is_the_routing_written_out(routing):
    config = _config(**ROUTINGS[routing])
    with parallel_state.simulated_model_parallel(1, 0):
        layer = _layer(config)
        x = _tokens(torch.float64).requires_grad_()
        output, _ = layer(x)
    weights = _weights(layer)
    reference = _reference(x.detach().requires_grad_(), weights, config, layer.expert_bias.double())
    _assert_within_a_millionth(output, reference, "output")
    grad = torch.randn(output.shape, generator=torch.Generator().manual_seed(1), dtype=output.dtype)
    output.backward(grad)
    reference.backward(grad)
    for name, gradient in _gradients(layer).items():
        _assert_within_a_millionth(gradient, weights[name].grad, name)


def _assert_within_a_millionth(value, expected, what):
    """Within 1e-6 of the largest expected magnitude (the routing weights are fp32, as DeepSpeed's router keeps
    them, so the fp64 layer agrees with the fp64 reference to about 1e-7 of its scale)."""
    error, scale = (value - expected).abs().max().item(), expected.abs().max().item()
    assert error <= 1e-6 * scale, f"{what}: off by {error:.3g} at a scale of {scale:.3g}"


def test_no_token_is_dropped():
    config = _config(moe_router_topk=3)
    with parallel_state.simulated_model_parallel(1, 0):
        layer = _layer(config).train()
        for step in range(3):
            layer(_tokens(torch.float64, seed=step))
    assert layer.tokens_per_expert.sum().item() == 3 * SEQ * BATCH * 3


def test_grouped_gemms_compute_what_the_loop_of_gemms_does():
    outputs = {}
    for grouped in (False, True):
        with parallel_state.simulated_model_parallel(1, 0):
            layer = _layer(_config(torch.float32, moe_grouped_gemm=grouped))
            outputs[grouped] = layer(_tokens(torch.float32))[0]
    torch.testing.assert_close(outputs[True], outputs[False], rtol=1e-5, atol=1e-6)


# --- an expert's capacity ------------------------------------------------------------------------------------

# 4 tokens, top-2 of 4 experts; capacity factor 1: ceil(4 x 2 / 4 x 1) = 2 pairs per expert
HAND_CHOSEN = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
HAND_WEIGHTS = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.5, 0.5]])


@pytest.mark.parametrize("policy, kept, counts", [
    # expert 0 keeps tokens 2 (0.9) and 1 (0.7) of its four, expert 1 tokens 3 (0.5) and 0 (0.4) of its three
    ("probs", [[False, True], [True, True], [True, False], [True, False]], [2, 2, 1, 0]),
    # expert 0 keeps tokens 0 and 1, expert 1 tokens 0 and 2
    ("position", [[True, True], [True, True], [False, True], [False, False]], [2, 2, 1, 0]),
])
def test_an_expert_keeps_its_capacity_of_pairs_by_the_drop_policy(policy, kept, counts):
    mask = within_capacity(HAND_WEIGHTS, HAND_CHOSEN, 4, 1.0, policy)
    assert mask.tolist() == kept
    assert torch.bincount(HAND_CHOSEN[mask], minlength=4).tolist() == counts


def test_ties_go_to_the_earlier_token_and_a_large_capacity_drops_nothing():
    equal = torch.full((4, 2), 0.5)
    assert within_capacity(equal, HAND_CHOSEN, 4, 0.5, "probs").tolist() == \
        [[True, True], [False, True], [False, False], [False, False]]  # capacity 1: each expert's first token
    assert within_capacity(HAND_WEIGHTS, HAND_CHOSEN, 4, 4.0, "probs").all()


def test_the_counts_are_of_the_pairs_the_experts_keep():
    config = _config(moe_expert_capacity_factor=0.5)
    with parallel_state.simulated_model_parallel(1, 0):
        layer = _layer(config).train()
        x = _tokens(torch.float64)
        layer(x)
    chosen, scores = _reference_routing(x.reshape(-1, HIDDEN), _weights(layer), config, None)
    kept = chosen[_kept_by_capacity(chosen, scores, config)]
    assert len(kept) < SEQ * BATCH * 2  # capacity ceil(24 / 8 x 0.5) = 2 of the 3 pairs per expert on average
    assert layer.tokens_per_expert.tolist() == torch.bincount(kept, minlength=EXPERTS).tolist()


# --- the balance losses, against their formulas ----------------------------------------------------------

def _routing(config, seed=3):
    logits = torch.randn(SEQ * BATCH, EXPERTS, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    chosen = logits.topk(config.moe_router_topk, -1).indices
    return logits, chosen


def _switch(scores, chosen, experts, topk, coeff):
    """E x sum_i f_i P_i x coeff: f_i the fraction of the choices to expert i, P_i expert i's mean score."""
    fraction = torch.stack([(chosen == e).sum() for e in range(experts)]).double() / (len(chosen) * topk)
    return experts * (fraction * scores.mean(0)).sum() * coeff


def test_aux_loss_is_switch_transformers():
    config = _config(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
    logits, chosen = _routing(config)
    expected = _switch(torch.softmax(logits, -1), chosen, EXPERTS, 2, 0.01)
    torch.testing.assert_close(balance_loss(config, logits, chosen, SEQ), expected)


def test_seq_aux_loss_is_the_mean_over_sequences_of_each_ones_loss():
    config = _config(moe_router_score_function="sigmoid", moe_router_load_balancing_type="seq_aux_loss",
                     moe_aux_loss_coeff=1e-4)
    logits, chosen = _routing(config)
    scores = torch.sigmoid(logits)
    scores = scores / scores.sum(-1, keepdim=True)
    per_sequence = [_switch(scores.view(SEQ, BATCH, -1)[:, b], chosen.view(SEQ, BATCH, -1)[:, b], EXPERTS, 2, 1e-4)
                    for b in range(BATCH)]
    torch.testing.assert_close(balance_loss(config, logits, chosen, SEQ), sum(per_sequence) / BATCH)


def test_global_aux_loss_weighs_the_global_batchs_mean_counts():
    config = _config(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.01)
    logits, chosen = _routing(config)
    counts = torch.arange(EXPERTS, dtype=torch.float64) + 1
    expected = EXPERTS * 0.01 * (torch.softmax(logits, -1).sum(0) * counts).sum() / (2 * len(logits) ** 2)
    torch.testing.assert_close(balance_loss(config, logits, chosen, SEQ, global_counts=counts), expected)


def test_z_loss_is_the_mean_squared_logsumexp():
    config = _config(moe_z_loss_coeff=1e-3)
    logits, _ = _routing(config)
    expected = 1e-3 * sum(torch.log(torch.exp(row).sum()) ** 2 for row in logits) / len(logits)
    torch.testing.assert_close(z_loss(config, logits), expected)


# --- auxiliary-loss-free balancing ---------------------------------------------------------------------------

def test_the_bias_moves_each_expert_toward_the_mean_load():
    config = _config(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
    with parallel_state.simulated_model_parallel(1, 0):
        layer = _layer(config)
    layer.expert_bias.zero_()
    layer.tokens_per_expert.copy_(torch.tensor([5.0, 1, 3, 3, 0, 9, 2, 1]))  # mean 3
    imbalance = update_expert_bias([layer])
    assert layer.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0, 0, 0.01, -0.01, 0.01, 0.01])
    assert imbalance.tolist() == [3.0]
    assert layer.tokens_per_expert.sum().item() == 0


def _max_over_mean_load(bias, steps=50):
    config = _config(torch.float32, moe_router_score_function="sigmoid", moe_router_topk=2,
                     moe_router_enable_expert_bias=bias, moe_router_bias_update_rate=0.02)
    with parallel_state.simulated_model_parallel(1, 0):
        layer = _layer(config).train()
        with torch.no_grad():  # a router that favours the first two experts
            layer.router.gate.weight[:2] += 2.0 * layer.router.gate.weight[:2].sign()
        for step in range(steps):
            with torch.no_grad():
                layer(_tokens(torch.float32, seed=step, seq=64))
            load = layer.tokens_per_expert.clone()
            update_expert_bias([layer])
    return (load.max() / load.mean()).item()


def test_the_bias_balances_a_skewed_router_and_nothing_else_does():
    assert _max_over_mean_load(bias=True) < 1.2
    assert _max_over_mean_load(bias=False) > 1.2


# --- over real processes ------------------------------------------------------------------------------------

def _expert_groups(size):
    """Every rank creates every expert-parallel group of `size` consecutive ranks; returns this rank's."""
    world = dist.get_world_size()
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= dist.get_rank() < start + size:
            mine = group
    return mine


def _expert_parallel(ep):
    """Each rank routes its own tokens; the experts split over groups of ep ranks. Every rank's output equals the
    one-process layer's on the same tokens; each expert's gradient on its rank, and the router's summed over the
    group, equal the one-process layer's gradients over the group's tokens."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    rank, group = dist.get_rank(), _expert_groups(ep)
    config = _config(moe_expert_parallel_size=ep)
    layer = _layer(config, group)
    x = _tokens(torch.float64, seed=rank)
    output, _ = layer(x)
    whole = _layer(dataclasses.replace(config, moe_expert_parallel_size=1))
    group_ranks = range(rank - rank % ep, rank - rank % ep + ep)
    inputs = [_tokens(torch.float64, seed=r) for r in group_ranks]
    outputs = [whole(tokens)[0] for tokens in inputs]
    torch.testing.assert_close(output, outputs[rank % ep], rtol=1e-9, atol=1e-12)
    grads = [_tokens(torch.float64, seed=100 + r) for r in group_ranks]
    output.backward(grads[rank % ep])
    sum((o * g).sum() for o, g in zip(outputs, grads)).backward()
    local = slice(rank % ep * EXPERTS // ep, (rank % ep + 1) * EXPERTS // ep)
    for name in ("w1", "w2", "w3"):
        torch.testing.assert_close(getattr(layer.experts, name).grad, getattr(whole.experts, name).grad[local])
    router = layer.router.gate.weight.grad.clone()
    dist.all_reduce(router, group=group)
    torch.testing.assert_close(router, whole.router.gate.weight.grad)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_layers_compute_what_one_process_does(ep):
    run_distributed(_expert_parallel, 4, ep, timeout=120)


def _dispatchers_agree(capacity_factor):
    """EP 2, each rank routing its own tokens: the allgather dispatcher's output and gradients (input, experts,
    router) equal the alltoall dispatcher's, and the routing written out over the two ranks' tokens (fp64, every
    expert's weights: the one-process layer's, drawn the same)."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    rank, group = dist.get_rank(), _expert_groups(2)
    config = _config(moe_expert_parallel_size=2, moe_expert_capacity_factor=capacity_factor)
    runs = {kind: _forward_backward(_layer(dataclasses.replace(config, moe_token_dispatcher_type=kind), group), rank)
            for kind in MOE_TOKEN_DISPATCHERS}
    torch.testing.assert_close(runs["allgather"], runs["alltoall"], rtol=1e-12, atol=1e-14)
    whole = _layer(dataclasses.replace(config, moe_expert_parallel_size=1))
    weights = _weights(whole)
    inputs = [_tokens(torch.float64, seed=r).requires_grad_() for r in range(2)]
    references = [_reference(x, weights, config, whole.expert_bias.double()) for x in inputs]
    sum((reference * _tokens(torch.float64, seed=100 + r)).sum() for r, reference in enumerate(references)).backward()
    output, input_grad, grads = runs["allgather"]
    _assert_within_a_millionth(output, references[rank], "output")
    _assert_within_a_millionth(input_grad, inputs[rank].grad, "input gradient")
    local = slice(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
    for name in ("w1", "w2", "w3"):
        _assert_within_a_millionth(grads[name], weights[name].grad[local], name)
    dist.all_reduce(grads["router"], group=group)
    _assert_within_a_millionth(grads["router"], weights["router"].grad, "router")


def _forward_backward(layer, rank):
    x = _tokens(torch.float64, seed=rank).requires_grad_()
    output, _ = layer(x)
    output.backward(_tokens(torch.float64, seed=100 + rank))
    return output.detach(), x.grad, {name: grad.clone() for name, grad in _gradients(layer).items()}


@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "capacity 0.5"])
def test_the_allgather_dispatcher_computes_what_the_alltoall_one_does(capacity_factor):
    run_distributed(_dispatchers_agree, 2, capacity_factor, timeout=120)


def _tensor_parallel(sequence_parallel, dispatcher):
    """TP 2 (each rank routes half the tokens: Megatron's SP splits them, or the layer does) with the two experts
    halves on the two ranks (EP 2 over the TP ranks): the full output equals the one-process layer's."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    rank = dist.get_rank()
    config = _config(moe_expert_parallel_size=2, sequence_parallel=sequence_parallel,
                     moe_token_dispatcher_type=dispatcher)
    layer = _layer(config, parallel_state.get_tensor_model_parallel_group())
    x = _tokens(torch.float64)
    with parallel_state.simulated_model_parallel(1, 0):
        whole = _layer(dataclasses.replace(config, moe_expert_parallel_size=1, sequence_parallel=False))
        expected, _ = whole(x)
    mine = x.chunk(2)[rank] if sequence_parallel else x
    output, _ = layer(mine)
    torch.testing.assert_close(output, expected.chunk(2)[rank] if sequence_parallel else expected)


@pytest.mark.parametrize("dispatcher", MOE_TOKEN_DISPATCHERS)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tokens split here", "sequence parallel"])
def test_tensor_parallel_layers_compute_what_one_process_does(sequence_parallel, dispatcher):
    run_distributed(_tensor_parallel, 2, sequence_parallel, dispatcher, timeout=120)


def _identical_bias():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    config = _config(moe_router_enable_expert_bias=True)
    layer = _layer(config, _expert_groups(2))
    layer(_tokens(torch.float64, seed=dist.get_rank()))
    update_expert_bias([layer], [dist.group.WORLD])
    biases = [torch.empty(EXPERTS, dtype=torch.float32) for _ in range(dist.get_world_size())]
    dist.all_gather(biases, layer.expert_bias)
    assert all(torch.equal(bias, biases[0]) for bias in biases)
    assert biases[0].abs().sum() > 0


def test_the_bias_update_is_identical_on_every_rank():
    run_distributed(_identical_bias, 2, timeout=120)


def _global_balance_over_data_parallel_ranks():
    """global_aux_loss on 2 data-parallel ranks: each rank's loss weighs its own scores by the counts of both ranks'
    tokens, over both ranks' tokens (Megatron-Core's), so the two ranks' losses add up to the loss of their union."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    config = _config(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.01)
    layer = _layer(config).train()
    tokens = [_tokens(torch.float64, seed=rank) for rank in range(2)]
    layer(tokens[dist.get_rank()])
    logits = [(x.reshape(-1, HIDDEN) @ layer.router.gate.weight.t()).detach() for x in tokens]
    counts = sum(_routing_map_of(row, config.moe_router_topk).sum(0) for row in logits)
    mine = torch.softmax(logits[dist.get_rank()], -1)
    expected = EXPERTS * 0.01 * (mine.sum(0) * counts).sum() / (2 * (2 * SEQ * BATCH) ** 2)
    torch.testing.assert_close(layer.auxiliary_losses[0].double(), expected, rtol=1e-5, atol=0)  # fp32 scores


def _routing_map_of(logits, topk):
    return torch.zeros_like(logits).scatter(1, logits.topk(topk, -1).indices, 1.0)


def test_global_aux_loss_counts_the_tokens_of_every_data_parallel_rank():
    run_distributed(_global_balance_over_data_parallel_ranks, 2, timeout=120)
