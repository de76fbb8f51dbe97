"""BF16_Optimizer's flat fp32 gradients are zeroed once per step instead of twice, training exactly as before
(2 real gloo ranks, each with its own data, through the flat in-place reduction pretrain.py installs)."""
import os

import torch
import torch.distributed as dist

from megatron_ds.core.deepspeed_internals import zero_bf16_fp32_gradients_once
from megatron_ds.engine.gradient_reduction import install_flat_gradient_reduction
from megatron_ds.launch.runtime import init_distributed
from tests.support.bf16_engines import DS_CONFIG, bf16_engine, rank_batches, train_step
from tests.support.distributed import run_distributed


def _counting_zeroings(optimizer):
    """[times the flat fp32 gradients were zeroed]: clear_hp_grads is where BF16_Optimizer zeroes them."""
    count, clear = [0], optimizer.clear_hp_grads

    def counted():
        count[0] += 1
        clear()
    optimizer.clear_hp_grads = counted
    return count


def _train(once, steps=3):
    """(weights after `steps` steps, fp32 zeroings per step) of a fresh engine."""
    engine = bf16_engine(False, DS_CONFIG)
    assert install_flat_gradient_reduction(engine, dist.group.WORLD)
    if once:
        assert zero_bf16_fp32_gradients_once(engine.optimizer)
    zeroings, batches = _counting_zeroings(engine.optimizer), rank_batches()
    for _ in range(steps):
        train_step(engine, batches)
        assert all(not gradient.any() for gradient in engine.optimizer.fp32_groups_gradients_flat)
    return [p.detach().float().clone() for p in engine.module.parameters()], zeroings[0] / steps


def _gradients_left_after_zero_grad(engine):
    """zero_grad() after a backward with no step (a discarded batch) must still clear what it added."""
    inputs, target = next(rank_batches())
    engine.backward((engine(inputs).float() - target.float()).pow(2).mean())
    assert any(gradient.any() for gradient in engine.optimizer.fp32_groups_gradients_flat)
    engine.optimizer.zero_grad(set_to_none=True)
    return [gradient.count_nonzero().item() for gradient in engine.optimizer.fp32_groups_gradients_flat]


def _compare():
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    init_distributed("gloo")
    deepspeed_weights, deepspeed_zeroings = _train(once=False)
    weights, zeroings = _train(once=True)
    assert (deepspeed_zeroings, zeroings) == (2, 1)
    for ours, theirs in zip(weights, deepspeed_weights):
        assert torch.equal(ours, theirs)
    engine = bf16_engine(False, DS_CONFIG)
    zero_bf16_fp32_gradients_once(engine.optimizer)
    train_step(engine, rank_batches())
    assert _gradients_left_after_zero_grad(engine) == [0] * len(engine.optimizer.fp32_groups_gradients_flat)


def test_fp32_gradients_are_zeroed_once_per_step_and_training_is_unchanged():
    run_distributed(_compare, 2, timeout=240)


def test_only_bf16_optimizers_are_wrapped():
    assert not zero_bf16_fp32_gradients_once(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))
