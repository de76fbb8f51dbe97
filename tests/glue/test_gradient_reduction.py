"""The in-place data-parallel reduction of BF16_Optimizer's flat fp32 gradients gives exactly DeepSpeed's
result, in the plain and the pipeline engine (2 real gloo ranks, each with its own data)."""
import os

import deepspeed
import pytest
import torch
import torch.distributed as dist

from megatron_ds.engine.gradient_reduction import install_flat_gradient_reduction
from megatron_ds.launch.runtime import init_distributed
from tests.distributed import run_distributed

HIDDEN = 24
DS_CONFIG = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
             "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1},
             "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0}


def _squared_error(output, target):
    return (output.float() - target.float()).pow(2).mean()


def _layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(), torch.nn.Linear(2 * HIDDEN, HIDDEN)]


def _batches():
    generator = torch.Generator().manual_seed(100 + dist.get_rank())  # each data-parallel rank its own data
    while True:
        yield (torch.randn(3, HIDDEN, generator=generator).bfloat16(),
               torch.randn(3, HIDDEN, generator=generator).bfloat16())


def _engine(pipelined, config):
    if pipelined:
        model = deepspeed.pipe.PipelineModule(layers=_layers(), num_stages=1, loss_fn=_squared_error)
    else:
        model = torch.nn.Sequential(*_layers())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           dist_init_required=False)
    return engine


def _step(engine, batches):
    if isinstance(engine, deepspeed.PipelineEngine):
        engine.train_batch(data_iter=batches)
        return
    inputs, target = next(batches)
    engine.backward(_squared_error(engine(inputs), target))
    engine.step()


def _weights_after_two_steps(pipelined, config, flat):
    engine = _engine(pipelined, config)
    assert type(engine.optimizer).__name__ == "BF16_Optimizer"
    if flat:
        assert install_flat_gradient_reduction(engine, dist.group.WORLD)
    batches = _batches()
    for _ in range(2):
        _step(engine, batches)
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
