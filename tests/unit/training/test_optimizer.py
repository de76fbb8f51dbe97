"""The AdamW training steps with: which implementation serves, and that the fused one follows the
for-loop definition."""
import types

import pytest
import torch

from megatron_ds.training.optimizer import adam_implementation, build_adamw

ARGS = types.SimpleNamespace(lr=1e-2, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1, cpu_adam=False)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 3))


def _train(backend, steps=5):
    model = _model()
    optimizer = build_adamw(model, types.SimpleNamespace(**vars(ARGS), fusion_backend=backend), "cpu")
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(4, 7, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("backend, expected", [("auto", "torch-fused"), ("compile", "torch-fused"),
                                               ("reference", "torch-reference")])
def test_cpu_implementation(backend, expected):
    assert adam_implementation(backend, "cpu") == expected
    optimizer, _ = _train(backend, steps=0)
    assert optimizer.defaults["fused"] is (expected == "torch-fused")


def test_no_weight_decay_on_biases_and_norms():
    optimizer, _ = _train("auto", steps=0)
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.ndim == 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and len(plain["params"]) == 4 and all(p.ndim == 1 for p in plain["params"])


def test_fused_follows_reference():
    _, fused = _train("auto")
    _, reference = _train("reference")
    for ours, definition in zip(fused, reference):
        torch.testing.assert_close(ours, definition, rtol=1e-5, atol=1e-6)
    assert not torch.equal(fused[0], _model()[0].weight)  # the steps moved the weights


def test_sgd_steps_by_the_momentum_definition():
    """--optimizer sgd: v = momentum v + (g + wd w); w -= lr v, with no weight decay on biases and norms."""
    from megatron_ds.training.optimizer import build_optimizer
    model = _model()
    args = types.SimpleNamespace(**vars(ARGS), optimizer="sgd", sgd_momentum=0.9, fusion_backend="auto")
    optimizer = build_optimizer(model, args, "cpu")
    weight = model[0].weight
    start = weight.detach().clone()
    velocity = torch.zeros_like(start)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(4, 7, generator=generator)).pow(2).mean().backward()
        velocity = 0.9 * velocity + weight.grad + 0.1 * weight.detach()
        expected = weight.detach() - 1e-2 * velocity
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(weight.detach(), expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(weight, start)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
