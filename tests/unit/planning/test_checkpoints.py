"""The planner's checkpoint costs: size, write time, and the --save-interval of Young's formula, by hand."""
import math

import pytest

from megatron_ds.planning.checkpoints import checkpoint_section
from megatron_ds.planning.model import Layout
from megatron_ds.planning.parameters import total_parameters
from tests.support.planning_specs import small_model


def test_size_write_time_and_the_interval_that_loses_least():
    model = small_model()  # fp32
    layout = Layout(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, zero_stage=1)
    params = total_parameters(model)
    size = params * (4 + 12)  # the weights; ZeRO-1's own fp32 copy of them and Adam's m and v
    write_gbs = size / 1e9 / 50.0  # written in 50 s
    section = checkpoint_section(model, layout, iteration_s=10.0, write_gbs=write_gbs, mtbf_hours=2.0)
    assert section["bytes"] == size and section["write_s"] == pytest.approx(50.0)
    # sqrt(2 x 50 s x 7200 s) = 848.5 s: 85 iterations of 10 s
    assert math.sqrt(2 * 50 * 7200) == pytest.approx(848.53, abs=0.01)
    assert section["save_interval"] == 85
    assert section["lost_per_failure_s"] == pytest.approx(425.0)
    assert section["overhead_fraction"] == pytest.approx(50 / 850)
    assert "save_interval" not in checkpoint_section(model, layout, 10.0, write_gbs, mtbf_hours=None)
