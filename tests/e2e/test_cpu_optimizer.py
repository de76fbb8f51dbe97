"""The DeepSpeed JSON's zero_optimization.offload_optimizer in a launch: a ZeRO-1 DP 2 run with the optimizer
offloaded to the CPU (DeepSpeed's CPU Adam) trains like the same run without offload. The flags and CPU Adam as
built: tests/unit/training/test_cpu_optimizer.py."""
import json

import pytest

from tests.support.flags import OFFLOAD
from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON

ITERATIONS = 5


def _flags(tmp_path, name, ds, extra=()):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(ds))
    flags = list(COMMON)
    flags[flags.index("--train-iters") + 1] = str(ITERATIONS)
    return flags + ["--zero-stage", "1", "--deepspeed_config", str(path), *extra]


@pytest.mark.parametrize("precision, rel", [
    # bf16 only (fp32 offload steps the same ZeRO partitions; it matched at rel 1e-5): without offload DeepSpeed
    # wraps the optimizer in its BF16_Optimizer (gradients accumulated over the 2 micro-batches in fp32), with
    # offload in its ZeRO optimizer (accumulated in the bf16 .grad): measured 2.3e-5
    ("bf16", 1e-4)])
def test_zero1_offload_trains_like_without_offload(tmp_path, precision, rel):
    """ZeRO-1, DP 2: the optimizer offloaded to the CPU (DeepSpeed's CPU Adam steps ZeRO's fp32 partitions in CPU
    memory) gives the losses of the same run with torch's AdamW on the device. DeepSpeed refuses ZeRO-Offload with
    any client optimizer other than its CPU Adam, so the offloaded run completing also shows which one ran."""
    extra = ["--bf16"] if precision == "bf16" else []
    offloaded = launch(2, _flags(tmp_path, "offload", OFFLOAD, extra))
    assert_succeeded(offloaded, tail=4000)
    assert "optimizer=AdamW:deepspeed-cpu-adam" in offloaded.stdout, offloaded.stdout[-4000:]
    assert '"offload_optimizer": {"device": "cpu"}' in offloaded.stdout  # the effective config DeepSpeed got
    plain = launch(2, _flags(tmp_path, "plain", {"zero_optimization": {"stage": 1}}, extra))
    assert_succeeded(plain, tail=4000)
    assert "optimizer=AdamW:deepspeed-cpu-adam" not in plain.stdout
    ours, reference = losses(offloaded.stdout), losses(plain.stdout)
    assert sorted(ours) == sorted(reference) == list(range(1, ITERATIONS + 1)), (ours, reference)
    for iteration, loss in reference.items():
        assert ours[iteration] == pytest.approx(loss, rel=rel), (iteration, ours, reference)
