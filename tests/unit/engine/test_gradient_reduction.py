"""The in-place data-parallel reduction of BF16_Optimizer's flat fp32 gradients gives exactly DeepSpeed's
result, in the plain and the pipeline engine (2 real gloo ranks, each with its own data)."""
import os

import pytest
import torch
import torch.distributed as dist

from megatron_ds.engine.gradient_reduction import install_flat_gradient_reduction
from megatron_ds.launch.runtime import init_distributed
from tests.support.bf16_engines import DS_CONFIG, bf16_engine, rank_batches, train_step
from tests.support.distributed import run_distributed


def _weights_after_two_steps(pipelined, config, flat):
    engine = bf16_engine(pipelined, config)
    assert type(engine.optimizer).__name__ == "BF16_Optimizer"
    if flat:
        assert install_flat_gradient_reduction(engine, dist.group.WORLD)
    batches = rank_batches()
    for _ in range(2):
        train_step(engine, batches)
    grads = [g.clone() for g in engine.optimizer.non_expert_gradients]  # cleared after the step: all zero
    assert all(not g.any() for g in grads)
    return [p.detach().float().clone() for p in engine.module.parameters()]


def _compare(pipelined, config):
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    init_distributed("gloo")
    deepspeed_weights = _weights_after_two_steps(pipelined, config, flat=False)
    flat_weights = _weights_after_two_steps(pipelined, config, flat=True)
    for ours, theirs in zip(flat_weights, deepspeed_weights):
        assert torch.equal(ours, theirs)
    gathered = [torch.empty_like(flat_weights[0]) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat_weights[0])
    assert torch.equal(gathered[0], gathered[1]), "data-parallel replicas diverged: gradients were not reduced"


@pytest.mark.parametrize("pipelined, communication", [(False, None), (True, None), (False, "fp32")],
                         ids=["plain-engine", "pipeline-engine", "plain-engine-fp32-communication"])
def test_flat_reduction_matches_deepspeed(pipelined, communication):
    """Default communication_data_type (bf16: reduced through a cast copy) and fp32 (reduced in place)."""
    config = DS_CONFIG if communication is None else {**DS_CONFIG, "communication_data_type": communication}
    run_distributed(_compare, 2, pipelined, config, timeout=240)
