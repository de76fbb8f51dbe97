"""The MoE layer (DeepSpeed-MoE with our MLP as the expert) against hand computations on a small input: the
auxiliary loss, the dispatch counts, the tokens dropped at capacity, the auxiliary loss's gradient at the
router, and the experts drawn by their global index. One real gloo rank (DeepSpeed's gate runs collectives)."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.tensor_parallel.random import _generator_for, init_method_normal, initialize_deterministically
from megatron_ds.core.transformer.moe import MoEMLP, begin_global_batch
from megatron_ds.core.transformer.transformer_config import TransformerConfig
from tests.support.distributed import run_distributed

HIDDEN, EXPERTS, TOKENS = 16, 4, 24


def _config(**moe):
    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, hidden_dropout=0.0,
                             attention_dropout=0.0, num_experts=(EXPERTS,), moe_min_capacity=0, **moe)


def _layer(**moe):
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(3)
    layer = MoEMLP(_config(**moe), EXPERTS, layer_number=2)
    initialize_deterministically(layer, "decoder.layers.1.mlp", 1234)  # what TransformerLayer does
    return layer


def _input():
    return torch.randn(TOKENS // 2, 2, HIDDEN, generator=torch.Generator().manual_seed(0))  # [s, b, h]


def _gate(layer, x):
    """softmax probabilities [tokens, E] of the router on x, in DeepSpeed's token order."""
    logits = x.reshape(-1, HIDDEN).float() @ layer.deepspeed_moe.gate.wg.weight.float().t()
    return F.softmax(logits, dim=1)


def _hand_computations(k):
    layer = _layer(moe_router_topk=k, moe_token_dropping=False, moe_top2_2nd_expert_sampling=False,
                   moe_loss_coeff=0.5)
    x = _input()
    _, auxiliary, counts = super(MoEMLP, layer).forward(x)
    gates = _gate(layer, x)
    first = F.one_hot(gates.argmax(dim=1), EXPERTS).float()
    expected_aux = EXPERTS * torch.sum(gates.mean(0) * first.mean(0))  # GShard's load-balancing loss
    chosen = gates.topk(k, dim=1).indices
    expected_counts = torch.bincount(chosen.reshape(-1), minlength=EXPERTS)
    torch.testing.assert_close(auxiliary, expected_aux, rtol=1e-6, atol=0)
    assert counts.tolist() == expected_counts.tolist()
    output, bias = layer(x)
    assert bias is None and output.shape == x.shape
    assert layer.auxiliary_losses[-1].item() == pytest.approx(0.5 * expected_aux.item(), rel=1e-6)  # coeff x l_aux


@pytest.mark.parametrize("k", [1, 2])
def test_auxiliary_loss_and_counts_match_a_hand_computation(k):
    run_distributed(_hand_computations, 1, k)


def _dropped_tokens():
    layer = _layer(moe_router_topk=1, moe_token_dropping=True, moe_train_capacity_factor=0.5)
    layer.deepspeed_moe.gate.wg.weight.data[0] += 2.0  # crowd expert 0
    x = _input()
    output, _ = layer(x)
    counts = torch.bincount(_gate(layer, x).argmax(dim=1), minlength=EXPERTS)
    capacity = max(math.ceil(TOKENS / EXPERTS * 0.5), 0)  # DeepSpeed's _capacity with min_capacity 0
    kept = int(torch.clamp(counts, max=capacity).sum())
    assert counts.max() > capacity, counts  # the input really overflows an expert
    routed = int((output.reshape(-1, HIDDEN).abs().sum(dim=1) > 0).sum())
    assert routed == kept, (routed, kept, counts.tolist(), capacity)


def test_tokens_dropped_at_capacity():
    """Top-1 with capacity ceil(tokens / experts x factor): an expert keeps at most that many tokens; the others
    leave the layer as zeros (the residual carries them)."""
    run_distributed(_dropped_tokens, 1)


def _router_gradient():
    def router_gradient(coeff):
        layer = _layer(moe_router_topk=2, moe_token_dropping=False, moe_top2_2nd_expert_sampling=False,
                       moe_loss_coeff=coeff)
        begin_global_batch([layer], 0.25)  # as with 4 micro-batches a step
        layer(_input())[0].sum().backward()
        return layer.deepspeed_moe.gate.wg.weight.grad.clone(), layer

    without, _ = router_gradient(0.0)
    with_loss, layer = router_gradient(0.3)
    layer.zero_grad()
    _, auxiliary, _ = super(MoEMLP, layer).forward(_input())
    (auxiliary_gradient,) = torch.autograd.grad(auxiliary, layer.deepspeed_moe.gate.wg.weight)
    torch.testing.assert_close(with_loss - without, 0.25 * 0.3 * auxiliary_gradient, rtol=1e-5, atol=1e-7)
    assert auxiliary_gradient.abs().sum() > 0


def test_auxiliary_loss_gradient_reaches_the_router():
    """The router's gradient with coeff c minus without is scale x c x d l_aux / d router (scale: what training
    scales the main loss's gradient by)."""
    run_distributed(_router_gradient, 1)


def _experts_by_global_index():
    layer = _layer()
    for index, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
        full = torch.empty(expert.linear_fc1.weight.shape)
        init_method_normal(0.02)(full, _generator_for(1234, f"decoder.layers.1.mlp.experts.{index}.linear_fc1.weight"))
        torch.testing.assert_close(expert.linear_fc1.weight.detach(), full, rtol=0, atol=0)
        assert expert.linear_fc1.weight.allreduce is False and expert.linear_fc1.weight.group_name == "ep_size_1"
    first, second = (expert.linear_fc1.weight for expert in layer.deepspeed_moe.experts.deepspeed_experts[:2])
    assert not torch.equal(first, second)


def test_experts_are_drawn_by_their_global_index():
    """Expert e's weights come from the seed and its global name, whatever the expert-parallel size; DeepSpeed's
    expert tags are kept on the fresh experts."""
    run_distributed(_experts_by_global_index, 1)


def _recompute_keeps_the_auxiliary_loss():
    from megatron_ds.core.models.gpt import GPTModel
    from megatron_ds.core.transformer.moe import auxiliary_loss_of, forget_auxiliary_losses, moe_layers
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    results = []
    for recompute in (None, "full"):
        model_parallel_cuda_manual_seed(3)
        config = _config(moe_router_topk=2, moe_token_dropping=False, moe_top2_2nd_expert_sampling=False,
                         recompute_granularity=recompute)
        model = GPTModel(config, 64, 12)
        layers = moe_layers(model)
        forget_auxiliary_losses(layers)
        for _ in range(2):  # two micro-batches
            model(tokens, labels=tokens).backward()
        results.append((auxiliary_loss_of(layers), layers[0].deepspeed_moe.gate.wg.weight.grad.clone(),
                        len(layers[0].auxiliary_losses)))
    (plain, plain_grad, plain_count), (recomputed, recomputed_grad, recomputed_count) = results
    assert (plain_count, recomputed_count) == (2, 4)  # the recompute records each micro-batch again
    torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)
    torch.testing.assert_close(recomputed_grad, plain_grad, rtol=1e-6, atol=1e-9)


def test_full_recompute_keeps_the_auxiliary_loss_and_its_gradient():
    """Under full recompute the router gets the same gradient (the auxiliary loss's included) and the logged
    moe loss is the same mean over micro-batches."""
    run_distributed(_recompute_keeps_the_auxiliary_loss, 1)
