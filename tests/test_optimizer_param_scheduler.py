import math

import pytest
import torch

from megatron_ds.optimizer_param_scheduler import OptimizerParamScheduler


def _scheduler(style, warmup=4, decay=14, max_lr=1.0, min_lr=0.1):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=max_lr)
    return optimizer, OptimizerParamScheduler(optimizer, max_lr, min_lr, warmup, decay, style)


def _trajectory(style, steps=16):
    optimizer, scheduler = _scheduler(style)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return lrs


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_linear_warmup_from_zero(style):
    assert _trajectory(style)[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_linear_decay_reaches_min_lr_at_decay_iters():
    lrs = _trajectory("linear")
    assert lrs[9] == pytest.approx(0.1 + 0.9 * (1 - 5 / 10))
    assert lrs[14] == pytest.approx(0.1) and lrs[15] == pytest.approx(0.1)


def test_cosine_decay():
    lrs = _trajectory("cosine")
    assert lrs[7] == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 3 / 10) + 1))
    assert lrs[14] == pytest.approx(0.1)


def test_constant_after_warmup():
    assert _trajectory("constant")[4:] == pytest.approx([1.0] * 12)


def test_state_round_trip():
    _, scheduler = _scheduler("cosine")
    for _ in range(6):
        scheduler.step()
    optimizer, restored = _scheduler("cosine")
    restored.load_state_dict(scheduler.state_dict())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(scheduler.get_lr())
